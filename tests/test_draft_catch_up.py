"""Root-only trees leave a learned drafter's extend for later (spec_v2/catch_up.py): the positions'
features wait, and one batched catch-up (the drafter's after_prefill) brings the draft state where
the per-iteration extends would have: the trees drafted afterwards are the same, and so are the ids."""
from __future__ import annotations

import pytest
import torch

import specjet
from specjet.models.forward_batch import ModelOutput
from specjet.spec_v2.catch_up import PendingPositions
from specjet.spec_v2.drafter import SpecInput
from specjet.spec_v2.tree_verifier import VerifyResult
from test_dflash_spec import _config, tiny_model_dir  # noqa: F401 (the module's tiny cyclic target)
from test_spec_eagle import random_head


def _verify(hidden: torch.Tensor, accepted: list[list[int]], nodes: list[list[int]], offsets: list[int]):
    return VerifyResult(accepted, nodes, ModelOutput(logits=torch.zeros(hidden.shape[0], 4), hidden=hidden), offsets)


def test_runs_accumulate_and_come_back_in_position_order():
    pending = PendingPositions(max_pending=3)
    a = SpecInput("a", 0, 10, list(range(11)), 5)
    b = SpecInput("b", 1, 4, list(range(100, 105)), 5)
    # One root-only verify of both: a's root row 0, b's row 1; the bonus tokens 11 and 105.
    hidden = torch.arange(8.0).view(2, 4)
    assert pending.after_root_only([a, b], _verify(hidden, [[11], [105]], [[0], [0]], [0, 1])) is None
    assert pending.pending("a") == 1 and pending.pending("b") == 1
    a = SpecInput("a", 0, 11, list(range(12)), 4)
    assert pending.after_root_only([a], _verify(hidden + 10, [[12]], [[0]], [1])) is None  # a's row is 1 here
    # a drafts: positions 10 and 11, the tokens after them 11 and the root 12 (token_ids[12] once it is known).
    a = SpecInput("a", 0, 12, list(range(13)), 3)
    work = pending.before_drafting([a])
    assert [(r.rid, r.committed_len, r.token_ids) for r in work.inputs] == [("a", 10, list(range(12)))]
    assert work.next_tokens == [12]
    assert torch.equal(work.features, torch.stack([hidden[0], hidden[1] + 10]))
    assert "a" not in pending and pending.before_drafting([a]) is None
    # b reaches the cap of 3 with a verify that accepted a draft too (two positions: 5 and 6).
    b = SpecInput("b", 1, 5, list(range(100, 106)), 4)
    work = pending.after_root_only([b], _verify(hidden, [[106, 107]], [[0, 1]], [0]))
    assert [(r.committed_len, r.token_ids) for r in work.inputs] == [(4, list(range(100, 107)))]
    assert work.next_tokens == [107] and torch.equal(work.features, torch.stack([hidden[1], hidden[0], hidden[1]]))
    assert "b" not in pending


def test_a_run_that_does_not_end_at_the_committed_length_is_an_error():
    pending = PendingPositions()
    r = SpecInput("r", 0, 3, [1, 2, 3, 4], 5)
    pending.after_root_only([r], _verify(torch.zeros(1, 2), [[5]], [[0]], [0]))
    with pytest.raises(RuntimeError, match="pending draft positions 3 .. 3"):
        pending.before_drafting([SpecInput("r", 0, 6, [1] * 7, 5)])
    pending.drop("r")
    assert "r" not in pending


@pytest.fixture(scope="module")
def random_drafts(tmp_path_factory, tiny_model_dir):
    """Random drafts whose trees depend on every position's draft state: an EAGLE-3 head and a DFlash
    draft with the root context (the shapes of the drafts shipped for the default model)."""
    from specjet.models.dflash import DFlashDraftModel, DFlashShape, save_dflash

    torch.manual_seed(1)
    dflash = DFlashDraftModel(_config(tiny_model_dir), DFlashShape(2, (0,), 8, 0, True))
    dflash.reset_parameters(std=0.3)
    return {"EAGLE": random_head(tmp_path_factory.mktemp("eagle3"), tiny_model_dir, feature_layers=(0,)),
            "DFLASH": save_dflash(dflash, tmp_path_factory.mktemp("dflash"), dtype=torch.float32)}


@pytest.mark.parametrize("algorithm", ["EAGLE", "DFLASH"])
def test_caught_up_drafts_equal_extended_ones(tiny_model_dir, random_drafts, algorithm, monkeypatch):
    """int8 weights on the CPU: in a batch of two, free text verifies its root alone; the long request
    then drafts alone. With the catch-up (one at the cap of 16 positions, one before drafting again)
    every tree is the one the drafter's extend after every verify gives, and the ids are plain
    decoding's."""
    from specjet.spec_v2.speculator import Speculator

    prompts = ["The cat sat on the mat. The cat", "1 2 3 4 1 2"]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (26, 64)]
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu", quantization="int8") as plain:
        expected = [o["output_ids"] for o in plain.generate(prompts, params)]
        plain.check_kv_invariant()

    trees, caught_up = {}, []
    real_run, real_catch_up = Speculator._run, Speculator._catch_up

    def run(self, reqs, sampling, req_to_token, share, budgets):
        real_propose = self.drafter.propose

        def propose(drafts, share, req_to_token):
            out = real_propose(drafts, share, req_to_token)
            trees[lazy].append([(d.input.committed_len, t) for d, t in zip(drafts, out)])
            return out

        self.drafter.propose = propose
        try:
            return real_run(self, reqs, sampling, req_to_token, share, budgets)
        finally:
            del self.drafter.propose

    def catch_up(self, work, req_to_token):
        if work is not None:
            caught_up.append([len(r.token_ids) - r.committed_len for r in work.inputs])
        return real_catch_up(self, work, req_to_token)

    monkeypatch.setattr(Speculator, "_run", run)
    monkeypatch.setattr(Speculator, "_catch_up", catch_up)
    outs = {}
    for lazy in (True, False):
        trees[lazy] = []
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu", quantization="int8",
                            speculative_algorithm=algorithm, speculative_draft_model_path=str(random_drafts[algorithm]),
                            speculative_hybrid_ngram_tokens=0, speculative_num_draft_tokens=4,
                            speculative_draft_min_prob=0.0, disable_overlap_schedule=True,
                            speculative_measured_payoff=False) as eng:  # trees must not depend on timings
            spec = eng.worker.speculator
            if not lazy:  # the drafter's own after_verify after every verify, root-only trees included
                spec._after_verify = lambda reqs, budgets, result, table: spec.drafter.after_verify(reqs, result, table)
            outs[lazy] = [o["output_ids"] for o in eng.generate(prompts, params)]
            eng.check_kv_invariant()
    assert outs[True] == expected and outs[False] == expected
    assert trees[True] == trees[False]
    assert any(len(it) == 1 and len(it[0][1][0]) > 1 for it in trees[True])  # the long request drafted alone
    assert any(16 in work for work in caught_up)  # at the cap
    assert any(n < 16 for work in caught_up for n in work)  # before drafting again
