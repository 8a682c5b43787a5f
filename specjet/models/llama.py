"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) over specjet's paged KV cache.

Reads like the paper: RMSNorm, RoPE, attention, MLP, block, model. Projections are fused
(q|k|v and gate|up) so a decode step issues fewer, larger matmuls; `load_weights` maps the
Hugging Face names onto the fused tensors.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from specjet.kernels import cpu_ops
from specjet.kernels.argmax_bound import ArgmaxBound
from specjet.kernels.attention import native_whole_batch, paged_attention
from specjet.kernels.bf16_gemm import Bf16x3Linear
from specjet.kernels.layer_stack import StackLayer, build_layer_stack, run_layer_stack
from specjet.kernels.fp32_gemm import Fp32Linear
from specjet.kernels.linear import PackedLinear, linear, pack_onednn, pack_weight
from specjet.kernels.training_norm import rms_norm_train, rms_normalize
from specjet.models.config import ModelConfig
from specjet.models.forward_batch import CaptureHidden, FeatureLayers, ForwardBatch, ModelOutput
from specjet.models.kv_cache import KVCache

UNCHUNKED_ROWS = 1 << 30  # a projection plan's max_rows that no call reaches (``unchunk_projections``)


class Linear(nn.Module):
    """y = x W^T + b, with W stored transposed ([in, out]). After loading, ``pack_for_decode`` prepares a
    batch-invariant inference copy (see kernels/linear.py); ``packed = None`` means the plain
    autograd-friendly matmul (training)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # The inference operand, set by pack_for_decode() after loading: a PackedLinear, or a
        # QuantizedLinear (kernels/qgemm.py) once models/quantize.py has quantized the weight.
        self.packed: PackedLinear | None = None

    def pack_for_decode(self) -> None:
        self.packed = pack_weight(self.weight_t.data, None if self.bias is None else self.bias.data)

    def drop_float_weight(self) -> None:
        """Free the float weight of a projection whose quantized operand does all its computing: a meta tensor of
        its shape and dtype takes its place, so a use of its values fails loudly rather than reading stale numbers."""
        self.weight_t = nn.Parameter(self.weight_t.detach().to("meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight_t, self.bias, self.packed)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` without nn.Module's call machinery (hooks, tracing checks): the inference
        path calls ~120 projections per forward."""
        packed = self.packed
        return packed(x) if packed is not None else linear(x, self.weight_t, self.bias, None)


