"""The draft's weights (``speculative_draft_model_quantization``): "auto" picks the target's method for a
quantized target and int8 beside a float target on a CPU with the vectorised kernels; every method
keeps speculation lossless (greedy ids equal plain decoding's, KV invariant after each workload), the
draft's projections and hot head really take the method, and the engine reports what it chose."""
from __future__ import annotations

import os

import pytest
import torch

import specjet
from specjet.kernels import qgemm
from specjet.kernels.bf16_gemm import Bf16Linear
from specjet.kernels.fp32_gemm import Fp32Linear
from specjet.kernels.linear import PackedLinear

FLOAT_OPERANDS = (PackedLinear, Bf16Linear, Fp32Linear)  # oneDNN's plans, or specjet's bf16 or float32 GEMM
from specjet.kernels.qgemm import QuantizedLinear
from specjet.models.quantize import choose_draft_method
from test_dflash_spec import make_copy_draft
from test_spec_eagle import copy_head

PROMPTS = [[1, 9, 42, 42, 7, 100 + i, 42, 7] * (2 + i) for i in range(3)]
PARAMS = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
CPU = torch.device("cpu")


def test_auto_follows_a_quantized_target_and_takes_int8_beside_a_float_one():
    assert choose_draft_method("auto", "gguf", CPU)[0] == "gguf"
    assert choose_draft_method("auto", "int4", CPU)[0] == "int4"
    method, why = choose_draft_method("auto", None, CPU)
    assert method == ("int8" if qgemm.extension() is not None and qgemm.default_isa() != "scalar" else None), why
    assert choose_draft_method("auto", None, torch.device("cuda"))[0] is None  # the kernels are CPU kernels


@pytest.mark.parametrize("method", [None, "int8", "int4", "gguf"])
def test_an_explicit_draft_method_is_kept(method):
    assert choose_draft_method(method, "gguf", CPU)[0] == method
    assert choose_draft_method(method, None, CPU)[0] == method


def test_an_explicit_draft_method_needs_the_cpu():
    with pytest.raises(ValueError, match="CPU kernels only"):
        choose_draft_method("int8", None, torch.device("cuda"))
    assert choose_draft_method(None, None, torch.device("cuda"))[0] is None


def test_auto_keeps_a_float_draft_where_the_kernels_would_run_scalar(monkeypatch):
    monkeypatch.setattr(qgemm, "default_isa", lambda: "scalar")
    method, why = choose_draft_method("auto", None, CPU)
    assert method is None and "AVX2" in why


def test_an_unknown_draft_method_is_refused_at_the_door(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative_draft_model_quantization 'int3'"):
        specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="EAGLE",
                       speculative_draft_model_quantization="int3")
    with pytest.raises((TypeError, ValueError), match="speculative_draft_model_quantization"):
        specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="EAGLE",
                       speculative_draft_model_quantization=8)


@pytest.mark.parametrize("algorithm", [None, "NGRAM"])
def test_a_draft_method_without_a_learned_draft_is_refused(tiny_model_dir, algorithm):
    with pytest.raises(ValueError, match="speculative_draft_model_quantization .* needs"):
        specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm=algorithm,
                       speculative_draft_model_quantization="int8")


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048, disable_guided_drafting=True) as eng:
        out = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
        eng.check_kv_invariant()
    return out


def _operands(drafter):
    """The draft's own projections' operands and its (hot) head's."""
    from specjet.models.llama import Linear

    model = drafter.head if hasattr(drafter, "head") else drafter.draft
    linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and not name.startswith("target")]
    return [m.packed for m in linears], model.target.lm_head.packed


