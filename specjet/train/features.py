"""Target features for draft training: the target's final normed hidden state at every position
(and, for an EAGLE-3 head, the residual stream after its ``feature_layers`` before it).

The feature is what specjet's runner gives at inference (``ModelOutput.hidden`` of a forward with
the head's ``feature_capture``), so the head trains on what it will be fed. The trainers' runners keep
the engine's C++ attention and layer stack: on ~2,000-token packs they ran faster than SDPA with unchunked
projections (bench/RESULTS.md, session 46); a float32 target's projections then run as one call a pack
(``LlamaForCausalLM.unchunk_projections``, train/eagle.py's ``feature_target``: session 65), and where the CPU
has AMX tiles as three bf16 tile products each (``bf16x3_projections``, ``--feature-gemm auto``: float32 to
~2^-16 a product, below the fp16 the features are kept in). Features are
stored in fp16 shards of ``shard_size`` samples beside the token ids; a shard that exists is not
computed again, so extraction resumes after an interruption and training reruns for free.
"""
from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from specjet.models.forward_batch import CaptureHidden, ForwardBatch, ForwardMode
from specjet.models.runner import ModelRunner
from specjet.train.data import Sample


class DamagedFileError(RuntimeError):
    """A cached file of a training run (a feature shard, a checkpoint, the label cache) that cannot be read. The
    reader's own error (safetensors', torch's unpickler) names no file; this one names it and says what to do. The
    file is left where it is: removing it is the user's call."""

    def __init__(self, path, what: str, error: BaseException, remedy: str):
        self.path = pathlib.Path(path)
        super().__init__(f"{what} {self.path} is damaged and cannot be read ({type(error).__name__}: {error}); "
                         f"{remedy}")


@dataclass
class Sequence:
    ids: torch.Tensor  # [L] int64
    features: torch.Tensor  # [L, feature width] float16: feature t predicts ids[t + 1]
    prompt_len: int
    source: str
    # Every reply token is the feature target's greedy choice after the tokens before it (the target wrote the reply
    # greedily): the sequence is its own target labels (dflash_trainer.target_labels). Not kept in the shards.
    target_reply: bool = False


