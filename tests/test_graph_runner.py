"""The graph runner (models/graph_runner.py): padded batch buckets on static buffers.

Unit level: which bucket a batch takes, what padded rows and padded columns hold, that buffers are
reused per bucket and grown for a wider table, that outputs are cut to the real batch, and the
argument checks. The engine-level checks (static == eager drafts, both == plain decoding) are in
test_dflash_spec.py and test_spec_eagle.py."""
from __future__ import annotations

import pytest
import torch

from specjet.spec_v2.config import SpecConfig
from specjet.models.graph_runner import GraphRunner


class Recorder:
    """A step that records the buffers it was given and returns per-row sums of them."""

    def __init__(self):
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, buffers):
        self.seen.append({k: v.clone() for k, v in buffers.items()})
        ids, table = buffers["ids"], buffers["table"]
        return ids * 10, table.sum(-1), torch.stack([ids, table[:, 0]], -1)


def make(step, **kw):
    return GraphRunner(step, {"ids": -1, "table": 7}, "cpu", growing=("table",), **kw)


def test_pads_to_the_bucket_and_cuts_outputs():
    step = Recorder()
    runner = make(step, buckets=(1, 2, 4, 8), width_multiple=4)
    ids = torch.tensor([3, 4, 5])
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    out = runner({"ids": ids, "table": table})
    seen = step.seen[-1]
    # Bucket 4: one padded row of pad values; the table padded to width 4 with its pad value.
    assert seen["ids"].tolist() == [3, 4, 5, -1]
    assert seen["table"].tolist() == [[1, 2, 3, 7], [4, 5, 6, 7], [7, 8, 9, 7], [7, 7, 7, 7]]
    assert out[0].tolist() == [30, 40, 50]
    assert out[1].tolist() == [13, 22, 31]
    assert out[2].shape == (3, 2) and out[2][:, 1].tolist() == [1, 4, 7]
    assert runner.stats.padded_rows == 1 and runner.stats.calls == 1


def test_buffers_are_reused_per_bucket_and_stale_rows_are_cleared():
    step = Recorder()
    runner = make(step, buckets=(2, 4), width_multiple=8)
    runner({"ids": torch.tensor([1, 2, 3, 4]), "table": torch.ones(4, 5, dtype=torch.int64)})
    first = step.seen[-1]
    runner({"ids": torch.tensor([9]), "table": torch.full((1, 3), 2)})  # bucket 2
    runner({"ids": torch.tensor([5, 6, 7]), "table": torch.full((3, 6), 3)})  # bucket 4 again, same width 8
    again = step.seen[-1]
    assert first["ids"].shape == again["ids"].shape == (4,)
    # Last time's fourth row must not survive as this call's padding.
    assert again["ids"].tolist() == [5, 6, 7, -1]
    assert again["table"][3].tolist() == [7] * 8 and again["table"][0].tolist() == [3] * 6 + [7] * 2
    assert len(runner._states) == 2  # (bucket 4, width 8) and (bucket 2, width 8)
    runner({"ids": torch.tensor([5, 6, 7]), "table": torch.full((3, 9), 1)})  # wider than 8: a new buffer of 16
    assert step.seen[-1]["table"].shape == (4, 16) and len(runner._states) == 3


def test_wider_than_every_bucket_runs_eagerly_unpadded():
    step = Recorder()
    runner = make(step, buckets=(1, 2))
    out = runner({"ids": torch.arange(5), "table": torch.zeros(5, 3, dtype=torch.int64)})
    assert step.seen[-1]["ids"].shape == (5,) and out[0].tolist() == [0, 10, 20, 30, 40]
    assert runner.stats.eager_calls == 1


def test_fixed_trailing_sizes_are_not_padded():
    seen = []

    def step(buffers):
        seen.append(buffers["features"].shape)
        return (buffers["features"].sum(-1),)

    runner = GraphRunner(step, {"features": 0.0}, "cpu", buckets=(4,))
    (out,) = runner({"features": torch.ones(3, 5)})
    assert seen == [(4, 5)] and out.tolist() == [5.0, 5.0, 5.0]


