"""Building the engine's parts from its arguments: model files, tokenizer, runner, grammar, scheduler."""
from __future__ import annotations

import os
import pathlib

import torch

from specjet.engine.args import EngineArgs
from specjet.grammar import GrammarBackend
from specjet.models.config import ModelConfig
from specjet.models.runner import ModelRunner
from specjet.models.weights import load_state_dict, resolve_model_path
from specjet.scheduler.scheduler import Scheduler, SchedulerConfig
from specjet.scheduler.spec_decode import SpecConfig
from specjet.models.eagle import default_eagle_path, load_eagle
from specjet.spec_v2.eagle_worker import EagleParams
from specjet.spec_v2.ngram import NgramConfig


def load_components(args: EngineArgs, device: torch.device):
    # Nothing is fetched from a hub: the model directory is local (or converted from a local GGUF).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_path(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    runner = ModelRunner(config, load_state_dict(model_dir), args.dtype, device, args.max_total_tokens,
                         args.mem_fraction_static, args.page_size,
                         batch_invariant=args.enable_deterministic_inference)
    grammar = GrammarBackend(tokenizer, config.vocab_size, compile_timeout_s=args.grammar_compile_timeout,
                             max_spec_bytes=args.grammar_max_spec_bytes)
    context_len = args.context_length or config.max_position_embeddings
    spec = None
    if args.speculative_algorithm == "NGRAM":
        num_nodes = args.speculative_num_draft_tokens or 8
        spec = SpecConfig("NGRAM", num_nodes, ngram_config(args, num_nodes, args.speculative_ngram_max_bfs_breadth),
                          grammar_aware=args.speculative_grammar_aware, max_verify_tokens=args.speculative_max_verify_tokens)
    elif args.speculative_algorithm == "EAGLE":
        head_dir = args.speculative_draft_model_path or default_eagle_path()
        if not pathlib.Path(head_dir).exists():
            raise FileNotFoundError(f"EAGLE draft head not found at {head_dir}")
        head = load_eagle(head_dir, config, dtype=runner.dtype, device=runner.device)
        params = EagleParams(
            num_steps=args.speculative_num_steps or 4,
            topk=args.speculative_eagle_topk or 4,
            num_draft_tokens=args.speculative_num_draft_tokens or 12,
        )
        extra = args.speculative_hybrid_ngram_tokens
        extra = DEFAULT_HYBRID_NGRAM_TOKENS if extra is None else extra
        # The hybrid's n-gram path is one branch whose length SpecDecoder sets per request (PathLength).
        spec = SpecConfig("EAGLE", params.num_draft_tokens + extra, eagle=params, eagle_head=head,
                          grammar_aware=args.speculative_grammar_aware,
                          ngram=ngram_config(args, params.num_draft_tokens + extra, 1), hybrid_ngram_tokens=extra,
                          max_verify_tokens=args.speculative_max_verify_tokens)
    scheduler = Scheduler(runner, tokenizer, grammar, SchedulerConfig(
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_len=context_len,
        random_seed=args.random_seed,
        spec=spec,
        overlap=not args.disable_overlap_schedule,
    ))
    return tokenizer, scheduler


# n-gram nodes merged into each EAGLE tree unless speculative_hybrid_ngram_tokens says otherwise (see args.py).
DEFAULT_HYBRID_NGRAM_TOKENS = 14


def ngram_config(args: EngineArgs, num_nodes: int, branches: int) -> NgramConfig:
    return NgramConfig(num_draft_tokens=num_nodes, max_window=args.speculative_ngram_max_match_window_size,
                       min_window=args.speculative_ngram_min_match_window_size, max_branches=branches)
