"""The model runner: loads a model and its KV buffers, and runs one forward for a batch."""
from __future__ import annotations

import logging
import os

import torch

from specjet.kernels import bf16_gemm, cpu_ops, fp32_gemm
from specjet.kernels.cpu_features import describe_cpu, has_native_bf16
from specjet.models.config import ModelConfig
from specjet.models.forward_batch import ForwardBatch, ForwardMode, ModelOutput, host_token_tensors
from specjet.models.kv_cache import KVCache
from specjet.models.llama import Linear, LlamaForCausalLM, Rotary
from specjet.models.operand_arena import gather_operands
from specjet.models.quantize import check_method, quantize_model
from specjet.models.target_graphs import TargetGraphs

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """What ``dtype="auto"`` means on ``device``: bf16 on CUDA; on CPU bf16 where the CPU has native
    bf16 matrix instructions (AVX-512 BF16, AMX), else fp32, since emulated bf16 matmuls cost ~8x
    fp32 ones (see kernels/cpu_features.py)."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if has_native_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """A dtype name (or None / 'auto': ``auto_dtype``, float32 with quantized weights on CPU, whose
    kernels compute in float32 and would only convert bf16 activations back and forth) -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if quantization is not None and torch.device(device).type == "cpu":
            return torch.float32
        return auto_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                   "fp32": torch.float32}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device,
                     quantization: str | None = None) -> torch.dtype:
    """The KV cache's dtype: the model's, or bf16 under a float32 model on the CPU, where the C++ ops round
    each stored key and value to bf16 and widen it back as the attention reads it. ``auto``: bf16 beside
    quantized weights on the CPU (their float32 activations; the weights' rounding already outweighs the
    cache's, and half the bytes make long contexts faster to read), else the model's dtype."""
    check_kv_cache_dtype(kv_cache_dtype)
    kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_dtype is None:
        quantized_cpu = quantization is not None and torch.device(device).type == "cpu" and dtype == torch.float32
        kv_dtype = torch.bfloat16 if quantized_cpu else dtype
    if kv_dtype != dtype and (torch.device(device).type != "cpu" or dtype != torch.float32):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs float32 activations on the CPU "
                         f"(dtype is {str(dtype).removeprefix('torch.')} on {device}); use 'auto'")
    return kv_dtype


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype, device,
                quantization: str | None = None, gguf_path=None) -> LlamaForCausalLM:
    # Build on the meta device so no time goes into random initialisation of weights we overwrite.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.rotary = Rotary(config, device)
    # Projections about to be quantized skip the float packing (its row plans are checked by running them), and
    # with the GGUF's own blocks, which replace every projection and the head, their float weights are not read.
    model.load_weights(state_dict, pack=quantization is None, projections=quantization != "gguf")
    if quantization is not None:
        quantize_model(model, quantization, gguf_path)
        for module in model.modules():
            if isinstance(module, Linear) and module.packed is None:  # stayed float (quantize_linears says why)
                module.pack_for_decode()
            elif isinstance(module, Linear) and not module.weight_t.is_meta:  # (GGUF blocks: never read)
                module.drop_float_weight()  # the quantized operand computes alone: its float weight is dead weight
    if torch.device(device).type == "cpu":
        gather_operands(model)  # before the layer stack takes references to the operands
    model.use_native_ops()
    return model.eval()


