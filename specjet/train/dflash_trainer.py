"""The DFlash training loop and its held-out acceptance measure.

Each step takes a batch of sequences (target features at every position, as for EAGLE) and draws
``blocks_per_seq`` random anchors per sequence among its reply positions. An anchor a is a block
root: the draft sees the target's context before a and the block [x_a, mask, ...], and is scored on
x_{a+1} .. x_{a+S-1}, exactly the drafting situation after the target has committed x_a. All of a
sequence's blocks run in one forward (``DFlashDraftModel.forward_train``: each block attends to its
own context and itself only), so one forward trains many blocks.

Labels are computed once per sequence before the first step (``target_labels``). Loss:
cross-entropy of block position k (1-based) against its label, weighted by
exp(-(k - 1) / decay) and normalised (DFlash's weighting): an early position counts more, because
a chain is accepted only up to its first miss, so a later position's token is worth something only
if everything before it was right. The label (``labels="target"``) is the target's own greedy
choice after the sequence's prefix, the argmax of its LM head over the final normed hidden state
the features end with: on the target's replies that is the sequence's token (a reply the features'
own target wrote greedily is taken as it is, ``Sequence.target_reply``), on reference text (written
by people, not the target) and sampled replies it is what greedy verification will accept there.
``labels="sequence"`` trains on the sequence's tokens as they are.

Known prefixes (``known_prefix_rate``): some blocks hold the text's next tokens after the root in
place of mask tokens, as a drafter fills in a grammar's forced text; only their mask positions are
scored.

Seeded and resumable as the EAGLE trainer (whose batching, schedule and checkpoints this reuses):
batches and anchors are fixed by the seed, a checkpoint holds the anchor generator's state.
"""
from __future__ import annotations

import hashlib
import pathlib
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from specjet.kernels.argmax import argmax_rows
from specjet.kernels import fp32_gemm
from specjet.kernels.bf16_gemm import Bf16x3Linear
from specjet.kernels.linear import PackedLinear, pack_onednn, pack_weight
from specjet.models.dflash import DFlashDraftModel
from specjet.train.features import DamagedFileError, Sequence
from specjet.train.head_loss import head_cross_entropy
from specjet.train.trainer import (Stopped, _save_checkpoint, crop_prompt, length_groups, lr_at, resume, run_summary,
                                   stop_requests, take_step)


@dataclass
class DFlashTrainConfig:
    steps: int = 600
    batch_tokens: int = 2048  # padded tokens per step
    max_prompt: int = 256  # prompt tokens kept before each reply (trainer.crop_prompt)
    blocks_per_seq: int = 16  # random anchors per sequence per step
    decay: float = 7.0  # loss weight of block position k: exp(-(k - 1) / decay)
    window: int | None = None  # context positions a block sees (None: all before its root)
    labels: str = "target"  # "target": the target's greedy token after the prefix; "sequence": the text's
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    # Matmuls in bf16 (torch.autocast; weights, optimizer and loss stay fp32): about twice the
    # steps per hour where the CPU has native bf16, much slower where bf16 is emulated.
    autocast_bf16: bool = False
    # Blocks whose first positions after the root hold their known tokens (``sample_known``): this
    # fraction of them, scored on their mask positions only; 0 trains DFlash's blocks as published.
    known_prefix_rate: float = 0.0
    # Weight of the target's distribution in each block position's label (knowledge distillation: the rest is
    # the one-hot greedy label): the target's LM head over the final normed hidden state the features end with,
    # over the draft's columns. 0 trains on the greedy labels alone.
    distill: float = 0.0


def sample_anchors(seqs: list[Sequence], count: int, generator: torch.Generator) -> torch.Tensor:
    """[B, count] anchors: distinct random reply positions a with a token after them (prompt_len <=
    a <= len - 2); -1 pads a sequence with fewer."""
    out = torch.full((len(seqs), count), -1, dtype=torch.int64)
    for i, s in enumerate(seqs):
        first, last = max(s.prompt_len, 0), len(s.ids) - 2
        if last < first:
            continue
        choices = torch.randperm(last - first + 1, generator=generator)[:count] + first
        out[i, :len(choices)] = choices.sort().values
    return out


