"""How well a head drafts for its target, measured on the target's own greedy replies.

For every reply position t (the target has produced x_0..x_{t+1}), chain drafting (topk = 1)
runs k steps through the head's inference path over a paged KV cache, exactly as a worker would:
step 1 reads (x_{t+1}, f_t) with the draft KV of the real prefix already in place, step j reads
(d_{j-1}, h_{j-1}), the head's own hidden state, at position t + j - 1. The drafts are accepted
while they equal the target's greedy tokens x_{t+2}, x_{t+3}, ...; accept length = accepted + 1
(the bonus token). All positions of a sequence draft in parallel, as one batch of requests.
"""
from __future__ import annotations

import torch

from specjet.models.eagle import EagleDraftModel
from specjet.models.forward_batch import ForwardBatch, ForwardMode
from specjet.models.kv_cache import KVCache
from specjet.train.features import Sequence


@torch.inference_mode()
def chain_draft(model: EagleDraftModel, seq: Sequence, max_steps: int) -> dict:
    """Per reply position t: the drafts [num, max_steps], the number of leading drafts the target
    accepts (0..max_steps), and whether x_{t+2} is the head's top-1 / in its top-4 at step 1."""
    cfg = model.config
    ids, feats = seq.ids, seq.features.to(model.fc.weight_t.dtype)
    n = len(ids)
    first = max(seq.prompt_len - 1, 0)  # the first draft after prefill reads (x_P, f_{P-1})
    chains = torch.arange(first, n - 2)  # positions whose next-next token exists
    if len(chains) == 0:
        return {"drafts": torch.zeros(0, max_steps, dtype=torch.int64), "accepted": torch.zeros(0, dtype=torch.int64),
                "top1": torch.zeros(0), "top4": torch.zeros(0)}
    num = len(chains)
    # Slot 1 + p holds the draft KV of real position p; chain c's step j >= 2 writes a slot of its own.
    kv = KVCache(1, 1 + n + num * max_steps, cfg.num_kv_heads, cfg.head_dim, feats.dtype, feats.device)
    draft_slot = lambda j: 1 + n + torch.arange(num) * max_steps + j  # noqa: E731  [num] slots of step j

    # Step 1 for every position at once: an extend over the real sequence.
    prefix = torch.arange(1, n).unsqueeze(0)
    batch = ForwardBatch.build(ForwardMode.EXTEND, ids[1:], torch.arange(n - 1), prefix[0], prefix,
                               torch.tensor([0]), torch.tensor([n - 1]), torch.tensor([n - 1]), logits="all")
    hidden, logits = model(batch, feats[:-1], kv, from_target=True)
    hidden, logits = hidden[chains], logits[chains]
    truth = ids[chains + 2]
    top4 = model.hot_to_full(logits.topk(min(4, logits.shape[-1]), -1).indices)
    drafts = [top4[:, 0]]

    # Chain c drafts from position t = chains[c]: its row maps positions 0..t to the real slots and
    # t + 1 .. t + max_steps - 1 to its own draft slots.
    width = n + max_steps
    table = torch.arange(1, width + 1).repeat(num, 1)
    for j in range(1, max_steps):
        table[torch.arange(num), chains + j] = draft_slot(j)
    for j in range(1, max_steps):
        positions = chains + j
        batch = ForwardBatch.build(ForwardMode.DECODE, model.hot_to_full(logits.argmax(-1)), positions, draft_slot(j),
                                   table, torch.arange(num), positions + 1, torch.ones(num, dtype=torch.int64),
                                   logits="all")
        hidden, logits = model(batch, hidden, kv)
        drafts.append(model.hot_to_full(logits.argmax(-1)))

    drafts = torch.stack(drafts, 1)  # [num, max_steps]
    targets = torch.full_like(drafts, -1)  # past the end of the reply nothing is accepted
    for j in range(max_steps):
        ok = chains + 2 + j < n
        targets[ok, j] = ids[chains[ok] + 2 + j]
    accepted = (drafts == targets).long().cumprod(1).sum(1)
    return {"drafts": drafts, "accepted": accepted, "top1": (top4[:, 0] == truth).float(), "top4": (top4 == truth[:, None]).any(1).float()}


def evaluate(model: EagleDraftModel, seqs: list[Sequence], max_steps: int = 5) -> dict:
    """Accept lengths for k = 1..max_steps and step-1 top-1/top-4 accuracy, per source and overall."""
    per_source: dict[str, list[dict]] = {}
    for seq in seqs:
        per_source.setdefault(seq.source, []).append(chain_draft(model, seq, max_steps))
    per_source["all"] = [r for rs in per_source.values() for r in rs]
    report = {}
    for source, results in per_source.items():
        accepted = torch.cat([r["accepted"] for r in results])
        report[source] = {
            "positions": int(accepted.numel()),
            "accept_length": {k: round(float(1 + accepted.clamp(max=k).float().mean()), 3)
                              for k in range(1, max_steps + 1)},
            "top1": round(float(torch.cat([r["top1"] for r in results]).mean()), 4),
            "top4": round(float(torch.cat([r["top4"] for r in results]).mean()), 4),
        }
    return report


def format_report(report: dict) -> str:
    steps = list(next(iter(report.values()))["accept_length"])
    head = f"{'held-out set':<14}{'positions':>10}{'top-1':>8}{'top-4':>8}  " + "".join(f"{'k=' + str(k):>7}" for k in steps)
    lines = ["expected accept length of chain drafting (topk=1, k steps; +1 bonus token)", head]
    for source, r in report.items():
        lines.append(f"{source:<14}{r['positions']:>10}{r['top1']:>8.3f}{r['top4']:>8.3f}  "
                     + "".join(f"{r['accept_length'][k]:>7.3f}" for k in steps))
    return "\n".join(lines)
