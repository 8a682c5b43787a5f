"""The DFlash block drafter (z-lab DFlash; SGLang's DFLASH): a whole block of draft tokens in one forward.

Context. The target's residual stream after a few layers spread over its stack (``target_layers``)
and its final normed hidden state (what a ``FeatureLayers`` capture gives, [T, (K + 1) h]), at
every verified position, fused into one context vector per position:

    c_t = hidden_norm(fc([r^{l_1}_t ; ... ; r^{l_K}_t ; f_t]))       fc: (K + 1) h -> h, no bias

Block. The last verified token x_p at position p, then ``block_size - 1`` mask tokens at p+1 ..
p+B-1 (``mask_token_id`` names them in a block's id list; their embedding is the draft's own learned
``mask_embedding``, since the target's embedding of any id is frozen and means something else).
The output at block position i >= 1 is the draft of the token AT p + i (not after it).

KV injection. Every draft layer attends with Q from the block and K/V from [context ; block]: the
context's K/V are that layer's k/v projections of c_t (no input norm: c_t is normed already) at
position t, the block's those of its own normed hidden state. Attention inside the block is
non-causal, so every mask token sees the whole block and the whole visible context.

Root context (``shape.root_context``, specjet's addition). Block position 1 drafts x_{p+1} from
x_p and the target's state before it, the same question EAGLE's first step answers from one
fused input row; in plain DFlash the state reaches the block only through attention to the
context K/V, which a small draft trained for an hour on CPU learns slowly. With it, every block
row's input is its embedding plus ``root_proj(c_{p-1})`` (the context of the last verified
position, which every window shows), so the state is in each row from the first layer on.

Known prefix (``shape.known_prefix``, specjet's addition). Under a grammar the text right after the
root is often forced (a JSON key, punctuation): the drafter knows those tokens before it drafts.
A draft trained with some blocks' first positions filled with their true tokens (the rest masks,
scored on the masks only) reads them like the root, so its later positions draft the value after
the key instead of guessing past positions it cannot see.

Previous token (``shape.prev_token_input``, specjet's addition). Block row i >= 1 also gets
``prev_proj`` of the embedding of the token before it where that token is known (the root for row 1, a
known token after it), as EAGLE's input row holds its token. A 1-layer draft without it reads neither
the root's token nor known tokens through its attention (it learns to attend to the context only);
with it, both reach the rows after them (bench/RESULTS.md, session 31).

Position masks (``shape.position_masks``, specjet's addition). Every mask row of a published DFlash
block has the same input, and the rows tell which position they draft only through RoPE inside
attention; a 1-layer draft's MLP never sees it directly. With a mask embedding per block position
(``mask_embedding`` [S - 1, h]: position i's row reads vector i - 1) each row's own input says which
token after the root it drafts (bench/RESULTS.md, session 36). In a block longer than it was trained
for, the positions past its end read the last trained position's vector.

Because c_t depends on the target alone, each layer's context K/V at t is fixed once t is verified:
``write_context`` computes it once (after prefill, after each verify) into the draft's own paged KV
cache at the target's slot of t, and a drafting forward then only writes the block's K/V (scratch
slots) and attends over the paged context, like any extend under a custom mask. ``forward_train``
is the same computation on whole sequences with many blocks at once (block-isolated masks).

No embedding or LM head of its own: the target's (``bind_target``), or as EAGLE's a "hot" copy of
its columns for the K most frequent ids (``hot_token_ids``): the logits then have K columns and
``hot_to_full`` maps a column back to a target id. On the default model the head is most of a
block's cost (16 positions x 49152 ids), so a hot head makes drafting several times cheaper. A
checkpoint holds fc, the norms, the layers, the mask embedding and the hot ids.
"""
from __future__ import annotations

import pathlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specjet.kernels import cpu_ops
from specjet.kernels.layer_stack import stack_projection
from specjet.kernels.linear import pack_weight
from specjet.kernels.qgemm import QuantizedLinear
from specjet.models.config import ModelConfig
from specjet.models.eagle import (FOLLOW_TARGET, HotVocabDraft, SharedTarget, check_hot_token_ids, check_layer_ids,
                                  check_target_shape, check_trained_for, compute_with, draft_method, draft_named,
                                  fill_draft, hot_lm_head, pack_linears, read_draft_config, read_draft_tensors,
                                  write_draft)
from specjet.models.forward_batch import FeatureLayers, ForwardBatch
from specjet.models.kv_cache import KVCache
from specjet.models.llama import (Attention, DecoderLayer, Linear, LlamaForCausalLM, RMSNorm, Rotary, apply_rotary,
                                  native_layer_stack, run_layers_deferred, set_native_ops)

