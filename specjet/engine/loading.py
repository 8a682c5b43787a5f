"""Building the engine's parts from its arguments: model files, tokenizer, runner, grammar, scheduler."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from specjet.engine.args import EngineArgs
from specjet.grammar import GrammarBackend
from specjet.models.config import ModelConfig
from specjet.models.quantize import choose_draft_method, choose_method
from specjet.models.runner import ModelRunner, total_memory_bytes
from specjet.models.weights import gguf_source, load_state_dict, resolve_model_path
from specjet.scheduler.event_loops import EventLoop
from specjet.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from specjet.scheduler.scheduler import Scheduler, SchedulerConfig
from specjet.scheduler.worker import ModelWorker
from specjet.spec_v2.config import HYBRID_ALGORITHMS, SpecConfig
from specjet.spec_v2.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass
class Components:
    tokenizer: object
    scheduler: Scheduler  # the host side: requests, KV, results
    worker: ModelWorker  # the compute side: forwards, sampling, speculation
    loop: EventLoop  # runs both on the scheduler thread


def use_overlap_schedule(disable_overlap_schedule: bool | None, device: torch.device) -> bool:
    """Whether the engine runs the overlap loop: as asked, else on CUDA only (EngineArgs says why)."""
    if disable_overlap_schedule is None:
        return device.type != "cpu"
    return not disable_overlap_schedule


def _draft_quantization(args: EngineArgs, quantization: str | None, device: torch.device) -> str | None:
    draft_quantization, why = choose_draft_method(args.speculative_draft_model_quantization, quantization, device)
    logger.info("draft quantization %s (%s)", draft_quantization, why)
    return draft_quantization


def release_freed_heap() -> None:
    """Give the C heap's free pages back to the system. glibc keeps what a process frees for its later allocations:
    quantizing a model frees its float weights' temporaries (each weight's float32 copy and quantization
    intermediates, ~0.6 GB for the default model in int8), which otherwise stayed resident for the engine's life.
    A C library without malloc_trim (not glibc) keeps its own policy."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: Windows' CDLL takes no None
        return
    trim(0)


def with_generation_eos(config: ModelConfig, model_dir) -> ModelConfig:
    """``config`` with the end-of-turn ids of the model's ``generation_config.json`` too (Llama 3's instruct models
    list ``<|eot_id|>`` only there, and would otherwise run on past every reply to the token limit)."""
    import dataclasses

    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):  # no generation_config.json, or one transformers cannot read
        return config
    extra = [eos] if isinstance(eos, int) else list(eos or ())
    ids = tuple(dict.fromkeys([*config.eos_token_ids, *(int(t) for t in extra)]))
    return dataclasses.replace(config, eos_token_ids=ids) if ids != config.eos_token_ids else config


