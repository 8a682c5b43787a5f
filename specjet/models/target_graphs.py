"""The target's decode and verify forwards on static buffers: CUDA graphs for the big model.

A decode step (one new token per request) and a speculative verify (a tree of at most ``nodes`` new
tokens per request) have a fixed shape once the batch is padded to a bucket and each request's new
tokens to a fixed width, so they run through ``GraphRunner`` like the drafters' forwards: on CUDA
each bucket's forward is captured once and replayed (no Python, no kernel launches; on a small model
the eager forward is launch-bound), elsewhere the same padded buffers run eagerly (the tests' path).

The layout keeps the eager forward's: the batch's new tokens sit flat in batch order from row 0
(request b's at ``q_starts[b]``), and the padding of the flat [bucket * nodes] token buffer comes
after them. A padded token writes the KV pool's padding slot 0 and belongs to no request (its
outputs are garbage and dropped); a padded request has one of the padded tokens and sees only
that token (``_PADS``). Each kept row is computed exactly as in the eager forward: the kernels are
batch-invariant (a row's bits do not depend on the rows beside it, see ``enable_deterministic_inference``)
and the attention loops over each request's own KV length, read on the device.
"""
from __future__ import annotations

import torch

from specjet.models.forward_batch import CaptureHidden, ForwardBatch, ForwardMode, ModelOutput
from specjet.models.graph_runner import GraphRunner

# A verify's outputs are [bucket, nodes, vocab] floats: wide batches of trees run eagerly instead
# of holding a graph's worth of logits per bucket.
VERIFY_BUCKETS = (1, 2, 4, 8, 16)
# A padded request has one new token (the CPU's kernels want one at least) that sees only itself
# (its KV position 0 is read from the table's row 0, whatever it holds; ``_step`` opens its mask
# entry) and writes slot 0.
_PADS = {"ids": 0, "positions": 0, "slots": 0, "rows": 0, "q_lens": 1, "kv_lens": 1}