def sample_known(anchors: torch.Tensor, lengths: torch.Tensor, rate: float, block_size: int,
                 generator: torch.Generator) -> torch.Tensor | None:
    """[B, A] how many tokens after each block's root are known (in the block in place of mask
    tokens): 0, or for a fraction ``rate`` of the blocks a count drawn uniformly from 1 .. S - 2,
    cut so that a scored position inside the sequence remains. None when ``rate`` is 0 or the block
    has no room for a known token and a mask (nothing is drawn, so a run without known prefixes sees
    the same anchors as before)."""
    if rate <= 0 or block_size < 3:
        return None
    chosen = torch.rand(anchors.shape, generator=generator) < rate
    counts = torch.randint(1, block_size - 1, anchors.shape, generator=generator)
    room = (lengths[:, None] - 2 - anchors).clamp(min=0)  # position a + k + 1 must lie in the sequence
    return torch.where(chosen & (anchors >= 0), torch.minimum(counts, room), 0)


def known_block_ids(ids: torch.Tensor, anchors: torch.Tensor, known: torch.Tensor, block_size: int, mask_id: int
                    ) -> torch.Tensor:
    """[B, A, S] blocks: the root ids[a], the next ``known`` tokens of the text, then mask ids."""
    pos = anchors.clamp(min=0)[:, :, None] + torch.arange(block_size)
    tokens = ids.gather(1, pos.clamp(max=ids.shape[1] - 1).reshape(ids.shape[0], -1)).view_as(pos)
    keep = torch.arange(block_size)[None, None, :] <= known[:, :, None]
    return torch.where(keep, tokens, torch.full_like(tokens, mask_id))


def collate(seqs: list[Sequence], feature_dtype: torch.dtype = torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L], features [B, L, F] in ``feature_dtype`` (zero past each end) and lengths [B].
    Under bf16 autocast the context projection reads its input in bf16 whatever it is given, so the
    training loop collates bf16 features: the same values (fp16 -> bf16 rounds as fp16 -> fp32 -> bf16
    does) at half the bytes to write and read each step. A sequence's fp16 features go through float32 on
    the way: torch's direct fp16 -> bf16 copy is a slower, unvectorised loop."""
    max_len = max(len(s.ids) for s in seqs)
    ids = torch.zeros(len(seqs), max_len, dtype=torch.int64)
    feats = torch.zeros(len(seqs), max_len, seqs[0].features.shape[1], dtype=feature_dtype)
    for i, s in enumerate(seqs):
        ids[i, :len(s.ids)] = s.ids
        f = s.features
        feats[i, :len(s.ids)] = f.float() if f.dtype != feature_dtype and feature_dtype == torch.bfloat16 else f
    return ids, feats, torch.tensor([len(s.ids) for s in seqs])


