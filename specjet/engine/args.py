"""Engine arguments, with SGLang's names so users can move between the two."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

_TYPE_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


# The devices an engine runs on.
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def resolve_device(device: str):
    """The torch device an engine's ``device`` names ("auto": CUDA where torch sees one, else the CPU)."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class EngineArgs:
    model_path: str | None = None  # None: the embedded default model (SmolLM2-135M-Instruct)
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX), else float32
    device: str = "auto"  # auto: cuda when available, else cpu
    # Weight-only quantization (SGLang's name; CPU kernels): "int8" (per output channel), "int4" (blocks
    # of 32 with a scale and a minimum), "gguf" (compute with the GGUF file's own blocks: Q4_1 / Q8_0),
    # None (float weights), or "auto": "gguf" on CPU for a model from a GGUF file whose blocks the
    # kernels take (the embedded default model is one), else None (models/quantize.py:choose_method).
    # With quantization, dtype "auto" means float32 (the kernels compute in float32).
    quantization: str | None = "auto"
    # The KV cache's dtype (SGLang's name): "auto", "bfloat16" / "bf16" or "float32" / "fp32". bf16 beside float32
    # activations on the CPU holds twice the tokens in the same memory, each key and value rounded to bf16 once as
    # it is stored, and reads long contexts faster. "auto": bf16 beside quantized weights on the CPU (the default
    # model's GGUF path), else the model's dtype (models/runner.py resolve_kv_dtype; bench/RESULTS.md session 47).
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    max_running_requests: int = 32
    max_total_tokens: int | None = None  # KV pool size in tokens; None: mem_fraction_static of available memory
    mem_fraction_static: float = 0.05
    max_prefill_tokens: int = 4096  # prompt tokens one prefill batch computes at most
    # A prompt whose uncached part is longer is prefilled in chunks of this many tokens, one per
    # iteration, with the running requests' decode steps in between; None or -1: no chunking.
    chunked_prefill_size: int | None = 2048
    # The radix prefix cache (scheduler/radix_cache.py): requests sharing a prefix share its KV.
    disable_radix_cache: bool = False
    context_length: int | None = None  # None: the model's max_position_embeddings
    # SGLang's name. None (default): the overlap loop on CUDA, the plain loop on the CPU, where the host's
    # work cannot run beside a forward (the C++ kernels keep the GIL, and their threads every core;
    # csrc/module.cpp): there the overlap loop's thread hand-offs only add time (bench/RESULTS.md, session
    # 54). True: the plain loop; False: the overlap loop.
    disable_overlap_schedule: bool | None = None
    grammar_backend: str = "xgrammar"
    # Limits on one grammar (specjet's own; each failure is a clear per-request error): seconds a
    # compile may take (None: no limit; the dev set's slowest schema takes well under one) and the
    # size of its spec text in bytes. Defaults: specjet.grammar.backend / spec.
    grammar_compile_timeout: float | None = 10.0
    grammar_max_spec_bytes: int = 128 << 10
    # CPU seconds the grammar may spend matching one token of a request (None: no limit). An ambiguous grammar
    # (``a ::= a a | "x"``) costs more with every token, seconds a token within a few hundred, all of it on the
    # scheduler's thread while every other request waits. Past the limit on 3 tokens in a row the request ends
    # alone (abort, a message naming it). The limit is ~100x what the dev set's schemas take, and above what a huge
    # enum's first tokens take (bench/RESULTS.md, session 104).
    grammar_token_timeout: float | None = 0.02
    # Where a grammar forces text (a JSON schema's keys and punctuation, a tool call's name), it is written in the
    # tokenizer's own tokens: the mask allows only the first token of the forced text's split (the last is left
    # to the model). True: the model picks any tokens that spell the forced text, as token-by-token masking alone
    # does (grammar/forced_tokens.py).
    disable_canonical_forced_text: bool = False
    # SGLang's name: the most requests submitted and not yet started (waiting for a slot) the engine holds; a call
    # that would pass it queues nothing and raises specjet.QueueFullError (the server: 503 with Retry-After), one of
    # more requests than the bound ValueError.
    # None (default): no bound, as an offline batch of many thousand prompts needs.
    max_queued_requests: int | None = None
    random_seed: int | None = None
    # Speculative decoding (SGLang's names). None: the algorithm's default; every default and every
    # range check is in one place, specjet/spec_v2/config.py (SpecConfig.from_args).
    speculative_algorithm: str | None = None  # "EAGLE", "NGRAM" or "DFLASH"
    # The EAGLE head's or DFlash draft's directory; None: the one shipped for the default model.
    speculative_draft_model_path: str | None = None
    # The EAGLE head's / DFlash draft's weights (SGLang's name): "int8", "int4", "gguf" (4-bit blocks),
    # None (float), or "auto": the target's method for a quantized target, int8 beside a float target
    # on a CPU with the vectorised kernels (models/quantize.py choose_draft_method), else float.
    speculative_draft_model_quantization: str | None = "auto"
    speculative_num_steps: int | None = None  # EAGLE: draft forwards per iteration
    # EAGLE: branching per draft step; DFLASH: candidates per block position (1: a chain).
    speculative_eagle_topk: int | None = None
    # Nodes of the drafter's tree, root included (EAGLE: the learned tree; NGRAM: the whole tree; DFLASH: its
    # block, the root and its drafts).
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None
    speculative_ngram_max_bfs_breadth: int | None = None
    # EAGLE + n-gram (specjet's own): each EAGLE tree also takes the request's best n-gram
    # continuation, a path of up to this many extra nodes (its length adapts per request); the
    # n-gram window flags above apply. 0: the trained head's trees alone (EAGLE-2 as SGLang runs it).
    speculative_hybrid_ngram_tokens: int | None = None
    # Tree nodes one verify forward may hold across its batch (specjet's own): with B requests each
    # tree gets at most max(2, this // B) nodes, its learned and n-gram parts cut in proportion.
    speculative_max_verify_tokens: int | None = None
    # DFLASH: context positions its draft sees before the block, the last W (SGLang's name); None: all.
    speculative_dflash_draft_window_size: int | None = None
    # EAGLE and DFLASH (specjet's own): tree nodes whose path probability under the draft is below this
    # are not verified (0: the whole tree is).
    speculative_draft_min_prob: float | None = None
    # Grammar-aware drafting: draft top-k over grammar-legal tokens only, and the grammar's forced
    # continuation enters the tree as free nodes (specjet's own knob; SGLang has none).
    speculative_grammar_aware: bool = True
    # Without speculative_algorithm (specjet's own): requests that bring a prediction or decode under a grammar
    # still draft, NGRAM's trees of the caller's predicted text, the grammar's forced text and the reply's own
    # n-grams, none of which costs a model forward; every other request decodes with plain steps. True: every
    # request does (as does enable_deterministic_inference=False, whose kernels could not verify exactly).
    disable_guided_drafting: bool = False
    # Without speculative_algorithm, on a CPU (specjet's own): a request without a grammar or a prediction that
    # decodes alone (the agent's one call at a time) drafts too, DFLASH blocks from the draft shipped for the
    # default model (or speculative_draft_model_path's), while drafting measures faster than plain steps
    # (speculative_measured_payoff). Once it decodes beside others it takes plain steps to its end, which beside
    # others cost less than any draft saves. Output is the same. True: such requests never draft.
    disable_free_text_drafting: bool = False
    # EAGLE and DFLASH (specjet's own): a request without a grammar decoding alone drafts only while
    # drafting measures faster than plain steps at its context length (spec_v2/payoff.py); a long
    # conversation whose drafts are rarely accepted then decodes near the plain rate. Output is the same.
    # None (default): on a CPU target; True: on any device (a CUDA target too, not yet the default there:
    # its root-only iteration is not its plain decode graph, and it has not been measured on a GPU); False: off.
    speculative_measured_payoff: bool | None = None
    # The drafters' fixed-shape forwards (EAGLE's draft steps, DFLASH's block): "auto" (CUDA graphs
    # on CUDA, eager on CPU), "eager", or "static" (padded batch buckets on static buffers, captured
    # as CUDA graphs on CUDA unless disable_cuda_graph; models/graph_runner.py).
    speculative_draft_runner: str = "auto"
    # SGLang's name: never capture CUDA graphs (on CUDA the target's decode and verify forwards and the
    # drafters' are captured per batch bucket and replayed; models/target_graphs.py, graph_runner.py).
    disable_cuda_graph: bool = False
    # Batch-invariant attention on CPU (SGLang's name; on by default here): a token's logits do not
    # depend on what else is in its batch, which bf16 speculative decoding needs to reproduce plain
    # decoding bit for bit. Off: torch's SDPA and one oneDNN call per projection, for work that never
    # compares outputs across batch shapes; on CPU not the faster path (a batch-64 bf16 decode step ~3x
    # slower, bench.step; bench/RESULTS.md, sessions 45 and 46).
    enable_deterministic_inference: bool = True  # speculation refuses False (args.validate)
    log_level: str = "warning"

    def _check_types(self) -> None:
        """Each argument has the type its annotation names (bool is not an int here, an int is a
        float), so a wrong type fails here with its name rather than deep inside loading."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kinds = [k.strip() for k in str(f.type).split("|")]
            if value is None and "None" in kinds:
                continue
            ok = any(_TYPE_CHECKS[k](value) for k in kinds if k in _TYPE_CHECKS)
            if not ok:
                raise TypeError(f"Engine argument {f.name} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r}")
        for name in ("mem_fraction_static",):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        for name in ("max_prefill_tokens", "max_total_tokens", "context_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level must be one of debug, info, warning, error, critical, got {self.log_level!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Engine got unknown argument(s): {', '.join(unknown)}")
        args = cls(**kwargs)
        args.validate()
        return args

    def drafts_free_text(self, device_type: str) -> bool:
        """Whether an engine without ``speculative_algorithm`` on a ``device_type`` device drafts free text with a
        learned draft (DFLASH, for a request decoding alone): on a CPU, with guided and free-text drafting on and
        batch-invariant kernels, for a model that has a draft (``speculative_draft_model_path``'s, or the one shipped
        for the default model). The door and the load ask the same question."""
        from specjet.models.weights import is_default_model

        return (self.speculative_algorithm is None and device_type == "cpu" and not self.disable_guided_drafting
                and not self.disable_free_text_drafting and self.enable_deterministic_inference
                and (self.speculative_draft_model_path is not None or is_default_model(self.model_path)))

    def validate(self) -> None:
        self._check_types()
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        from specjet.models.runner import check_kv_cache_dtype  # its pairing with dtype: once the dtype is known

        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 \
                and self.chunked_prefill_size < self.page_size:
            raise ValueError(f"chunked_prefill_size must be -1 (off) or at least page_size ({self.page_size}), "
                             f"got {self.chunked_prefill_size}")
        if self.chunked_prefill_size not in (None, -1) and self.max_prefill_tokens < self.page_size:
            # A chunk ends on a page boundary within the prefill budget: a smaller budget holds no chunk.
            raise ValueError(f"max_prefill_tokens must be at least page_size ({self.page_size}) with chunked prefill, "
                             f"got {self.max_prefill_tokens}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r}, but this torch sees no CUDA device (a CPU build, or no GPU)")
            index = int(self.device.partition(":")[2] or 0)
            if index >= torch.cuda.device_count():
                raise ValueError(f"device={self.device!r}, but torch sees {torch.cuda.device_count()} CUDA device(s)")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2 * self.page_size:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} is too small for page_size {self.page_size}")
        if self.grammar_compile_timeout is not None and not (
                math.isfinite(self.grammar_compile_timeout) and self.grammar_compile_timeout > 0):
            raise ValueError(f"grammar_compile_timeout must be a positive number of seconds or None, "
                             f"got {self.grammar_compile_timeout}")
        if self.grammar_token_timeout is not None and not (
                math.isfinite(self.grammar_token_timeout) and self.grammar_token_timeout > 0):
            raise ValueError(f"grammar_token_timeout must be a positive number of seconds or None, "
                             f"got {self.grammar_token_timeout}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None, got {self.max_queued_requests}")
        if self.grammar_max_spec_bytes < 1:
            raise ValueError(f"grammar_max_spec_bytes must be >= 1, got {self.grammar_max_spec_bytes}")
        from specjet.models.quantize import check_method

        check_method(self.quantization, allow_auto=True)
        try:
            check_method(self.speculative_draft_model_quantization, allow_auto=True)
        except ValueError as err:
            raise ValueError(f"speculative_draft_model_{err}") from None
        if self.grammar_backend != "xgrammar":
            raise ValueError(f"grammar_backend {self.grammar_backend!r} is not supported; specjet uses 'xgrammar'")
        from specjet.spec_v2.config import DRAFT_QUANTIZATION_NEEDS_LEARNED_DRAFT, SpecConfig

        SpecConfig.from_args(self)  # raises naming the speculative argument that is out of range
        if (self.speculative_algorithm is None and self.speculative_draft_model_quantization != "auto"
                and not self.drafts_free_text(resolve_device(self.device).type)):
            raise ValueError(DRAFT_QUANTIZATION_NEEDS_LEARNED_DRAFT)
        if self.speculative_algorithm is not None and not self.enable_deterministic_inference:
            # Without batch-invariant attention a verify forward rounds differently from a decode step
            # (bench/RESULTS.md counts the diverging outputs), so speculation would change the output.
            raise ValueError("speculative decoding needs enable_deterministic_inference=True: its greedy output "
                             "must equal plain decoding token for token")
