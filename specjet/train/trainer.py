"""The EAGLE training loop: teacher forcing on target features (with noise on the inputs), and
"training-time test": the head also runs unrolled as drafting runs it, on its own fed-back hidden
states, and is scored at every draft depth.

At position t the head reads (x_{t+1}, f_t + noise) and is scored on (f^last: the final normed part
of an EAGLE-3 head's fused feature)
  - feature regression: smooth-L1(h_t, f_{t+1});
  - token distribution: cross-entropy of its logits against softmax(lm_head(f_{t+1})), the
    target's own next-token distribution (over the hot vocabulary when the head has one),
loss = v_weight * regression + p_weight * cross-entropy (the paper uses 1.0 and 0.1; 0.3 drafted
better on our held-out set). The noise (uniform, width ``noise``) stands in for the error of the
head's own predicted features, which it reads from the second draft step on.

With ``depths`` > 1 the head is also run as the d-th draft step of a chain at every position
(``EagleDraftModel.forward_train_unrolled``: fed its own hidden state of depth d - 1, attending to
the verified prefix and its chain), and depth d's losses, against the same targets, enter with weight
``depth_decay ** d`` (normalised). Teacher forcing alone never shows the head the feature errors it
makes itself; at depth d it learns to draft from them (EAGLE-3's observation).

Seeded and resumable: batches are fixed by the seed, and a checkpoint every ``checkpoint_every``
steps (and at the step a SIGINT or SIGTERM came in: ``stop_requests``) holds the weights, the optimizer,
the schedule position and the noise generator.
"""
from __future__ import annotations

import contextlib
import math
import pathlib
import signal
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specjet.models.eagle import EagleDraftModel
from specjet.train.features import DamagedFileError, Sequence


@dataclass
class TrainConfig:
    steps: int = 800
    batch_tokens: int = 2048  # padded tokens per step (sequences of similar length share a batch)
    max_prompt: int = 256  # prompt tokens kept before each reply (see crop_prompt)
    lr: float = 1e-3
    min_lr_ratio: float = 0.05  # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 40
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    noise: float = 0.2
    v_weight: float = 1.0
    p_weight: float = 0.3
    seed: int = 0
    checkpoint_every: int = 100
    depths: int = 1  # 1: teacher forcing only; d > 1: also train draft steps 1..d-1 unrolled
    depth_decay: float = 0.8


def crop_prompt(seq: Sequence, max_prompt: int) -> Sequence:
    """Drop all but the last ``max_prompt`` prompt tokens. Only replies are scored, so a long prompt
    (the ~750-token few-shot ones) would cost layer compute for context that a one-layer head
    barely looks at; its features still come from the full prompt. Evaluation keeps everything."""
    cut = max(0, seq.prompt_len - max_prompt)
    if cut == 0:
        return seq
    return replace(seq, ids=seq.ids[cut:], features=seq.features[cut:], prompt_len=seq.prompt_len - cut)