def block_labels(ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of block positions 1..S-1: (labels [B, A, S - 1], valid [B, A, S - 1]); a position past
    the sequence's end or of a padded anchor is not valid."""
    pos = anchors[:, :, None] + torch.arange(1, block_size)  # [B, A, S - 1]
    valid = (anchors[:, :, None] >= 0) & (pos < lengths[:, None, None])
    labels = ids.gather(1, pos.clamp(0, ids.shape[1] - 1).reshape(ids.shape[0], -1)).view_as(pos)
    return labels, valid


@torch.no_grad()
def target_greedy_ids(model: DFlashDraftModel, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """[B, L] ids whose position t holds the target's greedy token at t (after the prefix ids[:t]):
    the argmax of its LM head over the final normed hidden state at t - 1 (the last h columns of
    the features). Position 0 keeps ids[:, 0] (nothing predicts it)."""
    h = model.config.hidden_size
    out = ids.clone()
    greedy = target_greedy(model)
    out[:, 1:] = greedy(feats[:, :-1, -h:].reshape(-1, h)).view(ids.shape[0], -1)
    return out


def target_greedy(model: DFlashDraftModel):
    """hidden [T, h] -> the target's greedy ids [T]: the argmax of its own full-vocabulary head, in fp32
    (under bf16 training too). Where the CPU has AMX tiles the head's products are three bf16 tile products
    each (kernels/bf16_gemm.py's Bf16x3Linear: a logit within ~2^-16 of float32's, a tie's width, in ~0.9x the
    time); elsewhere the head is packed once for inference and run in one oneDNN call: the training head has
    no packed form, and torch's matmul is MKL's AVX2 path on AMD CPUs, half the speed (kernels/linear.py)."""
    head = model.target_head()
    if label_kernel(model) == "bf16x3":
        packed = Bf16x3Linear.build(head.weight_t.detach(), None if head.bias is None else head.bias.detach())
    else:
        # a float32 head: oneDNN's one call of a long pack (linear.pack_onednn), never packed for the float32 GEMM first
        pack = pack_onednn if fp32_gemm.applies(head.weight_t) else pack_weight
        packed = pack(head.weight_t, head.bias)
        if isinstance(packed, PackedLinear):
            packed.invariant = False

    @torch.no_grad()
    def greedy(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return argmax_rows(packed(hidden.to(head.weight_t.dtype)))
    return greedy


def label_kernel(model: DFlashDraftModel) -> str:
    """The head product ``target_greedy`` takes here: "bf16x3" (AMX tiles, a float32 head) or "float32"."""
    return "bf16x3" if Bf16x3Linear.applies(model.target_head().weight_t) else "float32"


def to_columns(model: DFlashDraftModel, labels: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids -> columns of the draft's logits; with a hot head a label outside the hot
    vocabulary cannot be drafted and is not scored."""
    hot = model.hot_token_ids
    if hot is None:
        return labels, valid
    lookup = torch.full((model.config.vocab_size,), -1, dtype=torch.int64, device=labels.device)
    lookup[hot.to(labels.device)] = torch.arange(hot.shape[0], device=labels.device)
    cols = lookup[labels]
    return cols.clamp(min=0), valid & (cols >= 0)


def target_labels(model: DFlashDraftModel, seqs: list[Sequence], chunk: int = 512) -> list[torch.Tensor]:
    """Per sequence, ``target_greedy_ids`` at its reply positions (position t >= prompt_len + 1,
    the only ones a block is scored on) and the sequence's own ids elsewhere. Computed once before
    training: the target's full-vocabulary head over every position of every batch would cost far
    more than the draft's own step. A ``target_reply`` (the target wrote it greedily) is its own labels:
    every reply token is the target's greedy choice there, as the engine that verifies computes it, and
    the head's pass over fp16 features would only move a near-tie."""
    out = []
    h = model.config.hidden_size
    greedy = target_greedy(model)
    for s in seqs:
        labels = s.ids.clone()
        if s.target_reply:
            out.append(labels)
            continue
        first = s.prompt_len + 1
        for lo in range(first, len(s.ids), chunk):
            hi = min(lo + chunk, len(s.ids))
            labels[lo:hi] = greedy(s.features[lo - 1:hi - 1, -h:])
        out.append(labels)
    return out


def cached_target_labels(model: DFlashDraftModel, seqs: list[Sequence], path: pathlib.Path | None
                         ) -> list[torch.Tensor]:
    """``target_labels``, kept in ``path`` (beside the features they come from) for the next run over
    the same sequences: the pass is minutes of a run (the full-vocabulary head over every reply
    position in fp32), the same every time. A file for other sequences or another head is replaced."""
    if path is None:
        return target_labels(model, seqs)
    from safetensors import safe_open
    from safetensors.torch import save_file

    head = model.target_head()
    digest = hashlib.sha256(head.weight_t.detach().float().contiguous().numpy().tobytes())
    kernel = label_kernel(model)
    if kernel != "float32":  # labels of another product are another file (float32's keys unchanged)
        digest.update(kernel.encode())
    for s in seqs:
        digest.update(s.ids.numpy().tobytes())
        digest.update(f"{len(s.ids)},{s.prompt_len}{',own' if s.target_reply else ''};".encode())
    key = digest.hexdigest()
    lengths = [len(s.ids) for s in seqs]
    if path.is_file():
        try:
            with safe_open(str(path), "pt") as f:
                if f.metadata().get("key") == key:
                    return list(f.get_tensor("labels").split(lengths))
        except Exception as error:  # safetensors' error names no file
            raise DamagedFileError(path, "label cache", error,
                                   "remove it and run the same command again: the label pass runs anew") from error
    labels = target_labels(model, seqs)
    tmp = path.with_suffix(".tmp")
    save_file({"labels": torch.cat(labels)}, str(tmp), metadata={"key": key})
    tmp.replace(path)
    return labels


def collate_labels(labels: list[torch.Tensor], max_len: int) -> torch.Tensor:
    out = torch.zeros(len(labels), max_len, dtype=torch.int64)
    for i, lab in enumerate(labels):
        out[i, :len(lab)] = lab
    return out


def batch_loss(model: DFlashDraftModel, ids, feats, lengths, anchors, cfg: DFlashTrainConfig,
               source: torch.Tensor, known: torch.Tensor | None = None) -> dict:
    """Weighted block cross-entropy (the total, differentiable), the top-1 agreement of block
    position 1 and the mean accepted chain length of the batch's blocks (greedy, +1 bonus; both
    over blocks without known tokens). ``source`` [B, L]: each position's label (``target_labels``,
    or the ids themselves); ``known`` [B, A]: tokens known after each root (``sample_known``), not
    scored."""
    size = model.shape.block_size
    block_ids = None if known is None else known_block_ids(ids, anchors, known, size, model.shape.mask_token_id)
    labels, valid = block_labels(source, lengths, anchors, size)
    labels, valid = to_columns(model, labels, valid)
    real = anchors >= 0
    if known is not None:
        valid = valid & (torch.arange(1, size)[None, None, :] > known[:, :, None])
        real = real & (known == 0)
    # Only the scored positions go through the norm, the head and the loss; the padding rows after
    # them (forward_train) count with weight zero. The head's logits are made and consumed a chunk of rows
    # at a time (train/head_loss.py), the loss in fp32 under autocast too.
    hidden = model.forward_train(ids, feats, anchors, cfg.window, block_ids, scored=valid, head=False)  # [n + pad, h]
    scored = int(valid.sum())
    weights = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
    weights[:scored] = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / cfg.decay).expand_as(valid)[valid]
    targets = labels.new_zeros(hidden.shape[0])
    targets[:scored] = labels[valid]
    teacher = None
    if cfg.distill > 0:  # the target's final normed hidden state before each scored position
        h = model.config.hidden_size
        pos = anchors[:, :, None] + torch.arange(size - 1)  # position k's label follows position a + k - 1
        rows = torch.arange(ids.shape[0])[:, None, None].expand_as(pos)[valid]
        teacher = hidden.new_zeros(hidden.shape[0], h)
        teacher[:scored] = feats[rows, pos[valid], -h:].to(hidden.dtype)
    loss, predicted = head_cross_entropy(hidden, model.head_weight_t(), targets, weights, teacher, cfg.distill)
    with torch.no_grad():
        hits = torch.zeros_like(valid)
        hits[valid] = predicted[:scored] == targets[:scored]
        top1 = hits[:, :, 0][real].float().mean()
        accept = 1 + hits.long().cumprod(-1).sum(-1)[real].float().mean()
    return {"loss": loss, "top1": top1, "accept_length": accept}


def train(model: DFlashDraftModel, seqs: list[Sequence], cfg: DFlashTrainConfig, checkpoint) -> dict:
    """Train ``model`` in place (bound to its target, whose LM head is unpacked). Returns a summary
    with the mean values of the last tenth of the steps (at most 50)."""
    torch.manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel over all parameters a step (the default runs ~10 ops a parameter on CPU).
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True)
    anchor_gen = torch.Generator().manual_seed(cfg.seed + 1)
    step, history = resume(checkpoint, cfg, model, optimizer, anchor_gen)

    if cfg.labels not in ("target", "sequence"):
        raise ValueError(f"labels must be 'target' or 'sequence', got {cfg.labels!r}")
    seqs = [crop_prompt(s, cfg.max_prompt) for s in seqs]
    if cfg.labels == "target":
        name = f"labels-prompt{cfg.max_prompt}.safetensors"
        cache = None if checkpoint is None else pathlib.Path(checkpoint).with_name(name)
        labels = cached_target_labels(model, seqs, cache)
    else:
        labels = [s.ids for s in seqs]
    groups = length_groups([len(s.ids) for s in seqs], cfg.batch_tokens)
    model.train()
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc="train dflash", unit="step")
    order, epoch = None, -1
    with stop_requests() as stop:
        while step < cfg.steps:
            if step // len(groups) != epoch:
                # Each epoch's order is fixed by (seed, epoch), so a resumed run sees the same batches.
                epoch = step // len(groups)
                order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(cfg.seed * 100003 + epoch))
            members = groups[int(order[step % len(groups)])]
            batch = [seqs[i] for i in members]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            anchors = sample_anchors(batch, cfg.blocks_per_seq, anchor_gen)
            ids, feats, lengths = collate(batch, torch.bfloat16 if cfg.autocast_bf16 else torch.float32)
            known = sample_known(anchors, lengths, cfg.known_prefix_rate, model.shape.block_size, anchor_gen)
            source = collate_labels([labels[i] for i in members], ids.shape[1])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
                losses = batch_loss(model, ids, feats, lengths, anchors, cfg, source, known)
            mean = take_step(optimizer, params, losses, cfg.grad_clip, history)
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{mean['loss']:.3f}", top1=f"{mean['top1']:.3f}",
                            accept=f"{mean['accept_length']:.2f}")
            if checkpoint is not None and (step % cfg.checkpoint_every == 0 or step == cfg.steps or stop):
                _save_checkpoint(checkpoint, model, optimizer, anchor_gen, step, history, cfg)
            if stop:  # SIGINT or SIGTERM during this step: it is done and saved (trainer.stop_requests)
                break
    bar.close()
    if stop:  # (also a signal after the last step's check: its checkpoint, the run's last, is written)
        raise Stopped(stop[0], step, checkpoint)
    model.eval()
    return run_summary(cfg, history, start)