@torch.inference_mode()
def target_features(runner: ModelRunner, samples: list[Sample], capture: CaptureHidden = "last",
                    dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    """Features of every sample, in ``dtype`` (fp16, as the trainers keep them). The prefix all samples share
    (a system prompt, few-shot examples) runs once; each sample's rest is a request that attends to the shared
    prefix's KV."""
    shared = _common_prefix_len([s.ids for s in samples])
    prefix_hidden = None
    if shared:
        prefix_hidden = _extend(runner, [samples[0].ids[:shared]], 0, capture, dtype)[0]
    rest = _extend(runner, [s.ids[shared:] for s in samples], shared, capture, dtype)
    return [h if prefix_hidden is None else torch.cat([prefix_hidden, h]) for h in rest]


def _extend(runner: ModelRunner, id_lists: list[list[int]], shared: int, capture: CaptureHidden,
            dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    """One extend forward: request i brings ``id_lists[i]`` after ``shared`` positions already in
    slots 1..shared (written by the previous call); its own tokens get fresh slots after those."""
    lens = torch.tensor([len(ids) for ids in id_lists])
    total = int(lens.sum())
    if 1 + shared + total > runner.kv_cache.num_slots:
        raise ValueError(f"{shared + total} tokens do not fit the runner's KV cache ({runner.kv_cache.num_slots - 1})")
    slots = torch.arange(1 + shared, 1 + shared + total)
    starts = (torch.cumsum(lens, 0) - lens).tolist()
    table = torch.zeros(len(id_lists), shared + int(lens.max()), dtype=torch.int64)
    table[:, :shared] = torch.arange(1, 1 + shared)
    for i, (start, n) in enumerate(zip(starts, lens.tolist())):
        table[i, shared:shared + n] = slots[start:start + n]
    batch = ForwardBatch.build(
        ForwardMode.EXTEND,
        input_ids=torch.tensor([t for ids in id_lists for t in ids]),
        positions=torch.cat([torch.arange(shared, shared + n) for n in lens.tolist()]),
        out_cache_loc=slots,
        req_to_token=table,
        req_pool_indices=torch.arange(len(id_lists)),
        kv_lens=lens + shared,
        q_lens=lens,
        logits="none",
        capture_hidden=capture,
    )
    hidden = runner.forward(batch).hidden.to(dtype)
    return list(hidden.split(lens.tolist()))


def _common_prefix_len(id_lists: list[list[int]]) -> int:
    """Tokens all lists share, leaving each at least one of its own (0 for a single list)."""
    if len(id_lists) < 2:
        return 0
    n = min(len(ids) for ids in id_lists) - 1
    first = id_lists[0]
    for ids in id_lists[1:]:
        k = 0
        while k < n and ids[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def _packs(samples: list[Sample], max_tokens: int) -> list[list[int]]:
    """Indices of samples grouped into forwards of at most ``max_tokens`` tokens, in order; a shared
    prefix counts once."""
    packs, current = [], []
    for i, s in enumerate(samples):
        candidate = current + [i]
        ids = [samples[j].ids for j in candidate]
        cost = sum(len(x) for x in ids) - (len(ids) - 1) * _common_prefix_len(ids)
        if current and cost > max_tokens:
            packs.append(current)
            candidate = [i]
        current = candidate
    if current:
        packs.append(current)
    return packs


def extract_features(runner: ModelRunner, samples: list[Sample], out_dir: pathlib.Path, desc: str,
                     shard_size: int = 256, max_tokens: int = 2048, capture: CaptureHidden = "last") -> float:
    """Write ``out_dir/shard_NNNN.safetensors`` for every shard not yet there. Returns seconds spent."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [samples[i:i + shard_size] for i in range(0, len(samples), shard_size)]
    todo_tokens = sum(len(s.ids) for k, shard in enumerate(shards) if not _shard_path(out_dir, k).is_file()
                      for s in shard)
    start = time.perf_counter()
    bar = tqdm(total=todo_tokens, desc=desc, unit="tok", unit_scale=True)
    for k, shard in enumerate(shards):
        path = _shard_path(out_dir, k)
        if path.is_file():
            continue
        features: list[torch.Tensor] = []
        for pack in _packs(shard, max_tokens):
            features += target_features(runner, [shard[i] for i in pack], capture)
            bar.update(sum(len(shard[i].ids) for i in pack))
        lens = torch.tensor([len(s.ids) for s in shard])
        tensors = {
            "ids": torch.tensor([t for s in shard for t in s.ids], dtype=torch.int32),
            "features": torch.cat(features),
            "lengths": lens,
            "prompt_lens": torch.tensor([s.prompt_len for s in shard]),
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"sources": ",".join(s.source for s in shard)})
        tmp.replace(path)
    bar.close()
    return time.perf_counter() - start


def load_sequences(out_dir: pathlib.Path) -> list[Sequence]:
    from safetensors import safe_open

    out = []
    for path in sorted(out_dir.glob("shard_*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                sources = f.metadata()["sources"].split(",")
                ids, features = f.get_tensor("ids").long(), f.get_tensor("features")
                lens, prompt_lens = f.get_tensor("lengths").tolist(), f.get_tensor("prompt_lens").tolist()
            shard = [Sequence(ids=a, features=b, prompt_len=prompt_lens[i], source=sources[i])
                     for i, (a, b) in enumerate(zip(ids.split(lens), features.split(lens)))]
        except Exception as error:  # safetensors' header error, a missing tensor, lengths that do not add up
            raise DamagedFileError(path, "feature shard", error,
                                   "remove it (or its folder) and run the same command again: the missing shards "
                                   "are computed anew") from error
        out += shard
    return out


def mark_target_replies(seqs: list[Sequence], samples: list[Sample], written_by_the_target: bool) -> None:
    """Set each sequence's ``target_reply`` from the sample its features were computed from (the shards keep
    samples' order): a greedy sample's reply where the engine that wrote the replies ran the features' target."""
    if len(seqs) != len(samples):
        raise ValueError(f"{len(seqs)} sequences for {len(samples)} samples: the features are not these samples'")
    for seq, sample in zip(seqs, samples):
        seq.target_reply = written_by_the_target and sample.greedy


def _shard_path(out_dir: pathlib.Path, k: int) -> pathlib.Path:
    return out_dir / f"shard_{k:04d}.safetensors"
