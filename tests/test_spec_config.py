"""One speculative configuration: SpecConfig.from_args fills every default in one place, names what
it counts, and refuses out-of-range arguments by name; every drafter implements the Drafter
protocol the speculator runs (no model needed except for EAGLE's and DFLASH's, which are tested end
to end in test_spec_eagle.py and test_dflash_spec.py)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

from specjet.engine.args import EngineArgs
from specjet.spec_v2.config import (DFLASH_MIN_DRAFT_PROB, EAGLE_MIN_DRAFT_PROB, HYBRID_PATH_NODES, NGRAM_TREE_NODES,
                                   QUANTIZED_DFLASH, QUANTIZED_EAGLE, QUANTIZED_HYBRID_PATH_NODES, DFlashParams,
                                   EagleParams, LoneTree, NgramConfig, SpecConfig)
from specjet.spec_v2.dflash_drafter import DFlashDrafter
from specjet.spec_v2.drafter import Drafter
from specjet.spec_v2.eagle_drafter import EagleDrafter
from specjet.spec_v2.hybrid import HybridDrafter
from specjet.spec_v2.ngram import NgramDrafter


def config(**kwargs):
    return SpecConfig.from_args(EngineArgs(**kwargs))


def test_verify_nodes_are_capped_by_default_for_float_weights_on_the_cpu():
    from specjet.spec_v2.config import FLOAT_CPU_MAX_VERIFY_NODES

    def cap(quantized=False, cpu=True, **kwargs):
        return SpecConfig.from_args(EngineArgs(**kwargs), quantized_cpu_target=quantized, cpu_target=cpu).max_verify_nodes

    assert FLOAT_CPU_MAX_VERIFY_NODES == 32
    for algorithm in ("EAGLE", "DFLASH"):
        assert cap(speculative_algorithm=algorithm) == 32
        assert cap(quantized=True, speculative_algorithm=algorithm) is None  # small quantized trees: no cap
        assert cap(cpu=False, speculative_algorithm=algorithm) is None  # a GPU's verify rows are cheap
        assert cap(speculative_algorithm=algorithm, speculative_max_verify_tokens=100) == 100  # given: kept
    assert cap(speculative_algorithm="NGRAM") is None


def test_the_default_cut_grows_with_the_batch_for_free_text_on_a_float_cpu_target():
    """The confidence cut a request's tree gets: the default on a float CPU target is min_draft_prob x
    batch / 2 within [min_draft_prob, BATCH_MIN_DRAFT_PROB_CAP] for a request without a grammar, the
    plain cut under a grammar; a given cut, a quantized target and a GPU keep it at every batch size."""
    import math

    from specjet.spec_v2.config import BATCH_MIN_DRAFT_PROB_CAP

    def cfg(quantized=False, cpu=True, **kwargs):
        return SpecConfig.from_args(EngineArgs(**kwargs), quantized_cpu_target=quantized, cpu_target=cpu)

    assert BATCH_MIN_DRAFT_PROB_CAP == 0.4
    for algorithm, base in (("EAGLE", EAGLE_MIN_DRAFT_PROB), ("DFLASH", DFLASH_MIN_DRAFT_PROB)):
        grows = cfg(speculative_algorithm=algorithm)
        assert grows.min_draft_prob_grows
        cuts = [math.exp(grows.min_draft_logp(b)) for b in (1, 2, 4, 8, 64)]
        assert cuts == pytest.approx([base, base, 2 * base, min(4 * base, 0.4), 0.4])
        assert all(math.exp(grows.min_draft_logp(b, constrained=True)) == pytest.approx(base) for b in (1, 4, 64))
        for fixed in (cfg(speculative_algorithm=algorithm, speculative_draft_min_prob=base),
                      cfg(quantized=True, speculative_algorithm=algorithm), cfg(cpu=False, speculative_algorithm=algorithm)):
            assert not fixed.min_draft_prob_grows
            assert [math.exp(fixed.min_draft_logp(b)) for b in (1, 8)] == pytest.approx([base, base])
        assert cfg(speculative_algorithm=algorithm, speculative_draft_min_prob=0.0).min_draft_logp(8) == -math.inf
    assert cfg(speculative_algorithm="NGRAM").min_draft_logp(8) == -math.inf


def test_a_tiled_bf16_target_widens_a_lone_free_text_dflash_tree_and_lowers_its_cut():
    """On a float CPU target whose bf16 projections run on 16-row AMX tiles, DFLASH's tree for a request without a
    grammar alone in its batch is TILED_BF16_ALONE_TOPK wide and cut at TILED_BF16_ALONE_MIN_DRAFT_PROB; every
    other case keeps the usual width and cut; a given topk or cut wins; EAGLE, quantized and other targets are
    unchanged."""
    import math

    from specjet.spec_v2.config import TILED_BF16_ALONE_MIN_DRAFT_PROB, TILED_BF16_ALONE_TOPK

    def cfg(quantized=False, tiled=True, **kwargs):
        return SpecConfig.from_args(EngineArgs(**kwargs), quantized_cpu_target=quantized, cpu_target=True,
                                    tiled_bf16_target=tiled)

    assert (TILED_BF16_ALONE_TOPK, TILED_BF16_ALONE_MIN_DRAFT_PROB) == (4, 0.06)
    tiled = cfg(speculative_algorithm="DFLASH")
    assert (tiled.alone.topk, tiled.alone.min_draft_prob, tiled.dflash.topk) == (4, 0.06, 3)
    assert math.exp(tiled.min_draft_logp(1)) == pytest.approx(0.06) and tiled.draft_width(1) == 4
    assert math.exp(tiled.min_draft_logp(2, constrained=True)) == pytest.approx(DFLASH_MIN_DRAFT_PROB)
    assert tiled.draft_width(2) is None  # (a lone request under a grammar: the next test)
    assert [math.exp(tiled.min_draft_logp(b)) for b in (2, 4)] == pytest.approx([0.1, 0.2])  # as without tiles
    for same in (cfg(tiled=False, speculative_algorithm="DFLASH"), cfg(quantized=True, speculative_algorithm="DFLASH"),
                 cfg(speculative_algorithm="DFLASH", speculative_eagle_topk=3, speculative_draft_min_prob=0.1)):
        assert (same.alone.topk, same.alone.min_draft_prob, same.draft_width(1)) == (None, None, None)
        assert math.exp(same.min_draft_logp(1)) == pytest.approx(same.min_draft_prob)
    only_cut = cfg(speculative_algorithm="DFLASH", speculative_eagle_topk=2)
    assert (only_cut.alone.topk, only_cut.alone.min_draft_prob) == (None, 0.06)
    only_width = cfg(speculative_algorithm="DFLASH", speculative_draft_min_prob=0.2)
    assert (only_width.alone.topk, only_width.alone.min_draft_prob) == (4, None)
    assert not cfg(speculative_algorithm="EAGLE").alone.is_set()
    solo = SpecConfig.for_guided(EngineArgs(), cpu_target=True, free_text=True, tiled_bf16_target=True).solo
    assert (solo.alone.topk, solo.alone.min_draft_prob) == (4, 0.06)
    for bad in (dict(topk=0), dict(min_draft_prob=1.5), dict(min_draft_prob=float("nan")),
                dict(grammar_topk=0), dict(grammar_min_draft_prob=-0.1), dict(learned_nodes=1)):
        with pytest.raises(ValueError, match="lone request"):
            SpecConfig("DFLASH", alone=LoneTree(**bad))
    for lone in (dict(topk=4), dict(grammar_min_draft_prob=0.02), dict(learned_nodes=16)):
        assert SpecConfig("DFLASH", alone=LoneTree(**lone)).alone.is_set()
        with pytest.raises(ValueError, match="DFLASH's"):
            SpecConfig("EAGLE", alone=LoneTree(**lone))


def test_tiled_bf16_targets_widen_a_lone_constrained_tree_and_keep_learned_nodes_within_a_tile():
    """On a target whose bf16 projections take rows in AMX tiles, DFLASH's tree for a request under a grammar alone
    in its batch is TILED_BF16_ALONE_GRAMMAR_TOPK wide (in place of the chain) and cut at
    TILED_BF16_ALONE_GRAMMAR_MIN_DRAFT_PROB, and a lone request's learned drafts fill at most TILED_ROWS verify
    nodes; batches keep the chain, the usual cut and every node of their share; given arguments win
    (speculative_max_verify_tokens turns the tile's limit off); other targets are unchanged."""
    import math

    from specjet.spec_v2.config import (TILED_BF16_ALONE_GRAMMAR_MIN_DRAFT_PROB, TILED_BF16_ALONE_GRAMMAR_TOPK,
                                        TILED_ROWS)

    def cfg(quantized=False, tiled=True, **kwargs):
        return SpecConfig.from_args(EngineArgs(speculative_algorithm="DFLASH", **kwargs),
                                    quantized_cpu_target=quantized, cpu_target=True, tiled_bf16_target=tiled)

    assert (TILED_BF16_ALONE_GRAMMAR_TOPK, TILED_BF16_ALONE_GRAMMAR_MIN_DRAFT_PROB, TILED_ROWS) == (4, 0.02, 16)
    tiled = cfg()
    assert tiled.dflash.grammar_topk == 1  # the drafter's own width under a grammar: the chain, beside others
    assert tiled.draft_width(1, constrained=True) == 4 and tiled.draft_width(2, constrained=True) is None
    assert math.exp(tiled.min_draft_logp(1, constrained=True)) == pytest.approx(0.02)
    assert math.exp(tiled.min_draft_logp(3, constrained=True)) == pytest.approx(DFLASH_MIN_DRAFT_PROB)
    assert (tiled.learned_nodes(1), tiled.learned_nodes(2)) == (16, None)
    for same in (cfg(tiled=False), cfg(quantized=True)):
        assert (same.draft_width(1, constrained=True), same.learned_nodes(1)) == (None, None)
        assert math.exp(same.min_draft_logp(1, constrained=True)) == pytest.approx(same.min_draft_prob)
    given = cfg(speculative_eagle_topk=2, speculative_draft_min_prob=0.3, speculative_max_verify_tokens=24)
    assert (given.draft_width(1, constrained=True), given.learned_nodes(1), given.dflash.grammar_topk) == (None, None, 2)
    assert math.exp(given.min_draft_logp(1, constrained=True)) == pytest.approx(0.3)
    solo = SpecConfig.for_guided(EngineArgs(), cpu_target=True, free_text=True, tiled_bf16_target=True).solo
    assert solo.learned_nodes(1) == 16


def test_a_draft_requests_learned_budget_keeps_its_forced_chain():
    """DraftRequest.learned_budget: the learned nodes it may fill, within its budget, never short of its forced
    chain (sure tokens, root included)."""
    from specjet.spec_v2.drafter import DraftRequest, SpecInput

    req = SpecInput("r", 0, 3, [1, 2, 3], remaining=100)
    assert DraftRequest(req, 30, None, []).learned_budget() == 30
    assert DraftRequest(req, 30, None, [], learned_nodes=16).learned_budget() == 16
    assert DraftRequest(req, 12, None, [], learned_nodes=16).learned_budget() == 12
    assert DraftRequest(req, 30, None, list(range(20)), learned_nodes=16).learned_budget() == 21


def test_free_text_drafts_only_alone_on_a_quantized_cpu_target():
    from specjet.spec_v2.config import QUANTIZED_FREE_TEXT_DRAFT_BATCH

    def cfg(quantized=False, cpu=True, **kwargs):
        return SpecConfig.from_args(EngineArgs(**kwargs), quantized_cpu_target=quantized, cpu_target=cpu)

    assert QUANTIZED_FREE_TEXT_DRAFT_BATCH == 1
    for algorithm in ("EAGLE", "DFLASH", "NGRAM"):
        assert cfg(quantized=True, speculative_algorithm=algorithm).free_text_draft_batch == 1
        assert cfg(speculative_algorithm=algorithm).free_text_draft_batch is None  # float weights
        assert cfg(cpu=False, speculative_algorithm=algorithm).free_text_draft_batch is None


def test_no_algorithm_no_config():
    assert config() is None


def test_eagle_defaults_and_what_the_counts_mean():
    cfg = config(speculative_algorithm="EAGLE")
    assert cfg.eagle == EagleParams(num_steps=4, topk=4, tree_nodes=12)
    assert cfg.hybrid_path_nodes == HYBRID_PATH_NODES == 14
    # a request's verify tree: the learned tree and the n-gram path under the same root
    assert cfg.max_tree_nodes == cfg.eagle.tree_nodes + cfg.hybrid_path_nodes
    assert cfg.ngram == NgramConfig() and cfg.grammar_aware and cfg.max_verify_nodes is None
    given = config(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=8, speculative_hybrid_ngram_tokens=0, speculative_max_verify_tokens=32,
                   speculative_ngram_max_match_window_size=3, speculative_grammar_aware=False)
    assert given.eagle == EagleParams(num_steps=3, topk=2, tree_nodes=8)
    assert (given.max_tree_nodes, given.hybrid_path_nodes, given.max_verify_nodes) == (8, 0, 32)
    assert given.ngram.max_window == 3 and not given.grammar_aware


def test_defaults_for_a_quantized_cpu_target_are_short_learned_drafts_and_an_ngram_path():
    args = EngineArgs(speculative_algorithm="EAGLE")
    cfg = SpecConfig.from_args(args, quantized_cpu_target=True)
    assert cfg.eagle == QUANTIZED_EAGLE == EagleParams(num_steps=1, topk=1, tree_nodes=2)
    assert cfg.hybrid_path_nodes == QUANTIZED_HYBRID_PATH_NODES == 10 and cfg.max_tree_nodes == 12
    # what the caller sets still wins, argument by argument
    given = SpecConfig.from_args(EngineArgs(speculative_algorithm="EAGLE", speculative_num_steps=3,
                                            speculative_hybrid_ngram_tokens=0), quantized_cpu_target=True)
    assert given.eagle == EagleParams(num_steps=3, topk=1, tree_nodes=2) and given.hybrid_path_nodes == 0
    # DFLASH: a chain of 3 (root and 2 block positions) and the same n-gram path; NGRAM's trees unchanged (its free
    # text beside others verifies its root alone, as the learned drafters')
    dflash = SpecConfig.from_args(EngineArgs(speculative_algorithm="DFLASH"), quantized_cpu_target=True)
    assert dflash.dflash == QUANTIZED_DFLASH == DFlashParams(block_size=3, topk=1, forced_tail=False)
    assert dflash.hybrid_path_nodes == 10 and dflash.max_tree_nodes == 13
    assert config(speculative_algorithm="DFLASH").hybrid_path_nodes == HYBRID_PATH_NODES  # float: as EAGLE
    assert (SpecConfig.from_args(EngineArgs(speculative_algorithm="NGRAM"), quantized_cpu_target=True)
            == dataclasses.replace(config(speculative_algorithm="NGRAM"), free_text_draft_batch=1))


def test_the_engine_picks_the_quantized_defaults_from_the_weights_it_computes_with(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoConfig

    import specjet
    from specjet.models.config import ModelConfig
    from specjet.models.eagle import EagleDraftModel, save_eagle

    head = save_eagle(EagleDraftModel(ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir))), tmp_path,
                      dtype=torch.float32)
    for quantization, expected in ((None, EagleParams()), ("int8", QUANTIZED_EAGLE)):
        with specjet.Engine(model_path=str(tiny_model_dir), quantization=quantization, speculative_algorithm="EAGLE",
                            speculative_draft_model_path=str(head), max_total_tokens=1024, device="cpu") as eng:
            assert eng.worker.speculator.cfg.eagle == expected
            out = eng.generate("Hello", {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
            assert out["meta_info"]["completion_tokens"] == 8
            eng.check_kv_invariant()


def test_a_runner_says_its_rows_come_in_amx_tiles_exactly_where_its_weights_run_on_the_amx_gemm(tiny_model_dir):
    """``ModelRunner.tiled_rows`` (what turns on the tiled DFLASH defaults) is read off the packed weights: float32
    and quantized weights never; bf16 weights where this CPU's bf16 GEMM is the AMX one."""
    from transformers import AutoConfig

    from specjet.kernels import bf16_gemm
    from specjet.models.config import ModelConfig
    from specjet.models.runner import ModelRunner
    from specjet.models.weights import load_state_dict

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir))
    for dtype, quantization, expected in (("float32", None, False), ("float32", "int8", False),
                                          ("bfloat16", None, bf16_gemm.default_isa() == "amx")):
        runner = ModelRunner(config, load_state_dict(tiny_model_dir), dtype, "cpu", 256, 0.0, 1,
                             quantization=quantization)
        assert runner.tiled_rows is expected, (dtype, quantization)