def test_argument_checks():
    step = Recorder()
    with pytest.raises(ValueError, match="buckets"):
        make(step, buckets=(4, 2))
    with pytest.raises(ValueError, match="CUDA graphs"):
        make(step, capture=True)
    with pytest.raises(ValueError, match="no pad value"):
        GraphRunner(step, {"ids": 0}, "cpu", growing=("table",))
    runner = make(step)
    with pytest.raises(ValueError, match="differ from its pad values"):
        runner({"ids": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="batch size"):
        runner({"ids": torch.zeros(2, dtype=torch.int64), "table": torch.zeros(3, 1, dtype=torch.int64)})


@pytest.mark.parametrize("mode,device,cuda_graph,expected", [
    ("auto", "cpu", True, (False, False)), ("static", "cpu", True, (True, False)),
    ("eager", "cpu", True, (False, False)), ("auto", "cuda", True, (True, True)),
    ("auto", "cuda", False, (False, False)), ("static", "cuda", False, (True, False)),
    ("eager", "cuda", True, (False, False))])
def test_runner_mode_per_device(mode, device, cuda_graph, expected):
    cfg = SpecConfig("NGRAM", draft_runner=mode, cuda_graph=cuda_graph)
    assert cfg.runner_mode(device) == expected


def test_engine_rejects_an_unknown_runner():
    from specjet.engine.args import EngineArgs

    with pytest.raises(ValueError, match="speculative_draft_runner"):
        EngineArgs.from_kwargs(speculative_draft_runner="graphs")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def gather_and_project(weight: torch.Tensor):
    """A step like a drafter's: an embedding gather by id, a matmul, a masked reduction over a
    padded table, and an argmax (ops a captured graph must replay on whatever the buffers hold)."""

    def step(buffers):
        hidden = torch.tanh(weight[buffers["ids"].clamp_min(0)] @ weight.T)
        mask = buffers["table"] > 0
        pooled = (hidden[:, : buffers["table"].shape[-1]] * mask).sum(-1)
        return hidden.argmax(-1), pooled

    return step


@needs_cuda
def test_captured_graph_replays_equal_eager_runs():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 64, generator=gen).cuda()
    step = gather_and_project(weight)
    captured = GraphRunner(step, {"ids": 0, "table": 0}, "cuda", growing=("table",), buckets=(2, 4),
                                width_multiple=16)
    eager = GraphRunner(step, {"ids": 0, "table": 0}, "cuda", capture=False, growing=("table",),
                             buckets=(2, 4), width_multiple=16)
    assert captured.capture and not eager.capture
    held = []
    for batch, width in [(3, 5), (3, 9), (1, 12), (4, 16), (2, 3), (3, 5)]:
        inputs = {"ids": torch.randint(0, 50, (batch,), generator=gen).cuda(),
                  "table": torch.randint(-3, 4, (batch, width), generator=gen).cuda()}
        got, want = captured(dict(inputs)), eager(dict(inputs))
        for g, w in zip(got, want):
            assert g.shape[0] == batch and torch.equal(g, w)
        held.append((got, want))
    # One capture per (bucket, width) key: buckets 4 and 2 at width 16.
    assert captured.stats.captures == 2 == len(captured._states)
    # Outputs handed out earlier are copies: later replays of the same graph left them alone.
    for got, want in held:
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_failed_capture_falls_back_to_eager_runs(monkeypatch):
    """A capture that raises (a non-capturable library call on a GPU) costs the batch nothing: it runs
    eagerly on the buffers, and so does every later call of that runner."""
    step = Recorder()
    runner = make(step, buckets=(2, 4), width_multiple=4)
    runner.capture = True  # as on CUDA; the capture itself is made to fail below

    def broken_capture(state):
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED during capture")

    monkeypatch.setattr(runner, "_capture", broken_capture)
    ids, table = torch.tensor([3, 4, 5]), torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    out = runner({"ids": ids, "table": table})
    assert out[0].tolist() == [30, 40, 50] and out[1].tolist() == [13, 22, 31]
    assert runner.capture is False and runner.stats.capture_failures == 1
    again = runner({"ids": torch.tensor([9]), "table": torch.tensor([[1, 1, 1]])})
    assert again[0].tolist() == [90] and runner.stats.capture_failures == 1