@pytest.mark.parametrize("algorithm", ["EAGLE", "DFLASH"])
@pytest.mark.parametrize("method", ["auto", None, "int8", "int4"])
def test_every_draft_method_keeps_greedy_output_exact(tiny_model_dir, tmp_path, expected, algorithm, method):
    hot = torch.tensor(sorted({t for ids in expected for t in ids} | {0, 1, 2}))
    if algorithm == "EAGLE":
        path = copy_head(tmp_path, tiny_model_dir, expected)
    else:
        path = make_copy_draft(tmp_path, tiny_model_dir, hot)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048, speculative_algorithm=algorithm,
                        speculative_draft_model_path=str(path), speculative_draft_model_quantization=method) as eng:
        got = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
        eng.check_kv_invariant()
        info = eng.get_server_info()
        drafter = eng.worker.speculator.drafter
        drafter = getattr(drafter, "learned", drafter)  # a hybrid drafter wraps the learned one
    assert got == expected
    assert info["stats"]["spec_accepted_tokens"] > info["stats"]["spec_verify_ct"]  # drafts were taken
    # auto beside a float target: int8 where the quantized kernels run vectorised (the extension built,
    # and ATen itself on AVX2 or wider; SPECJET_QGEMM_ISA=scalar forces them scalar), else float.
    vectorised = (qgemm.extension() is not None and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
                  and os.environ.get("SPECJET_QGEMM_ISA", "").strip().lower() != "scalar")
    resolved = ("int8" if vectorised else None) if method == "auto" else method
    assert info["draft_quantization"] == resolved and info["quantization"] is None
    projections, head = _operands(drafter)
    if resolved is None:
        assert all(isinstance(p, FLOAT_OPERANDS) for p in projections) and isinstance(head, FLOAT_OPERANDS)
    else:  # the tiny model's widths are whole 32-blocks: every projection and the hot head quantized
        assert all(isinstance(p, QuantizedLinear) for p in projections) and isinstance(head, QuantizedLinear)


def test_a_float_draft_beside_a_quantized_target_stays_float(cyclic_model_dir, tmp_path):
    """None is a float draft even when the target computes with quantized weights (its hot head
    is the target head's own quantized rows)."""
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, device="cpu", quantization="int8") as eng:
        expected = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
        eng.check_kv_invariant()
    path = copy_head(tmp_path, cyclic_model_dir, expected)
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, device="cpu", quantization="int8",
                        speculative_algorithm="EAGLE", speculative_draft_model_path=str(path),
                        speculative_hybrid_ngram_tokens=0, speculative_draft_model_quantization=None) as eng:
        got = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]
        eng.check_kv_invariant()
        info = eng.get_server_info()
        projections, head = _operands(eng.worker.speculator.drafter)
    assert got == expected and info["draft_quantization"] is None and info["quantization"] == "int8"
    assert all(isinstance(p, FLOAT_OPERANDS) for p in projections) and isinstance(head, QuantizedLinear)


@pytest.mark.parametrize("algorithm", ["EAGLE", "DFLASH"])
def test_a_draft_for_a_quantized_target_is_loaded_quantized(algorithm, cyclic_model_dir, tmp_path, monkeypatch):
    """The speculator loads a draft already quantized with the method it computes with: no float row plan of the
    draft's projections is checked (a part of an engine's start), ``bind_target`` does not quantize it again, and
    its operands compute as those of a draft packed as float first and quantized by ``bind_target``."""
    from specjet.kernels import linear
    from specjet.models import dflash, eagle
    from specjet.models.llama import Linear
    from specjet.models.quantize import quantize_model
    from model_harness import load_runner

    target = load_runner(cyclic_model_dir).model
    quantize_model(target, "int8")
    if algorithm == "EAGLE":
        path, load = copy_head(tmp_path, cyclic_model_dir, [[1, 2, 3]]), eagle.load_eagle
    else:
        path, load = make_copy_draft(tmp_path / "draft", cyclic_model_dir), dflash.load_dflash
    config = target.config
    before = load(path, config).bind_target(target)  # packed as float, then quantized by bind_target

    checked = []
    choose_plan = linear.choose_plan
    monkeypatch.setattr(linear, "choose_plan", lambda w, *a: checked.append(tuple(w.shape)) or choose_plan(w, *a))
    monkeypatch.setattr(linear, "_PLANS", {})
    draft = load(path, config, quantization=eagle.draft_method(target, eagle.FOLLOW_TARGET))

    def packed_again(*_args):
        raise AssertionError("packed or quantized again")
    monkeypatch.setattr(eagle, "quantize_linears", packed_again)  # bind_target's compute_with calls these
    monkeypatch.setattr(eagle, "pack_linears", packed_again)
    draft.bind_target(target)
    assert checked == [] and draft.packed_quantization == "int8"
    pairs = [(a, b) for (_, a), (_, b) in zip(draft.named_modules(), before.named_modules()) if isinstance(a, Linear)]
    assert pairs and all(isinstance(a.packed, QuantizedLinear) for a, _ in pairs)
    gen = torch.Generator().manual_seed(0)
    for a, b in pairs:
        x = torch.randn(5, a.weight_t.shape[0], generator=gen)
        assert torch.equal(a.packed(x), b.packed(x))


