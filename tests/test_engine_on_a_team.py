"""The engine on two threads, where a prefill's and a verify's projections run on a team of threads with the
layer's norms, RoPE + KV write and SiLU inside it (csrc/cpu_ops.h run_team; the rest of the suite runs one thread
per xdist worker, where no team forms): speculative greedy output (EAGLE with a head that guesses right, DFLASH
with a random draft, NGRAM), with and without the overlap loop, equals plain greedy output token for token, plain
output on two threads equals plain output on one, batched equals alone, and the KV invariant holds after every
workload. The copy head and the random draft rarely or never guess this target right: what they test is that a
verify of their whole trees on a team commits exactly the plain path's tokens; the n-gram drafts are accepted."""
from __future__ import annotations

import pytest
import torch

import specjet
from conftest import make_tiny_model_dir
from specjet.kernels.cpu_ops import extension
from test_dflash_spec import make_wrong_draft
from test_spec_eagle import PROMPTS, copy_head, greedy

TEAM = 2


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory, default_model_dir):
    """Wide enough that a verify's GEMMs form a team (tests/test_layer_stack.py's wide model)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("wide-llama-team"), default_model_dir, hidden_size=256,
                               intermediate_size=1024, weight_std=0.05)


@pytest.fixture(params=[("float32", "int4"), ("float32", "int8"), ("bfloat16", None)], ids=["int4", "int8", "bf16"])
def weights(request, monkeypatch):
    dtype, quantization = request.param
    if quantization is None:  # bf16 weights on specjet's VDPBF16PS kernel, the one that fuses row ops
        from specjet.kernels import bf16_gemm

        if "avx512_bf16" not in bf16_gemm.supported_isas():
            pytest.skip("this CPU does not run the avx512_bf16 bf16 GEMM")
        request.addfinalizer(bf16_gemm.default_isa.cache_clear)
        monkeypatch.setenv(bf16_gemm.ISA_ENV, "avx512_bf16")
        bf16_gemm.default_isa.cache_clear()
    return {"dtype": dtype, "quantization": quantization}


def run(model_dir, threads: int, **kwargs) -> tuple[list[list[int]], list[list[int]], dict, list[int]]:
    """PROMPTS batched, then each alone (a quantized target's learned drafters draft free text alone, not beside
    others: SpecConfig.free_text_draft_batch), on an engine whose threads compute on `threads` threads; the stats of
    the runs alone, and the GEMM calls that ran on a team in the batch and alone (the prompts again: their prefix is
    cached, so alone they prefill nothing)."""
    ext = extension()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the engine's threads take the process's count when they start
    before = ext.team_runs()
    try:
        with specjet.Engine(model_path=str(model_dir), max_total_tokens=4096, **kwargs) as eng:
            outs = [o["output_ids"] for o in eng.generate(PROMPTS, greedy(40))]
            eng.check_kv_invariant()
            batched, teams = eng.get_server_info()["stats"], [ext.team_runs() - before]
            alone = [eng.generate(p, greedy(40))["output_ids"] for p in PROMPTS]
            eng.check_kv_invariant()
            stats = eng.get_server_info()["stats"]
            teams.append(ext.team_runs() - before - teams[0])
    finally:
        torch.set_num_threads(previous)
    spec = {k: stats.get(k, 0) - batched.get(k, 0) for k in ("spec_verify_ct", "spec_accepted_tokens")}
    return outs, alone, spec, teams


def test_speculative_on_a_team_equals_plain(wide_model_dir, weights, tmp_path):
    assert extension() is not None, "the C++ extension is part of the install"
    expected, alone, _, teams = run(wide_model_dir, TEAM, **weights)
    assert teams[0] > 0 and teams[1] == 0, teams  # the prefills' projections; a decode step's few rows take none
    assert alone == expected
    assert run(wide_model_dir, 1, **weights)[:2] == (expected, expected)  # no team at all: the same ids

    head = copy_head(tmp_path / "head", wide_model_dir, expected)
    draft = make_wrong_draft(tmp_path / "dflash", wide_model_dir)
    for kwargs in [
        {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head), "speculative_eagle_topk": 4,
         "speculative_num_steps": 3, "speculative_num_draft_tokens": 8, "page_size": 16},
        {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head), "speculative_eagle_topk": 2,
         "speculative_num_steps": 4, "speculative_num_draft_tokens": 8, "disable_overlap_schedule": True},
        {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(draft),
         "speculative_num_draft_tokens": 16, "speculative_draft_min_prob": 0.0, "page_size": 16},
        {"speculative_algorithm": "NGRAM", "disable_overlap_schedule": True},
        {"speculative_algorithm": "NGRAM"},
    ]:
        if kwargs["speculative_algorithm"] != "NGRAM":  # the learned drafters' own trees, whole
            kwargs = dict(kwargs, speculative_hybrid_ngram_tokens=0)
        outs, alone, spec, teams = run(wide_model_dir, TEAM, speculative_measured_payoff=False, **weights, **kwargs)
        assert outs == expected, kwargs
        assert alone == expected, kwargs
        assert spec["spec_verify_ct"] > 0 and teams[1] > 0, (kwargs, spec, teams)  # the verifies' (drafts')
        if kwargs["speculative_algorithm"] == "NGRAM":  # this target repeats itself: whole runs accepted
            assert spec["spec_accepted_tokens"] > spec["spec_verify_ct"], (kwargs, spec)