def load_components(args: EngineArgs, device: torch.device) -> Components:
    # Nothing is fetched from a hub: the model directory is local (or converted from a local GGUF).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_path(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = with_generation_eos(ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir)), model_dir)
    if args.context_length is not None and args.context_length > config.max_position_embeddings:
        # Positions past the model's were never trained (RoPE extrapolates into garbage), and each running
        # request's row of the token table holds the whole context.
        raise ValueError(f"context_length={args.context_length} is longer than the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    window = config.sliding_window
    if window is not None and args.context_length is not None and args.context_length > window:
        raise ValueError(f"context_length={args.context_length} is longer than the model's sliding_window ({window}): "
                         "specjet attends to the whole context, which is the model's attention only within its window")
    context_len = args.context_length or min(config.max_position_embeddings, window or config.max_position_embeddings)
    if window is not None and args.context_length is None and window < config.max_position_embeddings:
        logger.info("context length %d, the model's sliding window (its attention beyond it is not computed)", window)
    table_bytes = (args.max_running_requests + 1) * context_len * 8  # ReqToTokenPool's int64 rows
    if table_bytes > total_memory_bytes(device):
        raise ValueError(f"max_running_requests={args.max_running_requests} requests of context length {context_len} "
                         f"need a {table_bytes / 2**30:.1f} GiB token table, more than the "
                         f"{total_memory_bytes(device) / 2**30:.1f} GiB available")
    gguf_path = gguf_source(args.model_path)
    quantization, why = choose_method(args.quantization, device, gguf_path, config)
    logger.info("quantization %s (%s)", quantization, why)
    runner = ModelRunner(config, load_state_dict(model_dir), args.dtype, device, args.max_total_tokens,
                         args.mem_fraction_static, args.page_size,
                         batch_invariant=args.enable_deterministic_inference, quantization=quantization,
                         gguf_path=gguf_path if quantization == "gguf" else None, kv_cache_dtype=args.kv_cache_dtype)
    grammar = GrammarBackend(tokenizer, config.vocab_size, compile_timeout_s=args.grammar_compile_timeout,
                             max_spec_bytes=args.grammar_max_spec_bytes,
                             canonical_forced_text=not args.disable_canonical_forced_text,
                             stop_token_ids=config.eos_token_ids)
    sched_config = SchedulerConfig(
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_len=context_len,
        random_seed=args.random_seed,
        disable_radix_cache=args.disable_radix_cache,
        chunked_prefill_size=None if args.chunked_prefill_size in (None, -1) else args.chunked_prefill_size,
        grammar_token_timeout=args.grammar_token_timeout,
        max_queued_requests=args.max_queued_requests,
    )
    allocator = TokenToKVPoolAllocator(runner.kv_cache.num_slots, args.page_size, runner.device)
    req_to_token_pool = ReqToTokenPool(args.max_running_requests + 1, sched_config.context_len, runner.device)
    cpu = runner.device.type == "cpu"
    quantized_cpu = quantization is not None and cpu
    spec_config = SpecConfig.from_args(args, quantized_cpu_target=quantized_cpu, cpu_target=cpu,
                                       tiled_bf16_target=runner.tiled_rows)
    if spec_config is None and not args.disable_guided_drafting and args.enable_deterministic_inference:
        # requests with a prediction or a grammar still draft (NGRAM's trees), the others take plain steps, or on
        # a CPU with a DFlash draft for the model draft while they decode alone
        free_text = args.drafts_free_text(runner.device.type)
        spec_config = SpecConfig.for_guided(args, quantized_cpu_target=quantized_cpu, cpu_target=cpu,
                                            free_text=free_text, tiled_bf16_target=runner.tiled_rows)
        logger.info("guided drafting%s", " and free-text drafting alone (DFLASH)" if free_text else "")
    loads_draft = spec_config is not None and (spec_config.algorithm in HYBRID_ALGORITHMS or spec_config.solo is not None)
    if args.speculative_draft_model_path is not None and not loads_draft:
        logger.warning("speculative_draft_model_path %s is not used: no learned draft runs on this engine (it needs "
                       "speculative_algorithm 'EAGLE' or 'DFLASH', or the default engine's free-text drafting)",
                       args.speculative_draft_model_path)
    if spec_config is not None and spec_config.algorithm in HYBRID_ALGORITHMS:
        spec_config = replace(spec_config, draft_quantization=_draft_quantization(args, quantization, runner.device))
    if spec_config is not None and spec_config.solo is not None:
        spec_config = replace(spec_config, solo=replace(
            spec_config.solo, draft_quantization=_draft_quantization(args, quantization, runner.device)))
    speculator = (Speculator(spec_config, runner, allocator, sched_config.context_len, tokenize=grammar.tokenize,
                             token_bytes=grammar.token_bytes) if spec_config is not None else None)
    if runner.device.type == "cuda" and not args.disable_cuda_graph:
        # The target's decode and verify forwards replay CUDA graphs (models/target_graphs.py), the
        # buckets this engine's iterations take captured now.
        graphs = runner.enable_graphs(req_to_token_pool.table)
        if speculator is None or speculator.guided_only:  # plain decode steps
            graphs.capture_buckets()
        if speculator is not None:
            graphs.capture_buckets(speculator.max_nodes, speculator.target_capture)
    if runner.device.type == "cpu":
        release_freed_heap()  # the float temporaries of quantizing the target's and draft's weights
    worker = ModelWorker(runner, req_to_token_pool.table, speculator)
    scheduler = Scheduler(tokenizer, grammar, sched_config, allocator, req_to_token_pool, config.vocab_size,
                          config.eos_token_ids, spec=speculator)
    overlap = use_overlap_schedule(args.disable_overlap_schedule, runner.device)
    logger.info("scheduler loop: %s", "overlap" if overlap else "plain")
    loop = EventLoop(scheduler, worker, overlap=overlap)
    return Components(tokenizer, scheduler, worker, loop)