def _cuda_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether an op on ``x`` takes its Triton kernel: inference on CUDA in the weight's dtype (training keeps
    torch's ops, which have autograd)."""
    return x.is_cuda and not torch.is_grad_enabled() and x.dtype == weight.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def normalize(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        """The norm through the C++ op (``native``: where the model's layers run on it) or torch's."""
        return cpu_ops.rms_norm(x.contiguous(), self.weight, self.eps) if native else self(x)

    def add_and_normalize(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): one Triton kernel for inference on CUDA, torch's add and the norm elsewhere."""
        if _cuda_inference(x, self.weight):
            from specjet.kernels.triton_norm import add_rms_norm_triton

            return add_rms_norm_triton(x, residual, self.weight, self.eps)
        x = x + residual
        return x, self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _cuda_inference(x, self.weight):
            # Inference on CUDA: the batch-invariant kernel (training keeps torch's, which has autograd).
            from specjet.kernels.triton_norm import rms_norm_triton

            return rms_norm_triton(x, self.weight, self.eps)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            # Training: the same forward, its backward written out (kernels/training_norm.py).
            return rms_norm_train(x, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)[2]


class Rotary:
    """Neox-style RoPE (HF layout: rotate the two halves of each head).

    Not a module on purpose: the frequencies stay fp32 when the model is cast to bf16."""

    # On the CPU, positions' cos and sin are rows of a table grown a block of this many positions at a
    # time: a decode step then indexes two rows instead of running six small ops. Each block is computed
    # alone (one single-threaded pass of each op), so a position's row never depends on when the table
    # grew, and every forward reads the same numbers.
    TABLE_BLOCK = 1024

    def __init__(self, config: ModelConfig, device=None):
        inv_freq, self.scaling = config.rope_inv_freq()
        self.inv_freq = inv_freq.to(device)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D/2] cos and sin, computed once per forward and shared by every layer."""
        if positions.device.type != "cpu" or self.inv_freq.device.type != "cpu":
            return self._compute(positions, dtype)
        table = self._tables.get(dtype)
        if table is not None:
            try:
                return table[0][positions], table[1][positions]
            except IndexError:  # a position past the table: grow it
                pass
        cos, sin = self._grow(dtype, int(positions.max()) + 1 if positions.numel() else 1)
        return cos[positions], sin[positions]

    def table(self, dtype, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU tables of cos and sin rows ([>= positions, D/2] each, contiguous), grown to cover ``positions``."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < positions:
            table = self._grow(dtype, positions)
        return table

    def _compute(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)

    @torch.inference_mode(False)  # plain tensors, whichever mode grows the table
    @torch.no_grad()
    def _grow(self, dtype, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        empty = self.inv_freq.new_empty(0, self.inv_freq.numel(), dtype=dtype)
        cos, sin = self._tables.get(dtype, (empty, empty))
        blocks = [(cos, sin)]
        for start in range(cos.shape[0], positions, self.TABLE_BLOCK):
            blocks.append(self._compute(torch.arange(start, start + self.TABLE_BLOCK), dtype))
        table = self._tables[dtype] = (torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks]))
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.batch_invariant = True  # see LlamaForCausalLM.set_batch_invariant
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, batch: ForwardBatch, kv_cache: KVCache, native: bool = False) -> torch.Tensor:
        """``native``: RoPE and the K/V write as one C++ call (kernels/cpu_ops.py; no q/k norm); on
        CUDA as one Triton kernel (kernels/triton_rope.py)."""
        num_tokens = x.shape[0]
        k_cache, v_cache = kv_cache.k[self.layer_id], kv_cache.v[self.layer_id]
        if native:
            q = cpu_ops.rope_store(self.qkv_proj.project(x), cos, sin, k_cache, v_cache, batch.out_cache_loc,
                                   self.num_heads)
        elif x.is_cuda and self.q_norm is None and not torch.is_grad_enabled():
            # Inference on CUDA: the same math as below in one kernel instead of a dozen.
            from specjet.kernels.triton_rope import rope_store_triton

            q = rope_store_triton(self.qkv_proj.project(x), cos, sin, k_cache, v_cache, batch.out_cache_loc,
                                  self.num_heads)
        else:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            kv_cache.write(self.layer_id, batch.out_cache_loc, k, v)
        out = paged_attention(q, k_cache, v_cache, batch.attn, self.scale, invariant=self.batch_invariant)
        return self.o_proj.project(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and gate_up.dim() == 2 and not torch.is_grad_enabled():  # inference on CUDA
            from specjet.kernels.triton_silu_mul import silu_mul_triton

            return self.down_proj(silu_mul_triton(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.native_ops = False  # see LlamaForCausalLM.use_native_ops
        self.native_parts: tuple | None = None  # set with native_ops (set_native_ops)

    def forward(self, x, cos, sin, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        if self.native_ops:
            return self.forward_native(x, cos, sin, batch, kv_cache)
        x, out = self.forward_deferred(x, None, cos, sin, batch, kv_cache)
        return x + out

    def forward_deferred(self, x, pending: torch.Tensor | None, cos, sin, batch: ForwardBatch,
                         kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over ``x + pending`` (``pending``: the previous layer's MLP output not yet added, or None),
        that add done inside the input norm; returns (x, out) with ``x + out`` the layer's output, its own MLP
        output left for the next layer's norm. On CUDA each add goes with a norm into one kernel: a small
        model's step costs its kernels' count. Elsewhere the same torch ops as an add then a norm."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_normalize(x, pending)
        x, h = self.post_attention_layernorm.add_and_normalize(x, self.self_attn(h, cos, sin, batch, kv_cache))
        return x, self.mlp(h)

    def forward_native(self, x, cos, sin, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """The same layer in about ten calls (projections, C++ ops) instead of ~130 torch ops. What it
        touches comes from ``native_parts`` (set by ``set_native_ops``): a submodule or parameter looked
        up through nn.Module costs more than the C++ call it feeds at batch 1."""
        n1_weight, n1_eps, n2_weight, n2_eps, attn, gate_up, down = self.native_parts
        out = attn.forward(cpu_ops.rms_norm(x, n1_weight, n1_eps), cos, sin, batch, kv_cache, native=True)
        x, h = cpu_ops.rms_norm(x, n2_weight, n2_eps, residual=out)
        return x + down.project(cpu_ops.silu_mul(gate_up.project(h)))


def set_native_ops(layers, config: ModelConfig, weight: torch.Tensor, flag: bool = True) -> bool:
    """Turn the C++ CPU ops on for ``layers`` (DecoderLayers whose weights are like ``weight``)
    where they apply: CPU, float32 or bfloat16, the extension built, no q/k norm. Returns whether
    they are on. Call it again after replacing a layer's norm parameters or submodules (the native
    path holds them; a quantized projection's ``packed`` is read at each call)."""
    flag = (flag and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and not config.qk_norm and cpu_ops.extension() is not None)
    for layer in layers:
        layer.native_ops = flag
        norm1, norm2, attn, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp
        layer.native_parts = (norm1.weight, norm1.eps, norm2.weight, norm2.eps, attn, mlp.gate_up_proj,
                              mlp.down_proj) if flag else None
    return flag


