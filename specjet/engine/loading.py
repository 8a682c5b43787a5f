"""Building the engine's parts from its arguments: model files, tokenizer, runner, grammar, scheduler."""
from __future__ import annotations

import os

import torch

from specjet.engine.args import EngineArgs
from specjet.grammar import GrammarBackend
from specjet.models.config import ModelConfig
from specjet.models.runner import ModelRunner
from specjet.models.weights import load_state_dict, resolve_model_path
from specjet.scheduler.scheduler import Scheduler, SchedulerConfig


def load_components(args: EngineArgs, device: torch.device):
    # Nothing is fetched from a hub: the model directory is local (or converted from a local GGUF).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_path(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    runner = ModelRunner(config, load_state_dict(model_dir), args.dtype, device, args.max_total_tokens,
                         args.mem_fraction_static, args.page_size)
    grammar = GrammarBackend(tokenizer, config.vocab_size)
    context_len = args.context_length or config.max_position_embeddings
    scheduler = Scheduler(runner, tokenizer, grammar, SchedulerConfig(
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_len=context_len,
        random_seed=args.random_seed,
    ))
    return tokenizer, scheduler
