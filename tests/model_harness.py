"""A minimal driver for the model alone (no scheduler): one request, contiguous slots."""
from __future__ import annotations

import torch

from specjet.models.config import ModelConfig
from specjet.models.forward_batch import ForwardBatch, ForwardMode
from specjet.models.runner import ModelRunner
from specjet.models.weights import load_state_dict


def load_runner(model_dir, dtype="float32", tokens=4096, device="cpu") -> ModelRunner:
    from transformers import AutoConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    return ModelRunner(config, load_state_dict(model_dir), dtype, device, tokens, 0.0, 1)


class OneRequest:
    """Positions 0..n of one request live in slots 1..n+1 (slot 0 is the padding slot)."""

    def __init__(self, runner: ModelRunner, max_len: int = 1024):
        self.runner = runner
        self.table = torch.arange(1, max_len + 1, dtype=torch.int64)[None, :]
        self.len = 0

    def extend(self, ids: list[int], mode=ForwardMode.EXTEND, custom_mask=None, logits="all", capture=None):
        n = len(ids)
        positions = torch.arange(self.len, self.len + n)
        batch = ForwardBatch.build(
            mode,
            input_ids=torch.tensor(ids),
            positions=positions if custom_mask is None else positions,
            out_cache_loc=self.table[0, self.len:self.len + n],
            req_to_token=self.table,
            req_pool_indices=torch.tensor([0]),
            kv_lens=torch.tensor([self.len + n]),
            q_lens=torch.tensor([n]),
            custom_mask=custom_mask,
            logits=logits,
            capture_hidden=capture,
        )
        out = self.runner.forward(batch)
        self.len += n
        return out


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i may see node j when j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def count_stack_runs(monkeypatch) -> dict:
    """Spies on models/llama.py's ``run_layer_stack``: ``counts["ran"]`` forwards that went as one C++
    call, ``counts["aside"]`` those where the stack stood aside (the Python loop ran); ``counts["lists"]``
    forwards from host lists (``LlamaForCausalLM.forward_lists``), which run the stack too, and count in "ran"."""
    from specjet.models import llama

    counts = {"ran": 0, "aside": 0, "lists": 0}
    real = llama.run_layer_stack
    real_lists = llama.LlamaForCausalLM.forward_lists

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        counts["ran" if out is not None else "aside"] += 1
        return out

    def spy_lists(*args, **kwargs):
        out = real_lists(*args, **kwargs)
        if out is not None:
            counts["ran"] += 1
            counts["lists"] += 1
        return out

    monkeypatch.setattr(llama, "run_layer_stack", spy)
    monkeypatch.setattr(llama.LlamaForCausalLM, "forward_lists", spy_lists)
    return counts