FORMAT = "specjet-dflash"
FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_DRAFT_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class DFlashShape:
    """What the draft is, beyond the target's shape it shares (saved in its config.json)."""

    num_layers: int  # draft decoder layers
    target_layers: tuple[int, ...]  # target layers whose residual stream the context reads
    block_size: int  # the block it was trained for (root + block_size - 1 drafts)
    mask_token_id: int  # the id that stands for a mask token in a block's id list
    # specjet's addition: every block row's input also gets root_proj(c_{p-1}), the context of the
    # last verified position (see the module's docstring). False: DFlash as published.
    root_context: bool = False
    # specjet's addition: trained with blocks whose first positions after the root hold known tokens
    # instead of mask tokens (``forward_train``'s ``block_ids``), so a drafter may put there what it
    # knows before drafting (a grammar's forced text) and the later positions draft after it.
    known_prefix: bool = False
    # specjet's addition: block row i >= 1 also gets prev_proj(embedding of token i - 1) where that token
    # is known (the root for row 1), as EAGLE's input row holds its token: without it a 1-layer draft
    # reads neither the root's token nor known tokens through its attention (bench/RESULTS.md, session 31).
    prev_token_input: bool = False
    # specjet's addition: a mask embedding per block position (1 .. block_size - 1) instead of one for all,
    # so a row's own input says which position it drafts (a 1-layer draft otherwise tells them apart
    # only through RoPE inside its one attention); past a longer block's trained end, the last one.
    position_masks: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.block_size < 2:
            raise ValueError(f"a DFlash draft needs >= 1 layer and block_size >= 2, got {self}")


