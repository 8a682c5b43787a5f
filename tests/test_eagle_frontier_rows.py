"""Every node of an EAGLE draft step attends to its own ancestors: in a step's forward, a frontier
node's row lists the request's committed slots, then the scratch slots of its ancestor chain and
its own; never the request's reserved slots past its committed length, which hold stale KV of
earlier iterations (a stale read changes drafts, not outputs, so output tests cannot see it)."""
from __future__ import annotations

import specjet
from specjet.models.forward_batch import ForwardMode
from test_spec_eagle import random_head


def test_frontier_nodes_read_their_own_ancestors(tmp_path, tiny_model_dir):
    head = random_head(tmp_path / "head", tiny_model_dir)
    with specjet.Engine(model_path=str(tiny_model_dir), speculative_algorithm="EAGLE",
                        speculative_draft_model_path=str(head), speculative_hybrid_ngram_tokens=0,
                        speculative_eagle_topk=4, speculative_num_steps=4, speculative_num_draft_tokens=12,
                        disable_overlap_schedule=True, max_total_tokens=4096,
                        device="cpu") as eng:  # on CUDA the draft steps replay a graph: no Python to record
        drafter = eng.worker.speculator.drafter
        table = eng.scheduler.req_to_token_pool.table
        real_head, rows = drafter.head, []

        class RecordingHead:  # the drafter's head, noting each draft step's rows past the committed length
            def __getattr__(self, name):
                return getattr(real_head, name)

            def __call__(self, fb, features, kv_cache, **kw):
                if fb.mode is ForwardMode.DECODE and fb.batch_size > 1:  # a draft step: k frontier rows
                    (state,) = eng.worker._states.values()
                    (req,) = eng.scheduler.running
                    start = state.committed_len
                    own = table[req.req_pool_idx]
                    for r, n in enumerate(fb.attn.kv_lens.tolist()):
                        rows.append((fb.attn.kv_indices[r, start:n].tolist(), own[start:n].tolist()))
                return real_head(fb, features, kv_cache, **kw)

        drafter.head = RecordingHead()
        eng.generate("The cat sat on the mat.", {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
        eng.check_kv_invariant()
    deeper = [(seen, reserved) for seen, reserved in rows if len(seen) > 1]
    assert len(deeper) >= 4 * 3  # steps 2.. of several iterations, four frontier nodes each
    for seen, reserved in rows:
        assert not set(seen) & set(reserved), "a draft node read the request's reserved slots, not its ancestors"