def native_layer_stack(layers):
    """The C++ stack of ``layers`` (kernels/layer_stack.py) from what their native forward reads
    (``set_native_ops`` collected it), or None: not on the C++ ops, not on the CPU, or an operand
    without a C++ form. Build it again after replacing a layer's operands."""
    if not layers or not all(layer.native_ops for layer in layers):
        return None
    stack_layers = []
    for layer in layers:
        n1_weight, n1_eps, n2_weight, n2_eps, attn, gate_up, down = layer.native_parts
        if n1_weight.device.type != "cpu":
            return None
        stack_layers.append(StackLayer(n1_weight, n1_eps, n2_weight, n2_eps, attn.qkv_proj.packed,
                                       attn.o_proj.packed, gate_up.packed, down.packed))
    attn = layers[0].self_attn
    return build_layer_stack(stack_layers, attn.num_heads, attn.head_dim, attn.scale)


def run_layers(layers, stack, x, cos, sin, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
    """x through ``layers``: as one C++ call where ``stack`` (``native_layer_stack``) runs this batch,
    else layer by layer (same kernels, same bits)."""
    x, pending, _ = run_layers_deferred(layers, stack, x, cos, sin, batch, kv_cache)
    return x if pending is None else x + pending


def run_layers_deferred(layers, stack, x, cos, sin, batch: ForwardBatch, kv_cache: KVCache,
                        wanted: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
    """``run_layers`` with the last layer's MLP output not yet added: (x, pending, outputs), the layers' output
    ``x + pending`` (pending None where the layers ran native), so a final norm can take the add
    (``RMSNorm.add_and_normalize``: one kernel on CUDA), and ``outputs`` the output of each layer in ``wanted``
    (increasing indices). On the Python loop each MLP output is added by the next layer's input norm."""
    if stack is not None and layers[0].self_attn.batch_invariant:
        stacked = run_layer_stack(stack, x, cos, sin, batch.attn, batch.out_cache_loc, kv_cache.k, kv_cache.v,
                                  list(wanted))
        if stacked is not None:
            return stacked[0], None, dict(zip(wanted, stacked[1]))
    pending, outputs = None, {}
    for i, layer in enumerate(layers):
        # Methods, not __call__: nn.Module's call machinery costs ~10 us a layer at batch 1.
        if layer.native_ops:  # every layer of a model, or none (set_native_ops): nothing pending here
            x = layer.forward_native(x, cos, sin, batch, kv_cache)
        else:
            x, pending = layer.forward_deferred(x, pending, cos, sin, batch, kv_cache)
            if i in wanted:
                x, pending = x + pending, None
        if i in wanted:
            outputs[i] = x
    return x, pending, outputs


class _CheckpointTensors(dict):
    """A checkpoint's tensors by name, which names what is missing and what was never read: a tensor of a variant
    this model does not compute (an output projection's bias, an MLP's biases) would otherwise be dropped without
    a word, and the model give another model's output."""

    # Kept by some checkpoints and recomputed here (RoPE's frequencies).
    IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

    def __init__(self, tensors: dict[str, torch.Tensor], tied: bool):
        super().__init__(tensors)
        self.tied = tied
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            hint = (" (config.json's tie_word_embeddings is false; where the checkpoint's head is its embedding, set it "
                    "true)") if name == "lm_head.weight" and not self.tied else ""
            raise ValueError(f"weight {name} is missing from the checkpoint{hint}")
        self.read.add(name)
        return super().__getitem__(name)

    def check_all_read(self) -> None:
        unread = sorted(n for n in set(self) - self.read
                        if not n.endswith(self.IGNORED_SUFFIXES) and not (self.tied and n == "lm_head.weight"))
        if unread:
            raise ValueError(f"the checkpoint holds weights this model does not compute ({', '.join(unread[:4])}"
                             f"{', ...' if len(unread) > 4 else ''}): a variant of the architecture specjet does not "
                             "run, whose output it would get wrong")


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config, self.embed_tokens.weight.device)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The LM head is its own transposed copy even when tied to the embedding: the embedding
        # lookup wants [vocab, hidden] rows, the head's matmul wants [hidden, vocab].
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.quantization: str | None = None  # set by models/quantize.py
        # The layers as one C++ call (kernels/layer_stack.py), built by use_native_ops: the same kernels
        # as the native Python loop without the Python between them. None: the loop runs.
        self.layer_stack = None
        self._native_norm: tuple | None = None  # the final norm's C++ op arguments, set by use_native_ops
        # The head's int8 copy and error bound (a float32 head, or a bf16 one on VDPBF16PS), for rows only an argmax
        # reads (head_logits); set by use_native_ops. None: such rows compute the whole head.
        self.argmax_bound: ArgmaxBound | None = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> ModelOutput:
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        capture = batch.capture_hidden
        feature_layers = capture.layers if isinstance(capture, FeatureLayers) else ()
        every_row = capture == "last" or bool(feature_layers)  # the hidden state of every row is wanted
        layer_hidden = {} if isinstance(capture, tuple) else None
        # The layers whose outputs are kept (increasing): the EAGLE/DFlash feature layers, the captured ones.
        features = sorted(i for i in set(feature_layers) if 0 <= i < len(self.layers))
        captured = sorted(i for i in set(capture) if 0 <= i < len(self.layers)) if layer_hidden is not None else []
        wanted = sorted({*features, *captured})
        x, pending, outputs = run_layers_deferred(self.layers, self.layer_stack, x, cos, sin, batch, kv_cache, wanted)
        if layer_hidden is not None:
            layer_hidden.update((i, outputs[i]) for i in captured)
        residuals = [outputs[i] for i in features]
        norm = self._final_norm
        if batch.logits_indices is not None and not every_row:
            x = x[batch.logits_indices]  # only the rows that need logits go through the head
            pending = None if pending is None else pending[batch.logits_indices]
            hidden = norm(x, pending)
            logits_in = hidden
        else:
            hidden = norm(x, pending)
            logits_in = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
        if batch.defer_logits and not every_row and layer_hidden is None:
            return ModelOutput(logits=None, hidden=logits_in)  # the caller runs the head (head_logits)
        logits = self.head_logits(logits_in, batch.logits_mask if batch.logits_indices is None else None)
        if feature_layers:
            hidden = torch.cat([*residuals, hidden], dim=-1)
        return ModelOutput(logits=logits, hidden=hidden if every_row else None, layer_hidden=layer_hidden)

    @torch.inference_mode()
    def forward_lists(self, ids: list[int], positions: list[int], slot_cols: list[int], rows: list[int],
                      q_lens: list[int], kv_lens: list[int], table: torch.Tensor, kv_cache: KVCache,
                      custom_mask: torch.Tensor | None = None, capture_hidden: CaptureHidden = None,
                      logits_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
                      defer_logits: bool = False, last_logits: bool = False,
                      logit_rows: list[int] | None = None,
                      argmax_rows: torch.Tensor | None = None) -> ModelOutput | None:
        """A prefill, a decode step or a verify from host lists as one C++ call of the layer stack
        (``LayerStack.forward_lists``): request b (table row ``rows[b]``) brings ``q_lens[b]`` tokens, the last of
        its ``kv_lens[b]`` positions; token i is ``ids[i]`` at ``positions[i]``, its KV in slot
        ``table[row, slot_cols[i]]``. The output of ``forward`` on the batch ``host_token_tensors`` and
        ``ForwardBatch.from_host`` build from the same lists (logits of every row; ``last_logits``: of each
        request's last row, as ``build(..., logits="last")`` gives a prefill; ``logit_rows``: of those flat rows,
        in that order; ``argmax_rows``: see ``head_logits``), the same bits (tested), without
        their dozen small torch ops. None (nothing run) where the call does not apply: no layer stack, the
        attention or the embedding off the CPU kernels, per-layer captures (``capture_hidden`` a tuple)."""
        stack, native = self.layer_stack, self._native_norm
        weight = self.embed_tokens.weight
        if (stack is None or native is None or isinstance(capture_hidden, tuple) or not native_whole_batch()
                or type(self.embed_tokens) is not nn.Embedding or weight.device.type != "cpu"
                or table.device.type != "cpu"):
            return None
        feature_layers = capture_hidden.layers if isinstance(capture_hidden, FeatureLayers) else ()
        features = sorted(i for i in set(feature_layers) if 0 <= i < len(self.layers))
        cos, sin = self.rotary.table(weight.dtype, max(positions) + 1)
        mask = None if custom_mask is None else custom_mask.to(torch.bool).contiguous()
        hidden, residuals = stack.forward_lists(ids, positions, slot_cols, rows, q_lens, kv_lens, table, weight, cos,
                                                sin, kv_cache.k, kv_cache.v, mask, *native, cpu_ops.isa(), features)
        every_row = capture_hidden == "last" or bool(feature_layers)
        if defer_logits and not every_row:
            return ModelOutput(logits=None, hidden=hidden)
        if last_logits:  # the norm is per row: its rows picked after it are the rows it gives picked before
            ends = list(itertools.accumulate(q_lens))
            logits = self.head_logits(hidden[[end - 1 for end in ends]] if ends[-1] > len(ends) else hidden)
        elif logit_rows is not None:
            logits = self.head_logits(hidden[logit_rows])
        else:
            logits = self.head_logits(hidden, logits_mask, argmax_rows)
        if feature_layers:
            hidden = torch.cat([*residuals, hidden], dim=-1)
        return ModelOutput(logits=logits, hidden=hidden if every_row else None)

    @torch.inference_mode()
    def head_logits(self, x: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor] | None = None,
                    argmax_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head over normed rows x: float32 logits. ``mask`` (bitmask [N, W], masked [N]): rows whose
        grammar allows few tokens may get only those columns (-inf elsewhere; QuantizedLinear.masked, Bf16Linear.masked,
        Fp32Linear.masked). ``argmax_rows`` (bool [N]): rows only an argmax reads (greedy, no penalties, no
        logprobs); a head with an argmax bound then computes only the columns that can hold their argmax, with
        the bits the whole head gives them (kernels/argmax_bound.py), and -inf elsewhere."""
        bound = self.argmax_bound
        if argmax_rows is not None and bound is not None and bound.head is self.lm_head.packed and argmax_rows.any():
            mask = bound.narrow(x, argmax_rows, mask)
        logits = None
        masked_head = getattr(self.lm_head.packed, "masked", None)
        if mask is not None and masked_head is not None:
            logits = masked_head(x, *mask)  # the allowed columns of sparse rows alone
        return logits if logits is not None else self.lm_head(x).float()

    def _final_norm(self, x: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm of ``x + pending`` (``pending``: the last layer's MLP output, not yet added)."""
        if pending is not None:
            return self.norm.add_and_normalize(x, pending)[1]
        native = self._native_norm  # looked up once (use_native_ops): submodule lookups cost a decode step
        return cpu_ops.rms_norm(x.contiguous(), *native) if native is not None else self.norm(x)

    def use_native_ops(self, flag: bool = True) -> bool:
        """Inference through specjet's C++ CPU ops (kernels/cpu_ops.py: float32 attention, RMSNorm, RoPE with
        the K/V write, SiLU-and-multiply) where they apply: CPU, float32 or bfloat16, the extension
        built, no q/k norm. Every forward of the model then takes the same ops, so a token's bits do not
        depend on which kind of forward computed it. Also builds the layers' C++ stack
        (kernels/layer_stack.py), which holds the projections' operands: call this again after replacing
        one. Returns whether the ops are on."""
        on = set_native_ops(self.layers, self.config, self.embed_tokens.weight, flag)
        self._native_norm = (self.norm.weight, self.norm.eps) if on else None
        kept = self.argmax_bound is not None and self.argmax_bound.head is self.lm_head.packed
        self.argmax_bound = None if not on else self.argmax_bound if kept else ArgmaxBound.build(self.lm_head.packed)
        self.layer_stack = native_layer_stack(self.layers) if on else None
        return on

    def unchunk_projections(self) -> None:
        """Every float projection as one oneDNN call whatever its rows, the C++ attention and layer stack kept:
        for a model that only extracts features from long packs (train/), where no batch invariance is asked
        and one product of a pack's rows runs faster than the invariant plan's chunks of them. A row's bits
        then depend on its call's rows: never for a model that decodes, speculatively or not."""
        for module in self.modules():
            if isinstance(module, Linear) and isinstance(module.packed, Fp32Linear):  # oneDNN's one call (pack_onednn)
                module.packed = pack_onednn(module.weight_t.data, None if module.bias is None else module.bias.data)
            if isinstance(module, Linear) and isinstance(module.packed, PackedLinear):
                module.packed.max_rows = UNCHUNKED_ROWS
        if self.layer_stack is not None:
            self.use_native_ops()  # the stack holds the operands' plans

    def bf16x3_projections(self) -> bool:
        """The decoder layers' float32 projections as three bf16 tile products each (kernels/bf16_gemm.py's
        ``Bf16x3Linear``: each product within ~2^-16 of float32's, faster than oneDNN's float32 on packs) where
        the CPU has AMX tiles; returns whether they are. For a model that only extracts features (train/), as
        ``unchunk_projections``: neither float32's bits nor batch invariance is asked of it. The LM head keeps
        its operand (the label pass's float32 argmax reads it)."""
        modules = [m for layer in self.layers for m in layer.modules()
                   if isinstance(m, Linear) and isinstance(m.packed, (PackedLinear, Fp32Linear))
                   and Bf16x3Linear.applies(m.weight_t)]
        for m in modules:
            m.packed = Bf16x3Linear.build(m.weight_t.data, None if m.bias is None else m.bias.data)
        if modules and self.layer_stack is not None:
            self.use_native_ops()  # the stack holds the operands
        return bool(modules)

    def set_batch_invariant(self, flag: bool) -> None:
        """Batch-invariant attention on CPU (kernels/attention.py) or SDPA; oneDNN projections in their
        invariant row chunks or one call each (kernels/linear.py; the other kernels are invariant by
        construction)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.batch_invariant = flag
            elif isinstance(module, Linear) and isinstance(module.packed, PackedLinear):
                module.packed.invariant = flag

    def load_weights(self, state_dict: dict[str, torch.Tensor], pack: bool = True, projections: bool = True) -> None:
        """Copy Hugging Face-named weights into the fused parameters; fail loudly on a mismatch. The
        projections are packed anew (``pack``; False leaves them to the caller, as build_model does for weights
        it quantizes next): call ``use_native_ops`` afterwards (build_model does). ``projections`` False reads
        no projection's (nor the head's) weight: each is left a meta tensor, for blocks that replace it whole
        (the GGUF's own)."""
        self.layer_stack = None  # it holds the old packed operands
        sd = _CheckpointTensors({k.removeprefix("model."): v for k, v in state_dict.items()},
                                self.config.tie_word_embeddings)
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            if name.endswith("_proj.weight") or name == "lm_head.weight":
                name, tensor = name.removesuffix("weight") + "weight_t", tensor.t()
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)

        def put_projection(name: str, *parts: str) -> None:  # parts: [out, in] tensors, concatenated along out
            if not projections:
                linear = self.get_submodule(name.removesuffix(".weight"))
                linear.drop_float_weight()
                loaded.add(name + "_t")
                sd.read.update(parts)  # (replaced by blocks of the same weights)
                return
            put(name, sd[parts[0]] if len(parts) == 1 else torch.cat([sd[part] for part in parts]))

        put("embed_tokens.weight", sd["embed_tokens.weight"])
        put("norm.weight", sd["norm.weight"])
        put_projection("lm_head.weight", "embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight")
        for i in range(self.config.num_layers):
            p = f"layers.{i}."
            attn = p + "self_attn."
            put_projection(attn + "qkv_proj.weight", *(attn + f"{n}_proj.weight" for n in "qkv"))
            if self.config.attention_bias:
                put(attn + "qkv_proj.bias", torch.cat([sd[attn + f"{n}_proj.bias"] for n in "qkv"]))
            put_projection(attn + "o_proj.weight", attn + "o_proj.weight")
            if self.config.qk_norm:
                put(attn + "q_norm.weight", sd[attn + "q_norm.weight"])
                put(attn + "k_norm.weight", sd[attn + "k_norm.weight"])
            put_projection(p + "mlp.gate_up_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put_projection(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight")
            put(p + "input_layernorm.weight", sd[p + "input_layernorm.weight"])
            put(p + "post_attention_layernorm.weight", sd[p + "post_attention_layernorm.weight"])
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
        sd.check_all_read()
        for module in self.modules():
            if isinstance(module, Linear):
                module.packed = None  # the old operand, for other weights
                if pack:
                    module.pack_for_decode()