def default_target_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` layer ids spread evenly from 1 to L - 3 (DFlash's choice: low to high, the last few
    left out, being close to the final hidden state the context reads anyway); fewer on a shallow
    target. Ids are those of ``FeatureLayers`` (< L - 1)."""
    last = num_target_layers - 2  # FeatureLayers takes ids below L - 1
    lo, hi = min(1, last), max(min(1, last), min(num_target_layers - 3, last))
    if count <= 1:
        return (lo,)
    ids = sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)})
    return tuple(ids)


def check_shape_for(shape: DFlashShape, config: ModelConfig, names: tuple[str, str] = ("target_layers",
                                                                                        "mask_token_id")) -> None:
    """A ValueError unless ``shape``'s target layers and mask token id fit a target of ``config``'s (``names``: how
    the message names the two)."""
    check_layer_ids(shape.target_layers, config.num_layers, names[0], empty=False)
    if not 0 <= shape.mask_token_id < config.vocab_size:
        raise ValueError(f"{names[1]} must lie in [0, {config.vocab_size}), got {shape.mask_token_id}")


class DFlashDraftModel(HotVocabDraft):
    def __init__(self, config: ModelConfig, shape: DFlashShape, hot_token_ids: torch.Tensor | None = None):
        super().__init__()
        self.config, self.shape = config, shape
        layers = shape.target_layers
        check_shape_for(shape, config)
        h = config.hidden_size
        self.fc = Linear((len(layers) + 1) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        # Layer i writes layer i of the draft's own KV cache.
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.empty(shape.block_size - 1, h) if shape.position_masks
                                           else torch.empty(h))
        self.root_proj = Linear(h, h, bias=False) if shape.root_context else None
        self.prev_proj = Linear(h, h, bias=False) if shape.prev_token_input else None
        self.register_buffer("hot_token_ids", check_hot_token_ids(hot_token_ids, config.vocab_size))
        self.rotary = Rotary(config)
        self.target: SharedTarget | None = None  # set by bind_target()
        self.context_kv: list = []  # per layer, write_context's k|v operand (_pack_context_kv)
        self.layer_stack = None  # the drafting forward's layers as one C++ call (_pack_context_kv)
        self._mask_rows_cache: dict[int, torch.Tensor] = {}  # native_block_logits' block rows (_mask_rows)
        self._block_projections: tuple | None = None  # native_block_logits' root_proj, prev_proj in C++ form
        self.reset_parameters()

    # ---------------------------------------------------------------- set-up
    def reset_parameters(self, std: float = 0.02) -> None:
        """N(0, std) weights and mask embedding, zero biases, unit norms."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("weight_t") or name == "mask_embedding":
                    p.normal_(0.0, std)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)

    def bind_target(self, target: LlamaForCausalLM, quantization: str | None = FOLLOW_TARGET) -> "DFlashDraftModel":
        """Share ``target``'s embedding and LM head; ``quantization`` as an EAGLE head's
        (``FOLLOW_TARGET``: a quantized target's draft computes like it; ``gguf``: 4-bit blocks)."""
        check_target_shape(self.config, target.config, "DFlash draft")
        method = draft_method(target, quantization)
        compute_with(self, method)
        self.target = SharedTarget(embed=target.embed_tokens, lm_head=hot_lm_head(target, self.hot_token_ids, method),
                                   full_lm_head=target.lm_head)
        self.rotary = Rotary(self.config, target.embed_tokens.weight.device)
        self._pack_context_kv()
        return self

    def pack_for_decode(self, quantization: str | None = None) -> None:
        """Pack the projections for inference (kernels/linear.py; ``pack_linears``: quantized with ``quantization``
        where given) and run the layers' drafting forward through the C++ CPU ops where they apply; never while
        training."""
        pack_linears(self, quantization)
        set_native_ops(self.layers, self.config, self.mask_embedding)
        self._pack_context_kv()

    def _pack_context_kv(self) -> None:
        """Each layer's k|v columns of its fused projection as an inference operand of their own
        (packed, or the quantized rows of a quantized projection), for ``write_context``: a plain
        matmul against the column slice re-blocks the bf16 weight on every call. None where the
        layer is not packed (training), or not on the C++ ops' path. Also builds the layers' C++
        stack for the drafting forward (models/llama.py ``native_layer_stack``), which holds the
        same operands."""
        self.layer_stack = native_layer_stack(list(self.layers))
        self._mask_rows_cache = {}
        self._block_projections = None
        if self.layer_stack is not None:
            ops = tuple(None if p is None else stack_projection(p.packed) for p in (self.root_proj, self.prev_proj))
            if all((op is None) == (p is None) for op, p in zip(ops, (self.root_proj, self.prev_proj))):
                self._block_projections = ops
        self.context_kv = []
        for layer in self.layers:
            attn, packed = layer.self_attn, layer.self_attn.qkv_proj.packed
            operand = None
            if layer.native_ops and isinstance(packed, QuantizedLinear):
                operand = packed.select_outputs(torch.arange(attn.q_size, attn.q_size + 2 * attn.kv_size))
            elif layer.native_ops and packed is not None:
                bias = attn.qkv_proj.bias
                operand = pack_weight(attn.qkv_proj.weight_t.detach()[:, attn.q_size:].contiguous(),
                                      None if bias is None else bias.detach()[attn.q_size:].contiguous())
            self.context_kv.append(operand)

    @property
    def feature_capture(self) -> FeatureLayers:
        """What the target's prefill and verify forwards capture for this draft."""
        return FeatureLayers(self.shape.target_layers)

    @property
    def feature_width(self) -> int:
        return (len(self.shape.target_layers) + 1) * self.config.hidden_size

    # ---------------------------------------------------------------- pieces shared by both paths
    def context(self, features: torch.Tensor, native: bool = False) -> torch.Tensor:
        """Target features [..., (K + 1) h] -> context vectors c [..., h] (``native``: the packed fc and
        the C++ RMSNorm, inference only)."""
        if features.shape[-1] != self.feature_width:
            raise ValueError(f"target features have width {features.shape[-1]}, this draft reads {self.feature_width}")
        flat = features.reshape(-1, features.shape[-1])
        return self.hidden_norm.normalize(self.fc.project(flat), native).reshape(*features.shape[:-1], -1)

    def embed_block(self, ids: torch.Tensor) -> torch.Tensor:
        """Block ids [...] -> embeddings [..., h]: the target's embedding, the mask embedding at mask ids."""
        x = F.embedding(ids, self._shared().embed.weight).to(self.mask_embedding.dtype)
        is_mask = (ids == self.shape.mask_token_id)[..., None]
        return torch.where(is_mask, self._mask_vectors(ids.shape[-1]).to(x.dtype), x)

    def _mask_vectors(self, size: int) -> torch.Tensor:
        """[size, h] (or [h], broadcast): the mask embedding of block positions 0 .. size - 1 (position 0,
        the root, is never a mask; its row is a placeholder). A block longer than the draft was trained
        for repeats the last trained position's vector past its end."""
        if not self.shape.position_masks:
            return self.mask_embedding
        trained = self.mask_embedding.shape[0]
        rows = torch.arange(size, device=self.mask_embedding.device).sub(1).clamp(0, trained - 1)
        return self.mask_embedding[rows]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] (already normed) -> [..., K or vocab] float32 through the (hot) LM head."""
        logits = self._shared().lm_head.project(hidden.reshape(-1, hidden.shape[-1])).float()
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def head_weight_t(self) -> torch.Tensor:
        """[h, K or vocab]: the weight of the head ``logits`` applies (frozen: the target's, or its hot columns)."""
        return self._shared().lm_head.weight_t

    def target_head(self) -> Linear:
        """The target's own full-vocabulary LM head (the draft's may be a hot-vocabulary one)."""
        return self._shared().full_lm_head or self._shared().lm_head

    @staticmethod
    def _kv(attn: Attention, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's rotated K and V of rows ``x`` [T, h] -> [T, kv_heads, D] each. Only the k|v
        columns of the fused projection: context rows never query, so q would be wasted work."""
        w = attn.qkv_proj.weight_t[:, attn.q_size:]
        b = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[attn.q_size:]
        kv = x @ w if b is None else torch.addmm(b, x, w)
        k, v = kv.split(attn.kv_size, dim=-1)
        k = k.reshape(-1, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(-1, attn.num_kv_heads, attn.head_dim)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        return apply_rotary(k, cos, sin), v

    # ---------------------------------------------------------------- inference (paged KV)
    @torch.inference_mode()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      kv_cache: KVCache) -> torch.Tensor:
        """Materialise verified positions as context: every layer's K/V of c_t at slot ``slots[i]``
        for position ``positions[i]`` (``features[i]``: the target's features there). Returns the
        context vectors c [N, h] (a drafter with a root context keeps each request's last one)."""
        operands = self.context_kv or [None] * len(self.layers)
        native = operands[0] is not None
        ctx = self.context(features.to(self.mask_embedding.dtype), native=native and features.shape[0] > 0)
        if features.shape[0] == 0:
            return ctx
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        for i, (layer, operand) in enumerate(zip(self.layers, operands)):
            if operand is not None:  # k|v, RoPE on k and the write in two calls (no query heads)
                cpu_ops.rope_store(operand(ctx).contiguous(), cos, sin, kv_cache.k[i], kv_cache.v[i],
                                   slots.contiguous(), 0)
            else:
                k, v = self._kv(layer.self_attn, ctx, cos, sin)
                kv_cache.write(i, slots, k, v)
        return ctx

    def block_input(self, ids: torch.Tensor, root_ctx: torch.Tensor | None) -> torch.Tensor:
        """Block ids [B, S] (and, with a root context, c_{p-1} [B, h] per block) -> inputs [B*S, h]."""
        x = self.embed_block(ids)
        if self.root_proj is not None:
            if root_ctx is None:
                raise ValueError("this DFlash draft reads the last verified position's context: pass root_ctx")
            x = x + self.root_proj.project(root_ctx.to(x.dtype))[:, None, :]
        x = self._add_previous_tokens(x, ids)
        return x.reshape(-1, x.shape[-1])

    def root_block_ids(self, roots: torch.Tensor, size: int) -> torch.Tensor:
        """Block ids [..., size] of roots [...]: each root, then mask ids."""
        ids = torch.full((*roots.shape, size), self.shape.mask_token_id, dtype=torch.int64, device=roots.device)
        ids[..., 0] = roots
        return ids

    def _known_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, S] bool: the block rows holding a token (the root, known tokens), not a mask."""
        known = ids != self.shape.mask_token_id
        known[:, 0] = True  # the root, whatever its id
        return known

    def _add_previous_tokens(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows [B, S, h] plus, with ``prev_token_input``, prev_proj(embedding of token i - 1) at each row
        i >= 1 whose previous token is known (not a mask id); the rest plus zero."""
        if self.prev_proj is None:
            return x
        prev = ids[:, :-1]
        # Every row projected, masks included (then zeroed): a row's bits do not depend on which others
        # hold known tokens.
        embedded = F.embedding(prev, self._shared().embed.weight).to(x.dtype)
        add = self.prev_proj.project(embedded.reshape(-1, embedded.shape[-1])).to(x.dtype).view_as(embedded)
        add = torch.where(self._known_rows(ids)[:, :-1, None], add, torch.zeros_like(add))
        return torch.cat([x[:, :1], x[:, 1:] + add], dim=1)

    def _mask_rows(self, size: int) -> torch.Tensor:
        """[1, size, h]: zeros at the root's row, the mask embedding at the others (made once a size)."""
        if size not in self._mask_rows_cache:
            with torch.inference_mode(False):  # a plain tensor, whatever mode the first call runs in
                rows = self._mask_vectors(size).detach().expand(size, -1).clone()
                rows[0] = 0
            self._mask_rows_cache[size] = rows[None]
        return self._mask_rows_cache[size]

    @torch.inference_mode()
    def native_block_logits(self, roots: list[int], root_ctx: torch.Tensor | None, committed: list[int],
                            rows: list[int], size: int, table: torch.Tensor, kv_cache: KVCache, mask: torch.Tensor,
                            known: list[list[int]] | None = None) -> torch.Tensor | None:
        """``forward`` over B blocks [root, known tokens, mask, ...] of ``size`` rows, each in its request's own
        slots, as two C++ calls: the block's input rows (csrc/dflash_block.cpp: ``block_input``'s values from
        the host's token lists) and the layer stack from host lists (``LayerStack.forward_rows``: the attention's
        metadata, RoPE rows and slots built in C++, the final norm of positions 1..). Block b is request row
        ``rows[b]`` of ``table`` at positions ``committed[b]`` .. + size - 1 (their table columns), seeing every
        committed position and its whole block (``mask`` [B, size, size], all True); ``known[b]``: the tokens
        known to follow its root (None: masks only). The same kernels and bits as ``forward`` (tested), without
        its dozen small torch ops. Logits of block positions 1.. [B, S - 1, K or vocab]; None where the layers
        or the input projections do not run in C++."""
        ext = cpu_ops.extension()
        embed = self._shared().embed.weight
        if (self.layer_stack is None or self._block_projections is None or not self.layers[0].self_attn.batch_invariant
                or ext is None or embed.device.type != "cpu" or embed.dtype not in (torch.float32, torch.bfloat16)):
            return None
        root_op, prev_op = self._block_projections
        dtype = self.mask_embedding.dtype
        x = ext.dflash_block_input(roots, known or [], size, embed, self._mask_rows(size)[0], root_op,
                                   None if root_op is None else root_ctx.to(dtype).contiguous(), prev_op)
        positions = [c + j for c in committed for j in range(size)]  # in place: a position is its table column
        cos, sin = self.rotary.table(dtype, max(committed) + size)
        normed = self.layer_stack.forward_rows(x, positions, positions, rows, [size] * len(rows),
                                               [c + size for c in committed], table, cos, sin, kv_cache.k, kv_cache.v,
                                               mask, self.norm.weight, self.norm.eps, cpu_ops.isa(), 1)
        return self.logits(normed).view(len(rows), size - 1, -1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache, root_ctx: torch.Tensor | None = None) -> torch.Tensor:
        """One drafting forward over blocks: ``batch.input_ids`` are the blocks' ids (B blocks of
        ``block_size`` each, flat), their K/V go to ``batch.out_cache_loc``; each request's table
        row lists its visible context slots, then its block's slots; the batch's custom mask lets
        the block see all of itself; ``root_ctx`` [B, h]: each block's c_{p-1} (root-context drafts).
        Returns float32 logits [N, K or vocab] for the rows ``batch.logits_indices`` (all when None)."""
        blocks = 1 if root_ctx is None else root_ctx.shape[0]
        x = self.block_input(batch.input_ids.view(blocks, -1), root_ctx)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        # As the target's forward: the layers as one C++ call where they run native (else forward, not
        # __call__: nn.Module's call machinery shows on a few small ops), and the C++ norm.
        x, pending, _ = run_layers_deferred(self.layers, self.layer_stack, x, cos, sin, batch, kv_cache)
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
            pending = None if pending is None else pending[batch.logits_indices]
        if pending is not None:  # the last layer's add inside the norm (one kernel on CUDA)
            return self.logits(self.norm.add_and_normalize(x, pending)[1])
        return self.logits(self.norm.normalize(x, self.layers[0].native_ops))

    # ---------------------------------------------------------------- training (whole sequences)
    def forward_train(self, ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
                      window: int | None = None, block_ids: torch.Tensor | None = None,
                      scored: torch.Tensor | None = None, head: bool = True) -> torch.Tensor:
        """Many blocks per sequence in one forward, each isolated from the others.

        ids [B, L], features [B, L, (K + 1) h], anchors [B, A] (the root's position of each block;
        -1: no block). Block (b, j) is [ids[b, a], mask, ...] at positions a .. a + S - 1 (or
        ``block_ids[b, j]``, [B, A, S]: known tokens in some positions) and sees the context at
        positions a - window .. a - 1 (all of 0 .. a - 1 without a window) and its own block,
        exactly what a drafting forward with the root at a sees. Returns the logits of block
        positions 1 .. S - 1: [B, A, S - 1, K or vocab] float32 (the drafts of ids[b, a + 1 ..]);
        with ``scored`` ([B, A, S - 1] bool) only those positions' logits, in row-major order (the last
        layer past its attention, the head and the loss over unscored rows would be work for nothing),
        followed by padding rows (the first block row's again) up to a multiple of ``TRAIN_ROW_BUCKET``:
        [n scored + padding, K or vocab]. The caller scores the padding with weight zero rather than slicing
        it off, whose backward would write a zero gradient the size of the logits and copy the rest into it
        every step. ``head=False`` (with ``scored``): those rows'
        final normed hidden states instead of their logits, [n scored + padding, h], for a loss that applies
        the head itself (train/head_loss.py)."""
        batch, seq_len, _ = features.shape
        size = self.shape.block_size
        num = anchors.shape[1]
        device = features.device
        real = anchors >= 0
        roots = anchors.clamp(min=0)
        offsets = torch.arange(size, device=device)
        block_pos = (roots[:, :, None] + offsets).reshape(batch, num * size)  # [B, A*S]
        if block_ids is None:
            block_ids = self.root_block_ids(ids.gather(1, roots), size)
        ctx_rows = batch * seq_len
        # Context rows padded to a bucket (see _pad_rows); the padding's rows are dropped after each projection.
        # bf16 features under bf16 autocast stay bf16 (the projection's matmul would cast them to it).
        autocast_bf16 = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16
        feature_dtype = features.dtype if autocast_bf16 and features.dtype == torch.bfloat16 else self.mask_embedding.dtype
        ctx_flat = self.context(_pad_rows(features.to(feature_dtype).reshape(ctx_rows, -1)))  # [R, h]
        ctx = ctx_flat[:ctx_rows].view(batch, seq_len, -1)
        root_ctx = None
        if self.root_proj is not None:  # c_{a-1} of each block (zero before the first position)
            before = ctx.gather(1, (roots - 1).clamp(min=0)[:, :, None].expand(-1, -1, ctx.shape[-1]))
            root_ctx = torch.where((roots > 0)[:, :, None], before, torch.zeros_like(before)).reshape(batch * num, -1)
        x = self.block_input(block_ids.reshape(batch * num, size), root_ctx)
        ctx_pos = torch.arange(seq_len, device=device).repeat(batch)
        ctx_pos = torch.cat([ctx_pos, ctx_pos.new_zeros(ctx_flat.shape[0] - ctx_rows)])
        ctx_cos, ctx_sin = self.rotary.cos_sin(ctx_pos, x.dtype)
        cos, sin = self.rotary.cos_sin(block_pos.reshape(-1), x.dtype)
        mask = self._train_mask(roots, real, seq_len, window)  # [B, A*S, L + A*S]
        # Anchors in groups, each with the context length its blocks can see (up to its last root).
        groups = [(a, min(a + TRAIN_ATTENTION_GROUP, num), int(roots[:, a:a + TRAIN_ATTENTION_GROUP].max()))
                  for a in range(0, num, TRAIN_ATTENTION_GROUP)]
        # Past its attention, the last layer's rows only matter where a position is scored (not a root, a known
        # token or a short sequence's tail: about a third of the rows); those rows alone go on to its output
        # projection, its MLP, the norm and the head. Every row's keys and values are still made: the scored
        # rows attend to them. The kept rows are padded to a multiple of TRAIN_ROW_BUCKET with copies of the
        # first block row (see _pad_rows: oneDNN builds a kernel for every new row count).
        keep = None
        if scored is not None:
            keep = torch.cat([scored.new_zeros(batch, num, 1), scored], dim=2).reshape(-1).nonzero().squeeze(1)
            keep = torch.cat([keep, keep.new_zeros(-keep.shape[0] % TRAIN_ROW_BUCKET)])
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = (h @ attn.qkv_proj.weight_t[:, :attn.q_size])
            if attn.qkv_proj.bias is not None:
                q = q + attn.qkv_proj.bias[:attn.q_size]
            q = q.reshape(-1, attn.num_heads, attn.head_dim)
            if attn.q_norm is not None:
                q = attn.q_norm(q)
            q = apply_rotary(q, cos, sin)
            k_blk, v_blk = self._kv(attn, h, cos, sin)
            k_ctx, v_ctx = (t[:ctx_rows] for t in self._kv(attn, ctx_flat, ctx_cos, ctx_sin))

            def heads_first(t: torch.Tensor, rows: int) -> torch.Tensor:  # [B*rows, H, D] -> [B, H, rows, D]
                return t.reshape(batch, rows, t.shape[1], t.shape[2]).transpose(1, 2)

            out = _grouped_block_attention(
                heads_first(q, num * size), heads_first(k_ctx, seq_len), heads_first(v_ctx, seq_len),
                heads_first(k_blk, num * size), heads_first(v_blk, num * size), mask, groups, size, attn.scale)
            out = out.transpose(1, 2).reshape(-1, attn.q_size)
            if keep is not None and index == len(self.layers) - 1:
                x, out = x[keep], out[keep]
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if keep is not None:
            hidden = self.norm(x)
            return self.logits(hidden) if head else hidden
        return self.logits(self.norm(x.reshape(batch, num, size, -1)[:, :, 1:]))

    def _train_mask(self, roots: torch.Tensor, real: torch.Tensor, seq_len: int, window: int | None) -> torch.Tensor:
        """[B, A*S, L + A*S] bool: a block's rows see its visible context and its own block. A padded
        block (no anchor) sees only itself, so its softmax stays finite; its outputs are not scored."""
        batch, num = roots.shape
        size = self.shape.block_size
        t = torch.arange(seq_len, device=roots.device)
        sees_ctx = t[None, None, :] < roots[:, :, None]  # [B, A, L]
        if window is not None:
            sees_ctx &= t[None, None, :] >= roots[:, :, None] - window
        sees_ctx &= real[:, :, None]
        blocks = torch.arange(num, device=roots.device)
        own = (blocks[:, None] == blocks[None, :])[None].expand(batch, num, num)  # [B, A, A]
        ctx_part = sees_ctx[:, :, None, :].expand(batch, num, size, seq_len)
        blk_part = own[:, :, None, :, None].expand(batch, num, size, num, size).reshape(batch, num, size, num * size)
        return torch.cat([ctx_part, blk_part], dim=-1).reshape(batch, num * size, seq_len + num * size)


TRAIN_ROW_BUCKET = 128
TRAIN_ATTENTION_GROUP = 8  # anchors whose blocks share one attention call in forward_train


def _grouped_block_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask, groups, size: int, scale: float) -> torch.Tensor:
    """The blocks' attention over [context ; blocks] under ``mask`` ([B, A*S, L + A*S]), one call per group
    of anchors ``(first, end, context seen)``: a group's rows see context only before its last root and
    of the A*S block keys only their own block's S, so each call leaves out keys the mask would hide
    anyway (with sorted anchors, most of them). q [B, H, A*S, D], k/v_ctx [B, KV, L, D], k/v_blk
    [B, KV, A*S, D]; returns [B, H, A*S, D]."""
    seq_len = k_ctx.shape[2]
    out = []
    for first, end, seen in groups:
        r0, r1 = first * size, end * size
        keys = torch.cat([k_ctx[:, :, :seen], k_blk[:, :, r0:r1]], dim=2)
        values = torch.cat([v_ctx[:, :, :seen], v_blk[:, :, r0:r1]], dim=2)
        visible = torch.cat([mask[:, r0:r1, :seen], mask[:, r0:r1, seq_len + r0:seq_len + r1]], dim=-1)
        out.append(_masked_attention(q[:, :, r0:r1], keys, values, visible, scale))
    return torch.cat(out, dim=2)


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """softmax(q k^T * scale over the ``visible`` keys) v, written out: q [B, H, R, D], keys / values [B, KV, S, D]
    (a key head serves H / KV query heads, as SDPA's ``enable_gqa``), visible [B, R, S] bool; returns [B, H, R, D].

    The query heads sharing a key head go through one product of [H / KV * R] rows; scores and softmax are
    float32 (from the inputs' values, whatever autocast would make of them), the weights meet the values in
    their dtype. On the CPU this runs forward and backward in a fraction of SDPA's time at these shapes: SDPA's
    flash kernel with a mask and grouped heads is slow to differentiate there (bench/RESULTS.md, session 65)."""
    batch, heads, rows, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    with torch.autocast(q.device.type, enabled=False):
        grouped = q.reshape(batch, kv_heads, group * rows, dim).float() * scale
        scores = (grouped @ keys.float().transpose(-1, -2)).view(batch, kv_heads, group, rows, -1)
        bias = torch.zeros(visible.shape, dtype=scores.dtype, device=scores.device).masked_fill_(~visible, float("-inf"))
        probs = torch.softmax(scores + bias[:, None, None], dim=-1).to(values.dtype)
        out = probs.view(batch, kv_heads, group * rows, -1) @ values
    return out.view(batch, heads, rows, dim)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [R, ...] with zero rows appended up to a multiple of ``TRAIN_ROW_BUCKET``. A training batch's row
    counts (context tokens, scored block positions) change every step, and oneDNN builds a kernel
    for every new matmul shape, which on AMX costs more than the product itself; padded, a run sees
    a few shapes (bench/RESULTS.md, session 42). The padding rows' outputs are dropped, so they add
    nothing to any gradient."""
    pad = -x.shape[0] % TRAIN_ROW_BUCKET
    return x if pad == 0 else torch.cat([x, x.new_zeros(pad, *x.shape[1:])])


# ---------------------------------------------------------------- checkpoints
def default_dflash_path() -> pathlib.Path:
    """The draft trained for the default model, shipped inside the package (once trained)."""
    return pathlib.Path(__file__).resolve().parents[1] / "assets" / "dflash" / DEFAULT_DRAFT_NAME


def save_dflash(model: DFlashDraftModel, directory, target_gguf: str | None = None, training: dict | None = None,
                dtype: torch.dtype = torch.float16) -> pathlib.Path:
    """Write ``model.safetensors`` (the draft's own tensors only) and ``config.json`` (format, its
    shape, the target's identity, the training summary)."""
    shape = asdict(model.shape)
    shape["target_layers"] = list(model.shape.target_layers)
    return write_draft(model, directory, FORMAT, FORMAT_VERSION, dtype, target_gguf, training, {
        "architecture": "DFlashDraftModel",
        "context": "residual stream after target_layers, then the final normed hidden state (FeatureLayers capture)",
        **shape,
    })


def read_dflash_config(directory) -> dict:
    return read_draft_config(directory, FORMAT, FORMAT_VERSION, "DFlash draft")


def load_dflash(directory, target_config: ModelConfig, dtype=torch.float32, device="cpu",
                quantization: str | None = None) -> DFlashDraftModel:
    """Load a draft saved by ``save_dflash``, its projections packed for inference (quantized with
    ``quantization``, a method ``draft_method`` resolved); fails loudly if it was trained for another target
    shape. Call ``bind_target`` on the result before running it."""
    directory = pathlib.Path(directory)
    config = read_dflash_config(directory)
    check_trained_for(config, target_config, directory, "DFlash draft")
    what = f"DFlash draft {directory}"
    for name in ("num_layers", "block_size", "mask_token_id"):
        if type(config.get(name)) is not int:
            raise ValueError(f"{what}: {name} must be an integer, got {config.get(name)!r}")
    layers = config.get("target_layers")
    if not isinstance(layers, list) or not all(type(i) is int for i in layers):
        raise ValueError(f"{what}: target_layers must be a list of layer ids, got {layers!r}")
    flags = {name: config.get(name, False) for name in ("root_context", "known_prefix", "prev_token_input",
                                                         "position_masks")}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{what}: {name} must be true or false, got {value!r}")
    with draft_named(directory, "DFlash draft"):
        shape = DFlashShape(num_layers=config["num_layers"], target_layers=tuple(layers),
                            block_size=config["block_size"], mask_token_id=config["mask_token_id"], **flags)
        check_shape_for(shape, target_config)
    tensors = read_draft_tensors(directory, "DFlash draft")
    # What the weights hold, checked before the model is built: a config's layer count or block size is a size
    # to allocate (a million layers, a position mask per row of a block of 10**9), which no file of this draft's
    # tensors could fill.
    held = {int(name.split(".")[1]) for name in tensors if name.startswith("layers.") and name.split(".")[1].isdigit()}
    if held != set(range(shape.num_layers)):
        raise ValueError(f"{what}: config.json says num_layers={shape.num_layers}, {WEIGHTS_NAME} holds "
                         f"{len(held)} layer(s)")
    mask = tensors.get("mask_embedding")
    want = (shape.block_size - 1, target_config.hidden_size) if shape.position_masks else (target_config.hidden_size,)
    if mask is None or tuple(mask.shape) != want:
        held_shape = "is missing" if mask is None else f"has shape {list(mask.shape)}"
        raise ValueError(f"{what}: mask_embedding {held_shape}, its config (block_size="
                         f"{shape.block_size}, position_masks={str(shape.position_masks).lower()}) needs {list(want)}")
    with draft_named(directory, "DFlash draft"):
        model = DFlashDraftModel(target_config, shape, hot_token_ids=tensors.get("hot_token_ids"))
    return fill_draft(model, tensors, dtype, device, directory, "DFlash draft", quantization)