def length_groups(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Sequence indices grouped by similar length, each group padding to at most ``batch_tokens``
    tokens (a longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def collate(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and float32 features [B, L, h]; the mask [B, L - 1] of inputs scored.

    Input t is scored when feature t + 1 exists and predicts a reply token: t >= prompt_len - 1,
    where the first draft after prefill sits. Earlier positions still run (their KV is the
    context), but the head never drafts prompt text, so it is not trained to."""
    max_len = max(len(s.ids) for s in seqs)
    hidden = seqs[0].features.shape[1]
    ids = torch.zeros(len(seqs), max_len, dtype=torch.int64)
    feats = torch.zeros(len(seqs), max_len, hidden)
    for i, s in enumerate(seqs):
        ids[i, :len(s.ids)] = s.ids
        feats[i, :len(s.ids)] = s.features.float()
    lens = torch.tensor([len(s.ids) for s in seqs])
    first = torch.tensor([max(s.prompt_len - 1, 0) for s in seqs])
    t = torch.arange(max_len - 1)[None, :]
    return ids, feats, (t < (lens - 1)[:, None]) & (t >= first[:, None])


def batch_loss(model: EagleDraftModel, ids, feats, valid, cfg: TrainConfig, generator=None) -> dict:
    """Losses of one batch (tensors, the total differentiable) and the top-1 agreement (depth 0;
    ``top1_d<d>`` for deeper draft steps)."""
    inputs = feats[:, :-1]
    if cfg.noise > 0:
        inputs = inputs + (torch.rand(inputs.shape, generator=generator) - 0.5) * cfg.noise
    hiddens = model.forward_train_unrolled(ids[:, 1:], inputs, cfg.depths)
    next_feature = feats[:, 1:, -model.config.hidden_size:][valid]  # f^last: what the target's head reads
    with torch.no_grad():
        target_logits = model.logits(next_feature)
        target_probs, target_top = target_logits.softmax(-1), target_logits.argmax(-1)
    out, total, weights = {}, 0.0, 0.0
    for depth, hidden in enumerate(hiddens):
        # Depth d at t drafts from the chain rooted at t - d: the root must be a drafting position too.
        rooted = valid.clone()
        if depth:
            rooted[:, :depth] = False
            rooted[:, depth:] &= valid[:, :-depth]
        keep = rooted[valid]  # rows of this depth among the valid positions
        if not bool(keep.any()):
            continue
        h = hidden[rooted]
        regression = F.smooth_l1_loss(h, next_feature[keep])
        logits = model.logits(h)
        cross_entropy = -(target_probs[keep] * logits.log_softmax(-1)).sum(-1).mean()
        top1 = (logits.argmax(-1) == target_top[keep]).float().mean()
        weight = cfg.depth_decay ** depth
        total = total + weight * (cfg.v_weight * regression + cfg.p_weight * cross_entropy)
        weights += weight
        if depth == 0:
            out.update(regression=regression, cross_entropy=cross_entropy, top1=top1)
        else:
            out[f"top1_d{depth}"] = top1
    return {"loss": total / weights, **out}


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def result_config(cfg) -> dict:
    """A training config's fields that change the result (a run key, what a resumed run must share): all but how
    often it checkpoints. ``cfg``: the config or its ``asdict``."""
    fields = dict(cfg) if isinstance(cfg, dict) else asdict(cfg)
    fields.pop("checkpoint_every", None)
    return fields


def resume(checkpoint, cfg, model, optimizer, generator: torch.Generator) -> tuple[int, list]:
    """(step, history) to go on from: a checkpoint's, restoring the model, the optimizer and the
    generator (refused when written under another config), or (0, []) without one."""
    if checkpoint is None or not checkpoint.is_file():
        return 0, []
    try:
        state = torch.load(checkpoint, weights_only=False)
        saved_config = result_config(state["config"])
    except Exception as error:  # a truncated or overwritten file: torch's error names no file
        raise DamagedFileError(checkpoint, "checkpoint", error,
                               "delete it to train this run from step 0 (the data and features stay cached)") from error
    if saved_config != result_config(cfg):
        raise ValueError(f"checkpoint {checkpoint} was written with another training config; "
                         "delete it (or the work dir) to start over")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["noise_generator"])
        step, history = state["step"], state["history"]
    except Exception as error:  # the right config but missing or misshapen parts
        raise DamagedFileError(checkpoint, "checkpoint", error,
                               "delete it to train this run from step 0 (the data and features stay cached)") from error
    print(f"resuming from step {step} ({checkpoint})")
    return step, history


class Stopped(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM (``signal_name``). The training loop raises it at the end of the step the
    signal came in, after writing its checkpoint there (``step``, ``checkpoint``); elsewhere (the data, feature or
    evaluation stage) it is raised where the signal came (``step`` None: what the stages finished stays cached,
    training goes on from its last checkpoint). A KeyboardInterrupt, so what cleans up after Ctrl-C (the generation
    engine's shutdown) runs after SIGTERM too."""

    def __init__(self, signal_name: str, step: int | None = None, checkpoint: pathlib.Path | None = None):
        super().__init__(signal_name)
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_requests():
    """While a training loop runs: SIGINT and SIGTERM are noted in the list yielded, not raised mid-step, so the loop
    ends its step, writes a checkpoint there and raises ``Stopped`` (a stop mid-step lost every step since the last
    checkpoint, up to ``checkpoint_every``; SIGTERM killed the process with no word). A second signal stops at once.
    Signal handlers belong to the main thread: elsewhere nothing is caught."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def note(signum, frame):
        if received:
            raise Stopped(signal.Signals(signum).name)
        received.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, note) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def train(model: EagleDraftModel, seqs: list[Sequence], cfg: TrainConfig, checkpoint: pathlib.Path | None) -> dict:
    """Train ``model`` in place (bound to its target, unpacked). Returns a summary with the mean
    losses of the last tenth of the steps (at most 50) and the wall time."""
    torch.manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1)
    step, history = resume(checkpoint, cfg, model, optimizer, noise_gen)

    seqs = [crop_prompt(s, cfg.max_prompt) for s in seqs]
    lengths = [len(s.ids) for s in seqs]
    model.train()
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc="train eagle", unit="step")
    groups = length_groups(lengths, cfg.batch_tokens)
    order, epoch = None, -1
    with stop_requests() as stop:
        while step < cfg.steps:
            if step // len(groups) != epoch:
                # Each epoch's order is fixed by (seed, epoch), so a resumed run sees the same batches.
                epoch = step // len(groups)
                order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(cfg.seed * 100003 + epoch))
            batch = [seqs[i] for i in groups[int(order[step % len(groups)])]]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            losses = batch_loss(model, *collate(batch), cfg, noise_gen)
            mean = take_step(optimizer, params, losses, cfg.grad_clip, history)
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{mean['loss']:.3f}", reg=f"{mean['regression']:.3f}",
                            ce=f"{mean['cross_entropy']:.2f}", top1=f"{mean['top1']:.3f}",
                            **({"top1_d1": f"{mean['top1_d1']:.3f}"} if "top1_d1" in mean else {}))
            if checkpoint is not None and (step % cfg.checkpoint_every == 0 or step == cfg.steps or stop):
                _save_checkpoint(checkpoint, model, optimizer, noise_gen, step, history, cfg)
            if stop:  # SIGINT or SIGTERM during this step: it is done and saved (trainer.stop_requests)
                break
    bar.close()
    if stop:  # (also a signal after the last step's check: its checkpoint, the run's last, is written)
        raise Stopped(stop[0], step, checkpoint)
    model.eval()
    return run_summary(cfg, history, start)


def run_summary(cfg, history: list[dict], start: float) -> dict:
    """What a training run reports: its last steps' mean (a tenth of the run, 1 to 50 steps), its first
    step, its time and its configuration (a dataclass)."""
    recent = history[-max(1, min(50, cfg.steps // 10)):]
    return {
        "steps": cfg.steps,
        "final": {k: round(v, 4) for k, v in _mean(recent).items()},
        "first": history[0] if history else {},
        "seconds_this_run": round(time.perf_counter() - start, 1),
        "config": asdict(cfg),
    }


def take_step(optimizer, params, losses: dict, grad_clip: float, history: list[dict]) -> dict:
    """One optimizer step on ``losses["loss"]`` (gradients clipped to ``grad_clip``), the step's losses logged in
    ``history``; returns the mean of the last 50 steps' (the progress bar's figures)."""
    optimizer.zero_grad(set_to_none=True)
    losses["loss"].backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    history.append({k: round(float(v.detach()), 5) for k, v in losses.items()})
    return _mean(history[-50:])


def _mean(history: list[dict]) -> dict:
    """Mean of each logged value over the steps that logged it."""
    keys = {k for h in history for k in h}
    return {k: sum(h[k] for h in history if k in h) / sum(k in h for h in history) for k in sorted(keys)}


def _save_checkpoint(path: pathlib.Path, model, optimizer, noise_gen, step, history, cfg) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "noise_generator": noise_gen.get_state(), "step": step, "history": history,
                "config": asdict(cfg)}, tmp)
    tmp.replace(path)