def test_ngram_defaults():
    cfg = config(speculative_algorithm="NGRAM")
    assert cfg.max_tree_nodes == NGRAM_TREE_NODES == 8
    assert cfg.ngram == NgramConfig(max_window=4, min_window=1, max_branches=4)
    assert config(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5,
                  speculative_ngram_max_bfs_breadth=1).max_tree_nodes == 5


@pytest.mark.parametrize("kwargs, error, name", [
    ({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 0}, ValueError, "speculative_eagle_topk"),
    ({"speculative_num_draft_tokens": 0}, ValueError, "speculative_num_draft_tokens"),  # checked without an algorithm too
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5}, ValueError, "min_match_window"),
    ({"speculative_algorithm": "NGRAM", "speculative_hybrid_ngram_tokens": 4}, ValueError, "needs"),
    ({"speculative_algorithm": "EAGLE", "speculative_max_verify_tokens": 0}, ValueError, "max_verify_tokens"),
    ({"speculative_algorithm": "MEDUSA"}, ValueError, "MEDUSA"),
    ({"speculative_algorithm": "eagle"}, ValueError, "available: "),
    ({"speculative_algorithm": "EAGLE3"}, ValueError, r"available: .*\(an EAGLE-3 head runs as 'EAGLE'\)"),  # SGLang's
    ({"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 100000}, ValueError, "<= 256"),
    ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 5000}, ValueError, "speculative_num_steps must be <="),
    ({"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 1}, ValueError, "block size"),
    ({"speculative_algorithm": "DFLASH", "speculative_dflash_draft_window_size": 0}, ValueError, "window_size"),
    ({"speculative_algorithm": "EAGLE", "speculative_dflash_draft_window_size": 64}, ValueError, "needs"),
    ({"speculative_algorithm": "DFLASH", "speculative_draft_min_prob": 1.5}, ValueError, "min_prob"),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_min_prob": -0.1}, ValueError, "min_prob"),
    ({"speculative_algorithm": "DFLASH", "speculative_draft_min_prob": float("nan")}, ValueError, "min_prob"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_min_prob": 0.1}, ValueError, "needs"),
])
def test_out_of_range_arguments_are_named(kwargs, error, name):
    with pytest.raises(error, match=name):
        EngineArgs(**kwargs).validate()
    with pytest.raises(error, match=name):
        config(**kwargs)


def test_min_draft_prob_of_the_wrong_type_is_refused_at_the_door():
    with pytest.raises(TypeError, match="speculative_draft_min_prob"):
        EngineArgs(speculative_algorithm="EAGLE", speculative_draft_min_prob="0.1").validate()


def test_dflash_defaults():
    cfg = config(speculative_algorithm="DFLASH")
    assert cfg.dflash == DFlashParams(block_size=8, window=None, topk=3, grammar_topk=1, forced_tail=True)  # a chain under a grammar
    assert cfg.hybrid_path_nodes == HYBRID_PATH_NODES  # the n-gram path as EAGLE's
    assert cfg.max_tree_nodes == cfg.dflash.block_size + HYBRID_PATH_NODES  # the block and the path under one root
    given = config(speculative_algorithm="DFLASH", speculative_num_draft_tokens=8,
                   speculative_dflash_draft_window_size=512, speculative_eagle_topk=2)
    assert given.dflash == DFlashParams(block_size=8, window=512, topk=2, grammar_topk=2)  # given: for both
    alone = config(speculative_algorithm="DFLASH", speculative_hybrid_ngram_tokens=0)
    assert alone.hybrid_path_nodes == 0 and alone.max_tree_nodes == 8  # the verify chain is the block
    assert cfg.min_draft_prob == DFLASH_MIN_DRAFT_PROB > 0  # the confidence cut
    assert config(speculative_algorithm="DFLASH", speculative_draft_min_prob=0.0).min_draft_prob == 0.0
    assert config(speculative_algorithm="EAGLE").min_draft_prob == EAGLE_MIN_DRAFT_PROB
    hybrid = config(speculative_algorithm="DFLASH", speculative_num_draft_tokens=8, speculative_hybrid_ngram_tokens=6)
    assert (hybrid.hybrid_path_nodes, hybrid.max_tree_nodes) == (6, 14)  # the block and the path under one root


@pytest.mark.parametrize("drafter", [EagleDrafter, NgramDrafter, HybridDrafter, DFlashDrafter])
def test_every_drafter_implements_the_protocol(drafter):
    for name, member in inspect.getmembers(Drafter, inspect.isfunction):
        if name.startswith("_"):
            continue
        impl = getattr(drafter, name, None)
        assert impl is not None, f"{drafter.__name__} lacks {name}"
        assert list(inspect.signature(impl).parameters) == list(inspect.signature(member).parameters), name
    assert "feature_capture" in Drafter.__annotations__
    source = inspect.getsource(drafter)
    assert "feature_capture" in source