class TargetGraphs:
    """Decode and verify forwards of ``runner`` (a ``ModelRunner``) through padded batch buckets,
    reading KV slots from ``req_to_token``; ``capture``: record CUDA graphs (None: on CUDA)."""

    def __init__(self, runner, req_to_token: torch.Tensor, capture: bool | None = None):
        self.runner = runner
        self.table = req_to_token
        self.capture = runner.device.type == "cuda" if capture is None else capture
        # A padded decode row is (-1, -1, -1): a negative position marks it (``_decode_step``).
        self._decode = GraphRunner(self._decode_step, {"decode": -1}, runner.device, capture=self.capture)
        self._verify: dict[object, GraphRunner] = {}  # one per hidden-state capture

    def stats(self) -> dict:
        runners = {"decode": self._decode, **{f"verify {k!r}": r for k, r in self._verify.items()}}
        return {name: {"calls": r.stats.calls, "eager_calls": r.stats.eager_calls, "captures": r.stats.captures,
                       "padded_rows": r.stats.padded_rows} for name, r in runners.items()}

    def decode(self, requests: torch.Tensor) -> ModelOutput:
        """Logits of each request's next token: ``requests`` [B, 3] int64 (on the host or the device)
        holds (token id, its position, the request's row of the table) per request."""
        batch = requests.shape[0]
        (logits,) = self._decode({"decode": requests})
        return ModelOutput(logits=logits[:batch, 0])

    def verify(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
               q_lens: torch.Tensor, kv_lens: torch.Tensor, mask: torch.Tensor, nodes: int,
               capture_hidden: CaptureHidden) -> ModelOutput:
        """A verify forward (``ForwardBatch.build``'s arguments; ``ids``, ``positions``, ``slots`` flat
        over the batch) with each request's tree padded to ``nodes`` tokens: logits (and the
        captured hidden states) of the flat tokens, as the eager forward gives them."""
        batch, total = rows.shape[0], ids.shape[0]
        if mask.shape[1] > nodes or total > batch * nodes:
            raise ValueError(f"a verify of trees up to {mask.shape[1]} nodes does not fit {nodes} nodes a request")
        runner = self._verify_runner(capture_hidden)
        square = mask
        if mask.shape[1:] != (nodes, nodes):
            square = torch.zeros((batch, nodes, nodes), dtype=torch.bool, device=mask.device)
            square[:, :mask.shape[1], :mask.shape[2]] = mask
        outputs = runner({"ids": _flat_padded(ids, batch, nodes), "positions": _flat_padded(positions, batch, nodes),
                          "slots": _flat_padded(slots, batch, nodes), "rows": rows, "q_lens": q_lens,
                          "kv_lens": kv_lens, "mask": square})
        logits = outputs[0].reshape(batch * nodes, -1)[:total]
        hidden = outputs[1].reshape(batch * nodes, -1)[:total] if len(outputs) > 1 else None
        return ModelOutput(logits=logits, hidden=hidden)

    def capture_buckets(self, verify_nodes: int | None = None, capture_hidden: CaptureHidden = None) -> None:
        """Run every decode bucket (or, given ``verify_nodes``, every verify bucket of trees that wide)
        once on padding rows alone (they write only slot 0): on CUDA each bucket is captured now,
        before any request, when no other thread uses the GPU and no request waits for a capture."""
        device = self.runner.device
        if verify_nodes is None:
            for bucket in self._decode.buckets:
                self._decode({"decode": torch.full((bucket, 3), -1, dtype=torch.int64)})
            return
        runner = self._verify_runner(capture_hidden)
        for bucket in runner.buckets:
            padding = {name: torch.full((bucket, verify_nodes) if name in ("ids", "positions", "slots") else (bucket,),
                                        value, dtype=torch.int64, device=device) for name, value in _PADS.items()}
            runner({**padding, "mask": torch.zeros((bucket, verify_nodes, verify_nodes), dtype=torch.bool,
                                                   device=device)})

    def _verify_runner(self, capture_hidden: CaptureHidden) -> GraphRunner:
        runner = self._verify.get(capture_hidden)
        if runner is None:
            runner = self._verify[capture_hidden] = GraphRunner(
                lambda b: self._step(b, ForwardMode.VERIFY, capture_hidden), {**_PADS, "mask": False},
                self.runner.device, capture=self.capture, buckets=VERIFY_BUCKETS)
        return runner

    def _decode_step(self, buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The decode bucket's forward: slots and lengths looked up on the device (inside the graph),
        padded rows sent to slot 0 with token 0 at position 0."""
        packed = buffers["decode"]
        real = packed[:, 1] >= 0
        ids, positions, rows = packed.clamp(min=0).unbind(1)
        slots = torch.where(real, self.table[rows, positions].to(torch.int64), 0)
        ones = torch.ones_like(positions)
        return self._step({"ids": ids[:, None], "positions": positions[:, None], "slots": slots[:, None],
                           "rows": rows, "q_lens": ones, "kv_lens": positions + 1}, ForwardMode.DECODE, None)

    def _step(self, buffers: dict[str, torch.Tensor], mode: ForwardMode, capture_hidden: CaptureHidden
              ) -> tuple[torch.Tensor, ...]:
        ids = buffers["ids"]
        bucket, nodes = ids.shape
        flat = {name: buffers[name].reshape(-1) for name in ("ids", "positions", "slots")}
        mask = buffers.get("mask")
        if mask is not None:
            # A padded request's one token sees itself (a real tree's root always does): a row that
            # sees nothing would put NaN into the padding slot's K/V on kernels without a guard.
            mask[:, 0, 0] = True
        if self.capture:
            # A capture cannot read sizes back from the device: the widest a request may be, and
            # every padded token computed.
            static_sizes = (nodes, self.table.shape[1])
        else:
            # Eagerly (the CPU's kernels want exactly the requests' tokens): the batch's own sizes.
            static_sizes, q_lens = None, buffers["q_lens"]
            flat = {name: t[:int(q_lens.sum())] for name, t in flat.items()}
            if mask is not None:
                widest = int(q_lens.max())
                mask = mask[:, :widest, :widest]
        out = self.runner.forward(ForwardBatch.build(
            mode,
            input_ids=flat["ids"],
            positions=flat["positions"],
            out_cache_loc=flat["slots"],
            req_to_token=self.table,
            req_pool_indices=buffers["rows"],
            kv_lens=buffers["kv_lens"],
            q_lens=buffers["q_lens"],
            custom_mask=mask,
            logits="all",
            capture_hidden=capture_hidden,
            static_sizes=static_sizes,
        ))
        outputs = [out.logits] + ([] if out.hidden is None else [out.hidden])
        return tuple(_padded_rows(t, bucket * nodes).view(bucket, nodes, -1) for t in outputs)


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def _flat_padded(values: torch.Tensor, batch: int, nodes: int) -> torch.Tensor:
    """Flat per-token ``values`` followed by zeros up to ``batch * nodes``, as [batch, nodes]."""
    out = values.new_zeros(batch * nodes)
    out[:values.shape[0]] = values
    return out.view(batch, nodes)