def available_host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The memory a new allocation can have without swapping: Linux's MemAvailable (free pages plus the page cache
    and slabs the kernel can drop). Free pages alone (SC_AVPHYS_PAGES) shrink to a few hundred MB on a machine whose
    page cache has filled, which sized the default KV pool to a few hundred tokens; they remain the fallback where
    there is no /proc/meminfo."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return available_host_memory_bytes()


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        dtype,
        device,
        max_total_tokens: int | None,
        mem_fraction_static: float,
        page_size: int,
        batch_invariant: bool = True,
        quantization: str | None = None,  # None, or one of models/quantize.py's QUANTIZATION_METHODS
        gguf_path=None,  # the GGUF the weights came from (quantization="gguf" reads its blocks)
        kv_cache_dtype: str = "auto",  # see resolve_kv_dtype
    ):
        self.device = torch.device(device)
        check_method(quantization)
        if quantization is not None and self.device.type != "cpu":
            raise ValueError(f"quantization={quantization!r} has CPU kernels only; device is {self.device}")
        self.quantization = quantization
        self.dtype = resolve_dtype(dtype, self.device, quantization)
        where = describe_cpu() if self.device.type == "cpu" else str(self.device)
        logger.info("dtype %s (%s) on %s", str(self.dtype).removeprefix("torch."),
                    "auto" if dtype in (None, "auto") else "asked for", where)
        # (quantized weights compute on the integer kernels, whatever the activations' dtype)
        emulated = self.device.type == "cpu" and quantization is None and not has_native_bf16()
        if self.dtype == torch.bfloat16 and emulated:
            logger.warning("dtype bfloat16 on a CPU without native bf16 instructions (AVX-512 BF16, AMX): its "
                           "matmuls are emulated, several times slower than float32 ones, and checking each "
                           "weight shape's row plan at load takes seconds; dtype='auto' picks float32 here")
        self.config = config
        self.model = build_model(config, state_dict, self.dtype, self.device, quantization, gguf_path)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            logger.info("%s", bf16_gemm.describe_kernels())
        elif self.dtype == torch.float32 and self.device.type == "cpu" and quantization is None:
            logger.info("%s", fp32_gemm.describe_kernels())
        if self.device.type == "cpu" and quantization is None:
            bound = getattr(self.model, "argmax_bound", None)
            logger.info("greedy rows' LM head: %s", "every column" if bound is None else
                        "the columns an int8 copy's bound leaves (kernels/argmax_bound.py)"
                        + ("" if bound.max_rows is None else f", in calls of at most {bound.max_rows} such rows"))
        # Whether the projections take a forward's rows in 16-row AMX tiles (every packed weight on specjet's AMX
        # bf16 GEMM): a verify of up to 16 nodes costs ~1.3x a one-token step there, of 17 or more far more
        # (spec_v2/config.py's tiled defaults).
        packed = [m.packed for m in self.model.modules() if hasattr(m, "packed")]
        self.tiled_rows = bool(packed) and all(
            isinstance(p, bf16_gemm.Bf16Linear) and p.isa == bf16_gemm.ISAS["amx"] for p in packed)
        self.model.set_batch_invariant(batch_invariant)
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, self.dtype, self.device, quantization)
        per_token = KVCache.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, self.kv_dtype)
        if max_total_tokens is None:
            max_total_tokens = int(total_memory_bytes(self.device) * mem_fraction_static) // per_token
        elif max_total_tokens * per_token > total_memory_bytes(self.device):  # a pool that cannot be had
            raise ValueError(f"max_total_tokens={max_total_tokens} needs {max_total_tokens * per_token / 2**30:.1f} GiB "
                             f"of KV cache, more than the {total_memory_bytes(self.device) / 2**30:.1f} GiB "
                             f"available on {self.device}")
        # One extra page: page 0 is the padding page and never holds a request's token.
        num_pages = -(-max_total_tokens // page_size) + 1
        self.kv_cache = KVCache(config.num_layers, num_pages * page_size, config.num_kv_heads, config.head_dim,
                                self.kv_dtype, self.device)
        logger.info("KV cache: %d tokens (%.1f MiB, %s)", max_total_tokens, num_pages * page_size * per_token / 2**20,
                    str(self.kv_dtype).removeprefix("torch."))
        if self.device.type == "cpu":
            logger.info("%s", cpu_ops.describe_attention(self.kv_dtype, config.head_dim))
        self.graphs: TargetGraphs | None = None  # decode and verify on static buffers (enable_graphs)

    def enable_graphs(self, req_to_token: torch.Tensor, capture: bool | None = None) -> TargetGraphs:
        """Run decode and verify forwards through padded batch buckets over ``req_to_token``'s slots,
        captured as CUDA graphs on CUDA (``capture``; models/target_graphs.py)."""
        self.graphs = TargetGraphs(self, req_to_token, capture)
        return self.graphs

    def forward(self, batch: ForwardBatch) -> ModelOutput:
        return self.model(batch, self.kv_cache)

    def forward_lists(self, ids: list[int], positions: list[int], slot_cols: list[int], rows: list[int],
                      q_lens: list[int], kv_lens: list[int], table: torch.Tensor,
                      custom_mask: torch.Tensor | None = None, capture_hidden=None,
                      logits_mask: tuple[torch.Tensor, torch.Tensor] | None = None, defer_logits: bool = False,
                      last_logits: bool = False, logit_rows: list[int] | None = None,
                      argmax_rows: torch.Tensor | None = None) -> ModelOutput:
        """A prefill, a decode step or a verify given as host lists (``LlamaForCausalLM.forward_lists`` says what
        they hold): one C++ call of the layer stack where the model takes it, else ``forward`` on the batch
        ``host_token_tensors`` and ``ForwardBatch.from_host`` build from the same lists (the same output: tested).
        Logits of every row, of each request's last (``last_logits``) or of the flat rows ``logit_rows``;
        ``argmax_rows`` (bool, one per logits row): rows only an argmax reads (``LlamaForCausalLM.head_logits``)."""
        kwargs = dict(custom_mask=custom_mask, capture_hidden=capture_hidden, logits_mask=logits_mask,
                      defer_logits=defer_logits, last_logits=last_logits, logit_rows=logit_rows)
        out = self.model.forward_lists(ids, positions, slot_cols, rows, q_lens, kv_lens, table, self.kv_cache,
                                       argmax_rows=argmax_rows, **kwargs)
        if out is not None:
            return out
        token_rows = [row for row, n in zip(rows, q_lens) for _ in range(n)]
        ids_t, positions_t, slots = host_token_tensors(table, ids, positions, token_rows, slot_cols)
        mode = (ForwardMode.VERIFY if custom_mask is not None else
                ForwardMode.DECODE if max(q_lens) == 1 else ForwardMode.EXTEND)
        return self.forward(ForwardBatch.from_host(mode, ids_t, positions_t, slots, table, rows, q_lens, kv_lens,
                                                   custom_mask, capture_hidden, logits_mask, defer_logits,
                                                   last_logits, logit_rows))

    @property
    def head_takes_masks(self) -> bool:
        """Whether the LM head computes only the columns a grammar mask allows, for rows that allow few
        (``head``): a quantized head on the CPU's kernels, a bf16 one on the VDPBF16PS GEMM or a float32 one on
        specjet's float32 GEMM."""
        return bool(getattr(self.model.lm_head.packed, "has_masked_kernel", False))

    def head(self, hidden: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor] | None = None,
             argmax_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a forward whose head was deferred (``ForwardBatch.defer_logits``): its normed rows,
        under their grammar masks (bitmask [N, W], masked [N]) where the head takes them; ``argmax_rows``
        (bool [N]): rows only an argmax reads (``LlamaForCausalLM.head_logits``)."""
        return self.model.head_logits(hidden, mask, argmax_rows)