@torch.no_grad()
def draft_every_position(model: DFlashDraftModel, seq: Sequence, window: int | None = None, chunk: int = 32,
                         known: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy block drafts at every reply anchor of ``seq`` (the whole prompt as context): (drafts
    [N, S - 1 - known], accepted [N]: how many leading drafts equal the sequence's next tokens).
    ``known``: the block holds that many of the text's tokens after the root; the drafts are those
    of the positions after them (anchors leaving none in the sequence are skipped)."""
    size = model.shape.block_size
    ids, feats = seq.ids[None], seq.features.float()[None]
    lengths = torch.tensor([len(seq.ids)])
    first, last = max(seq.prompt_len, 0), len(seq.ids) - 2 - known
    all_drafts, all_accepted = [], []
    for lo in range(first, last + 1, chunk):
        anchors = torch.arange(lo, min(lo + chunk, last + 1))[None]
        block_ids = None if not known else known_block_ids(ids, anchors, torch.full_like(anchors, known), size,
                                                           model.shape.mask_token_id)
        logits = model.forward_train(ids, feats, anchors, window, block_ids)
        drafts = model.hot_to_full(logits.argmax(-1))[:, :, known:]  # [1, A, S - 1 - known]
        labels, valid = block_labels(ids, lengths, anchors, size)
        hits = ((drafts == labels[:, :, known:]) & valid[:, :, known:])
        all_drafts.append(drafts[0])
        all_accepted.append(hits.long().cumprod(-1).sum(-1)[0])
    if not all_drafts:
        return torch.zeros(0, size - 1 - known, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(all_drafts), torch.cat(all_accepted)


def evaluate(model: DFlashDraftModel, seqs: list[Sequence], window: int | None = None, known: int = 0) -> dict:
    """Held-out acceptance of greedy chain drafting, per source and overall: the mean accept length
    (accepted drafts + the bonus) for chains cut at k tokens, k = 1, 2, 4, 8, .. S - 1, and the top-1
    agreement of block position 1. ``known``: every block holds the text's next ``known`` tokens
    after its root (a grammar's forced text), and the chain is drafted after them."""
    size = model.shape.block_size - known
    if size < 2:
        raise ValueError(f"known={known} leaves no drafted position in a block of {model.shape.block_size}")
    cuts = sorted({k for k in (1, 2, 4, 8, 16, 32) if k < size} | {size - 1})
    per_source: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for seq in seqs:
        per_source.setdefault(seq.source, []).append(draft_every_position(model, seq, window, known=known))
    per_source["all"] = [r for rs in per_source.values() for r in rs]
    report = {}
    for source, results in per_source.items():
        accepted = torch.cat([a for _, a in results])
        if accepted.numel() == 0:
            continue
        report[source] = {
            "positions": int(accepted.numel()),
            "accept_length": {k: round(float(1 + accepted.clamp(max=k).float().mean()), 3) for k in cuts},
            "top1": round(float((accepted > 0).float().mean()), 4),
        }
    return report


def format_report(report: dict) -> str:
    cuts = list(next(iter(report.values()))["accept_length"])
    lines = ["expected accept length of DFlash chains (greedy; block cut at k drafts; +1 bonus token)",
             f"{'held-out set':<14}{'positions':>10}{'top-1':>8}  " + "".join(f"{'k=' + str(k):>8}" for k in cuts)]
    for source, r in report.items():
        lines.append(f"{source:<14}{r['positions']:>10}{r['top1']:>8.3f}  "
                     + "".join(f"{r['accept_length'][k]:>8.3f}" for k in cuts))
    return "\n".join(lines)