@pytest.mark.parametrize("algorithm", ["EAGLE", "DFLASH"])
def test_bind_target_repacks_a_loaded_draft_for_another_method(algorithm, cyclic_model_dir, tmp_path):
    """A draft loaded for one method and bound with another computes with the one it is bound with, float
    included: loaded int8 and bound as float, its projections compute as a draft loaded float; loaded float and
    bound int8, as one loaded int8."""
    from specjet.models import dflash, eagle
    from specjet.models.llama import Linear
    from model_harness import load_runner

    target = load_runner(cyclic_model_dir).model
    if algorithm == "EAGLE":
        path, load = copy_head(tmp_path, cyclic_model_dir, [[1, 2, 3]]), eagle.load_eagle
    else:
        path, load = make_copy_draft(tmp_path / "draft", cyclic_model_dir), dflash.load_dflash
    config = target.config

    def linears(model):
        return [m for m in model.modules() if isinstance(m, Linear)]

    gen = torch.Generator().manual_seed(0)
    for loaded, bound in (("int8", None), (None, "int8")):
        draft = load(path, config, quantization=loaded).bind_target(target, quantization=bound)
        reference = load(path, config, quantization=bound)
        assert draft.packed_quantization == bound
        pairs = list(zip(linears(draft), linears(reference)))
        assert pairs and all(isinstance(a.packed, QuantizedLinear) == (bound is not None) for a, _ in pairs)
        for a, b in pairs:
            x = torch.randn(5, a.weight_t.shape[0], generator=gen)
            assert torch.equal(a.packed(x), b.packed(x))


def test_the_default_engines_free_text_draft_takes_the_method_asked_for():
    """The default engine (no algorithm) drafts free text with the default model's DFlash draft: its weights' method
    is speculative_draft_model_quantization's (it was refused as needing an algorithm), and the reply is plain
    decoding's greedy ids whatever the draft's weights."""
    from specjet.models.weights import default_gguf_path

    params = {"temperature": 0, "max_new_tokens": 24}
    outs = {}
    for method, model_path in ((None, None), ("int8", str(default_gguf_path()))):  # the default model named too
        with specjet.Engine(model_path=model_path, max_total_tokens=2048,
                            speculative_draft_model_quantization=method) as eng:
            assert eng.get_server_info()["draft_quantization"] == method
            outs[method] = eng.generate("The capital of France is", params)["output_ids"]
            eng.check_kv_invariant()
    with specjet.Engine(max_total_tokens=2048, disable_free_text_drafting=True) as plain:
        expected = plain.generate("The capital of France is", params)["output_ids"]
        plain.check_kv_invariant()
    assert outs[None] == expected and outs["int8"] == expected


@pytest.mark.parametrize("change", [{}, {"disable_free_text_drafting": True}, {"disable_guided_drafting": True},
                                    {"enable_deterministic_inference": False}, {"model_path": "TINY"}])
def test_a_draft_method_no_free_text_draft_would_take_is_refused_at_the_door(tiny_model_dir, change):
    """Without an algorithm the method applies to the default engine's free-text draft alone: where none would load
    (a model without a draft, or free-text drafting off), the arguments are refused before any model loads."""
    from specjet.engine.args import EngineArgs

    kwargs = dict({"speculative_draft_model_quantization": "int8"}, **change)
    if kwargs.get("model_path") == "TINY":
        kwargs["model_path"] = str(tiny_model_dir)
    args = EngineArgs(**kwargs)
    if not change:  # the default model with its draft: taken
        args.validate()
        assert args.drafts_free_text("cpu") and not args.drafts_free_text("cuda")
        return
    with pytest.raises(ValueError, match="speculative_draft_model_quantization sets a learned draft's weights"):
        args.validate()
