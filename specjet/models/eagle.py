"""The EAGLE draft head (EAGLE-1 shape; drafted in EAGLE-2 trees by spec_v2).

The target's final normed hidden state at position t (``ModelOutput.hidden`` with
``capture_hidden="last"``: what its LM head sees) is the *feature* f_t. The head reads the pair
(token x_{t+1}, feature f_t) at position t and regresses the next feature f_{t+1}:

    x   = fc([embed(x_{t+1}) ; f_t])            fc: 2h -> h, with bias
    h_t = DecoderLayer(x)                        one Llama block of the target's shape
    logits = lm_head(h_t)                        the target's head (or its "hot token" rows)

No final norm: h_t stands in for f_{t+1}, which is already normed.

EAGLE-3 features (``feature_layers``, e.g. (1, 14)): the target gives the residual stream after
those layers besides its final normed hidden state (``FeatureLayers`` capture, [T, (n + 1) h]), and
the head fuses them first, f_t = fuse([norm_1(r1_t) ; ... ; f_t^last]) (fuse: (n + 1) h -> h, no bias;
one learned RMSNorm per residual, whose scales grow ~10x through the stack). Low and middle layers
still carry what the last layer has already specialised away for predicting the next token only,
which is what the head needs to predict the token after it. ``fuse`` starts as the identity on
f^last, i.e. as the EAGLE-1 head. Only the target's features are fused (``embed_features``): from
the second draft step on, the head reads its own h_t as before. Drafting k tokens feeds h_t back
as the feature of the next step. The embedding and the LM head are the target's (``bind_target``);
the draft's checkpoint holds only fc, the layer and the hot token ids.

A reduced "hot token" head keeps the K most frequent target ids (``hot_token_ids``, sorted): the
logits have K columns, and ``hot_to_full`` maps a column index back to the target's token id.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specjet.kernels.qgemm import QuantizedLinear
from specjet.models.config import ModelConfig
from specjet.models.forward_batch import CaptureHidden, FeatureLayers, ForwardBatch
from specjet.models.kv_cache import KVCache
from specjet.models.llama import (DecoderLayer, Linear, LlamaForCausalLM, RMSNorm, Rotary, apply_rotary,
                                  native_layer_stack, run_layers, set_native_ops)
from specjet.models.quantize import quantize_linears, quantize_weight
from specjet.models.weights import sync_files

FORMAT = "specjet-eagle"
FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_HEAD_NAME = "smollm2-135m-instruct"
# The shape fields a head must share with the target it drafts for.
TARGET_SHAPE_FIELDS = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")


@dataclass
class SharedTarget:
    """References into the target model; the draft never owns (or saves) these."""

    embed: nn.Embedding  # the target's token embedding, [vocab, hidden]
    lm_head: Linear  # the target's head, or a [hidden, K] copy of its hot token columns
    full_lm_head: Linear | None = None  # the target's own head, where a trainer needs its full-vocabulary choice


def check_hot_token_ids(hot_token_ids, vocab_size: int) -> torch.Tensor | None:
    """A hot vocabulary as a [K] int64 tensor (None: the full vocabulary); refuses one that is not
    strictly increasing target ids."""
    if hot_token_ids is None:
        return None
    hot_token_ids = torch.as_tensor(hot_token_ids, dtype=torch.int64)
    if hot_token_ids.dim() != 1 or not bool((hot_token_ids[1:] > hot_token_ids[:-1]).all()):
        raise ValueError("hot_token_ids must be a 1-D, strictly increasing list of target token ids")
    if hot_token_ids.numel() == 0:  # a draft that could propose no token
        raise ValueError("hot_token_ids must hold at least one target token id, got none")
    if int(hot_token_ids.min()) < 0 or int(hot_token_ids.max()) >= vocab_size:
        raise ValueError(f"hot_token_ids must lie in [0, {vocab_size})")
    return hot_token_ids


# ``bind_target``'s default quantization: the draft computes as its target does (quantized like a
# quantized target, float beside a float one).
FOLLOW_TARGET = "target"


def draft_method(target: LlamaForCausalLM, quantization: str | None) -> str | None:
    """The method a draft bound to ``target`` quantizes its weights with (None: float)."""
    return getattr(target, "quantization", None) if quantization == FOLLOW_TARGET else quantization


def pack_linears(model: nn.Module, quantization: str | None = None) -> None:
    """A loaded draft's projections made ready for inference: quantized with ``quantization`` where their widths
    allow and packed as float otherwise (every one, for None). A projection about to be quantized is never packed
    as float first (its row plan is checked by running it: a large part of an engine's start). The method is kept
    as ``model.packed_quantization``, so that ``bind_target`` does not quantize the same weights again."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for module in linears:
        module.packed = None
    if quantization is not None:
        quantize_linears(model, quantization)
    for module in linears:
        if module.packed is None:
            module.pack_for_decode()
    model.packed_quantization = quantization


def compute_with(model: nn.Module, method: str | None) -> None:
    """``bind_target``'s part for a draft's own projections: they compute with ``method`` (None: float). A draft
    loaded for inference (``pack_linears`` recorded its method) is packed again only for another method, float
    included; a draft that never was packed (a trainer's) is quantized where a method is asked."""
    if hasattr(model, "packed_quantization"):
        if model.packed_quantization != method:
            pack_linears(model, method)
    elif method is not None:
        quantize_linears(model, method)


def hot_lm_head(target: LlamaForCausalLM, hot_token_ids: torch.Tensor | None, method: str | None = None) -> Linear:
    """The target's LM head, or a [hidden, K] copy of its hot columns: packed like the target's, or,
    beside a float target's head, quantized with the draft's ``method`` (never while training)."""
    head = target.lm_head
    if hot_token_ids is None:
        return head
    weight_t = head.weight_t.detach()[:, hot_token_ids.to(head.weight_t.device)].contiguous()
    hot = Linear(weight_t.shape[0], weight_t.shape[1], bias=False)
    hot.weight_t = nn.Parameter(weight_t, requires_grad=False)
    if isinstance(head.packed, QuantizedLinear):  # the target head's own blocks, hot rows
        hot.packed = head.packed.select_outputs(hot_token_ids)
    elif head.packed is not None and method is not None and (weight := quantize_weight(weight_t, method, is_head=True)):
        hot.packed = QuantizedLinear.build(weight, None)  # a head in the method's head format (int4: Q8_0)
    elif head.packed is not None:  # packed like the target's head (never while training)
        hot.pack_for_decode()
    return hot


def check_layer_ids(layers, num_layers: int, name: str, empty: bool = True) -> None:
    """A draft's target layer list (``name`` for the message): increasing ids of ``FeatureLayers`` (< L - 1); none
    at all where ``empty``."""
    layers = list(layers)
    if (not layers and not empty) or any(b <= a for a, b in zip(layers, layers[1:])) or any(
            not 0 <= i < num_layers - 1 for i in layers):
        raise ValueError(f"{name} must be increasing layer ids in [0, {num_layers - 1}), got {layers}")


class HotVocabDraft(nn.Module):
    """What EAGLE's head and DFlash's draft share: a (hot) vocabulary of the target's ids and the target
    references ``bind_target`` sets. Subclasses set ``config``, the ``hot_token_ids`` buffer and ``target``."""

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.hot_token_ids is None else int(self.hot_token_ids.shape[0])

    def hot_to_full(self, ids: torch.Tensor) -> torch.Tensor:
        """Column indices of ``logits`` -> target token ids (the identity without a hot head)."""
        return ids if self.hot_token_ids is None else self.hot_token_ids[ids]

    def _shared(self) -> SharedTarget:
        if self.target is None:
            raise RuntimeError(f"call bind_target(target) before running the {type(self).__name__}")
        return self.target


class EagleDraftModel(HotVocabDraft):
    def __init__(self, config: ModelConfig, hot_token_ids: torch.Tensor | None = None,
                 feature_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.feature_layers = tuple(int(i) for i in feature_layers)
        check_layer_ids(self.feature_layers, config.num_layers, "feature_layers")
        if self.feature_layers:
            self.feature_norms = nn.ModuleList(RMSNorm(h, config.rms_norm_eps) for _ in self.feature_layers)
            self.fuse = Linear(self.feature_width, h, bias=False)
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(config, layer_id=0)  # layer 0 of its own 1-layer KV cache
        self.register_buffer("hot_token_ids", check_hot_token_ids(hot_token_ids, config.vocab_size))
        self.rotary = Rotary(config)
        self.target: SharedTarget | None = None  # set by bind_target()
        self.layer_stack = None  # the layer as one C++ call, for inference (pack_for_decode, bind_target)
        self.reset_parameters()

    # ---------------------------------------------------------------- set-up
    def reset_parameters(self, std: float = 0.02) -> None:
        """Hugging Face's Llama initialisation: N(0, std) weights, zero biases, unit norms."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("weight_t"):
                    p.normal_(0.0, std)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
        if self.feature_layers:  # start as the EAGLE-1 head: the fused feature is f^last
            h = self.config.hidden_size
            with torch.no_grad():
                self.fuse.weight_t.zero_()
                self.fuse.weight_t[-h:].copy_(torch.eye(h))

    def bind_target(self, target: LlamaForCausalLM, quantization: str | None = FOLLOW_TARGET) -> "EagleDraftModel":
        """Share ``target``'s embedding and LM head (a hot head copies the head's K hot columns).
        ``quantization``: the method of the head's own weights (``FOLLOW_TARGET``: the target's, so a
        quantized target's head computes like it; ``gguf`` takes the 4-bit format, the file holding no
        draft weights), or None for float."""
        check_target_shape(self.config, target.config, "draft head")
        method = draft_method(target, quantization)
        compute_with(self, method)
        self.target = SharedTarget(embed=target.embed_tokens, lm_head=hot_lm_head(target, self.hot_token_ids, method))
        self.rotary = Rotary(self.config, target.embed_tokens.weight.device)
        self.layer_stack = native_layer_stack([self.layer])  # holds the (now final) operands
        return self

    def pack_for_decode(self, quantization: str | None = None) -> None:
        """Pack the projections for inference (see kernels/linear.py; ``pack_linears``: quantized with
        ``quantization`` where given) and run the layer through the C++ CPU ops where they apply (as one call:
        ``native_layer_stack``). Training must not call it: the packed copy would go stale as the weights change."""
        pack_linears(self, quantization)
        set_native_ops([self.layer], self.config, self.fc.weight_t)
        self.layer_stack = native_layer_stack([self.layer])

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads: (len(feature_layers) + 1) * hidden."""
        return (len(self.feature_layers) + 1) * self.config.hidden_size

    @property
    def feature_capture(self) -> CaptureHidden:
        """What the target's forward must capture for this head."""
        return FeatureLayers(self.feature_layers) if self.feature_layers else "last"

    def embed_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_width] -> the head's feature input [..., h] (identity for
        an EAGLE-1 head). Called where target features enter: draft extend, training, evaluation."""
        if features.shape[-1] != self.feature_width:
            raise ValueError(f"target features have width {features.shape[-1]}, this head reads {self.feature_width}")
        if not self.feature_layers:
            return features
        h = self.config.hidden_size
        chunks = features.reshape(-1, features.shape[-1]).split(h, dim=-1)
        native = self.layer.native_ops  # the C++ norm where the head's layer runs on the C++ ops (decode)
        parts = [norm.normalize(c, native) for norm, c in zip(self.feature_norms, chunks)] + [chunks[-1]]
        return self.fuse.project(torch.cat(parts, dim=-1)).reshape(*features.shape[:-1], h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., K or V] float32 through the (hot) LM head."""
        logits = self._shared().lm_head.project(hidden.reshape(-1, hidden.shape[-1])).float()
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    # The inference pieces call projections through ``project`` and embeddings through F.embedding, not
    # nn.Module's call machinery: a draft step is a handful of small calls where that overhead shows.
    def _fuse(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        embeds = F.embedding(input_ids, self._shared().embed.weight).to(features.dtype)
        fused = torch.cat([embeds, features], dim=-1)
        return self.fc.project(fused.reshape(-1, fused.shape[-1])).reshape(*features.shape)

    # ---------------------------------------------------------------- inference (paged KV)
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, features: torch.Tensor, kv_cache: KVCache,
                from_target: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over specjet's paged KV.

        Row i: ``features[i]`` is the feature at position ``batch.positions[i]`` (the target's, through
        ``embed_features`` when ``from_target``, or from the second draft step on the head's own hidden
        state) and ``batch.input_ids[i]`` the
        token at the next position, the one that feature chose. ``out_cache_loc`` is the slot of
        ``positions`` (for verified positions, the target's own slot). ``kv_cache`` has one layer.
        Returns (hidden [T, h], logits [N, K or V] float32 for the rows ``batch.logits_indices``)."""
        if from_target:
            features = self.embed_features(features)
        x = self._fuse(batch.input_ids, features)
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        hidden = run_layers([self.layer], self.layer_stack, x, cos, sin, batch, kv_cache)
        logits_in = hidden if batch.logits_indices is None else hidden[batch.logits_indices]
        return hidden, self.logits(logits_in)

    # ---------------------------------------------------------------- training (whole sequences)
    def forward_train(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T], target features [B, T, feature_width] -> hidden [B, T, h], causal over each row (teacher
        forcing: every position reads the target's feature). See ``forward_train_unrolled``."""
        return self.forward_train_unrolled(input_ids, features, 1)[0]

    def forward_train_unrolled(self, input_ids: torch.Tensor, features: torch.Tensor, depths: int) -> list[torch.Tensor]:
        """The head as drafting runs it, at every position at once ("training-time test").

        Depth 0 is teacher forcing: position t reads (x_{t+1}, f_t) and attends to depth 0 at
        positions <= t, as the draft extend over verified tokens does. Depth d >= 1 is the d-th draft
        step of a chain rooted at t - d: position t reads (x_{t+1}, h^{d-1}_{t-1}), the head's own
        output one position and one depth earlier, and attends to depth 0 at positions <= t - d (the
        verified prefix) and to depth j at position t - d + j for j = 1..d (its ancestors, itself
        last), exactly the keys a drafting forward sees. Returns the hidden states of each depth,
        [B, T, h] each; rows are right-padded (a padded tail never influences real positions).
        Gradients flow through the fed-back hidden states."""
        batch, seq, _ = features.shape
        embeds = self._shared().embed(input_ids).to(features.dtype)
        positions = torch.arange(seq, device=features.device).repeat(batch)
        cos, sin = self.rotary.cos_sin(positions, features.dtype)
        layer = self.layer
        keys, values, outputs = [], [], []
        feats = self.embed_features(features)
        for depth in range(depths):
            fused = torch.cat([embeds, feats], dim=-1)
            x = self.fc(fused.reshape(batch * seq, -1))
            q, k, v = self._qkv(layer.input_layernorm(x), cos, sin, batch, seq)
            keys.append(k)
            values.append(v)
            x = x + self._unrolled_attention(q, keys, values, depth)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            hidden = x.reshape(batch, seq, -1)
            outputs.append(hidden)
            feats = F.pad(hidden[:, :-1], (0, 0, 1, 0))  # depth d + 1 at t reads depth d's output at t - 1
        return outputs

    def _qkv(self, x, cos, sin, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q, k, v of the layer, heads first: [B, H, T, D]."""
        attn = self.layer.self_attn
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(batch * seq, attn.num_heads, attn.head_dim)
        k = k.view(batch * seq, attn.num_kv_heads, attn.head_dim)
        v = v.view(batch * seq, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        def heads_first(t: torch.Tensor) -> torch.Tensor:  # [B*T, H, D] -> [B, H, T, D]
            return t.view(batch, seq, t.shape[1], t.shape[2]).transpose(1, 2)

        return heads_first(q), heads_first(k), heads_first(v)

    def _unrolled_attention(self, q, keys: list[torch.Tensor], values: list[torch.Tensor], depth: int) -> torch.Tensor:
        attn = self.layer.self_attn
        batch, _, seq, _ = q.shape
        gqa = attn.num_kv_heads != attn.num_heads
        if depth == 0:
            out = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, scale=attn.scale, enable_gqa=gqa)
        else:
            t = torch.arange(seq, device=q.device)
            blocks = [t[None, :] <= t[:, None] - depth]  # depth 0: the verified prefix
            blocks += [t[None, :] == t[:, None] - depth + j for j in range(1, depth + 1)]  # ancestors, then itself
            mask = torch.cat(blocks, dim=1)  # [T, (depth + 1) T]
            out = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                                 scale=attn.scale, enable_gqa=gqa)
        return attn.o_proj(out.transpose(1, 2).reshape(batch * seq, attn.q_size))


# ---------------------------------------------------------------- checkpoints
def default_eagle_path() -> pathlib.Path:
    """The head trained for the default model, shipped inside the package. (A head trained on the
    GGUF target's own replies and features drafted no better for that target: bench/RESULTS.md,
    session 15.)"""
    return pathlib.Path(__file__).resolve().parents[1] / "assets" / "eagle" / DEFAULT_HEAD_NAME


def target_identity(config: ModelConfig, gguf_name: str | None = None) -> dict:
    ident = {"model_type": config.model_type, "num_layers": config.num_layers}
    ident.update({name: getattr(config, name) for name in TARGET_SHAPE_FIELDS})
    if gguf_name is not None:
        ident["gguf"] = gguf_name
    return ident


def save_eagle(model: EagleDraftModel, directory, target_gguf: str | None = None, training: dict | None = None,
               dtype: torch.dtype = torch.float16) -> pathlib.Path:
    """Write ``model.safetensors`` (fc, the layer, the hot ids; never the target's tensors) and
    ``config.json`` (format, target identity, hot vocabulary size, training summary)."""
    return write_draft(model, directory, FORMAT, FORMAT_VERSION, dtype, target_gguf, training, {
        "architecture": "EagleDraftModel",
        "feature": ("target final normed hidden state (ModelOutput.hidden, capture_hidden='last')"
                    if not model.feature_layers else
                    "residual stream after feature_layers, then the final normed hidden state (FeatureLayers capture)"),
        "feature_layers": list(model.feature_layers),
        "num_layers": 1,
    })


def check_target_shape(draft: ModelConfig, target: ModelConfig, what: str) -> None:
    """A draft (``what``: "draft head", "DFlash draft") runs on its target's embedding and head: refused unless the
    two agree in every TARGET_SHAPE_FIELDS."""
    for name in TARGET_SHAPE_FIELDS:
        if getattr(target, name) != getattr(draft, name):
            raise ValueError(f"{what} and target differ in {name}: {getattr(draft, name)} vs {getattr(target, name)}")


def check_draft_dir(directory, fmt: str) -> None:
    """FileExistsError unless ``directory`` is missing, empty or a ``fmt`` draft's: a draft replaces only a draft of
    its kind (a target model's own folder, say, is never written over)."""
    directory = pathlib.Path(directory)
    if not directory.exists() or (directory.is_dir() and not any(directory.iterdir())):
        return
    try:
        held = json.loads((directory / CONFIG_NAME).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        held = None
    if held != fmt:
        raise FileExistsError(f"{directory} is not empty and holds no {fmt} draft: not overwritten (choose another "
                              f"folder)")


def write_draft(model: nn.Module, directory, fmt: str, version: int, dtype: torch.dtype, target_gguf: str | None,
                training: dict | None, fields: dict) -> pathlib.Path:
    """A draft's directory: ``model.safetensors`` (the draft's own parameters in ``dtype`` and its hot ids; never the
    target's tensors) and ``config.json`` (format ``fmt`` v``version``, the draft's ``fields``, its hot vocabulary's
    size, the target's identity, the training summary)."""
    from safetensors.torch import save_file

    directory = pathlib.Path(directory)
    check_draft_dir(directory, fmt)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in model.named_parameters()}
    if model.hot_token_ids is not None:
        tensors["hot_token_ids"] = model.hot_token_ids.detach().to("cpu", torch.int64).contiguous()
    config = {
        "format": fmt,
        "format_version": version,
        **fields,
        "hot_vocab_size": model.draft_vocab_size if model.hot_token_ids is not None else None,
        "weights_dtype": str(dtype).removeprefix("torch."),
        "target": target_identity(model.config, target_gguf),
        "training": training or {},
    }
    # Both files are written whole beside the draft they replace, then put in place one after the other: an
    # interruption or a full disk while writing leaves the previous draft as it was (its weights beside its own
    # config), never one file of each.
    weights, config_file = directory / (WEIGHTS_NAME + ".tmp"), directory / (CONFIG_NAME + ".tmp")
    try:
        save_file(tensors, str(weights), metadata={"format": fmt})
        weights.chmod(0o644)  # safetensors creates it owner-only; a draft is package data
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        sync_files((weights, config_file))
    except BaseException:
        weights.unlink(missing_ok=True)
        config_file.unlink(missing_ok=True)
        raise
    weights.replace(directory / WEIGHTS_NAME)
    config_file.replace(directory / CONFIG_NAME)
    return directory


# The draft formats by name, for a message that names the kind a directory holds instead.
DRAFT_KINDS = {"specjet-eagle": "an EAGLE head (speculative_algorithm='EAGLE')",
               "specjet-dflash": "a DFlash draft (speculative_algorithm='DFLASH')"}


def read_draft_config(directory, fmt: str, version: int, what: str) -> dict:
    """A draft directory's config.json, refused unless it is of format ``fmt`` v``version`` and names the target it
    was trained for (``what``: "EAGLE head", "DFlash draft", for the messages)."""
    path = pathlib.Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {directory} (missing {CONFIG_NAME})")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} does not read as JSON ({err}): the {what}'s config is damaged") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a {fmt} v{version} {what.split()[-1]} (a JSON {type(config).__name__}, "
                         "not an object)")
    if config.get("format") != fmt or config.get("format_version") != version:
        held = config.get("format")
        other = f": it holds {DRAFT_KINDS[held]}" if held != fmt and held in DRAFT_KINDS else ""
        raise ValueError(f"{path} is not a {fmt} v{version} {what.split()[-1]} "
                         f"(format {held!r} v{config.get('format_version')!r}){other}")
    if not isinstance(config.get("target"), dict):
        raise ValueError(f"{path} does not name the target the {what} was trained for "
                         f"('target' is {config.get('target')!r}): an incomplete {what}")
    return config


def read_eagle_config(directory) -> dict:
    return read_draft_config(directory, FORMAT, FORMAT_VERSION, "EAGLE head")


def load_eagle(directory, target_config: ModelConfig, dtype=torch.float32, device="cpu",
               quantization: str | None = None) -> EagleDraftModel:
    """Load a head saved by ``save_eagle``, its projections packed for inference (quantized with ``quantization``,
    a method ``draft_method`` resolved); fails loudly if it was trained for another target shape. Call
    ``bind_target`` on the result before running it."""
    directory = pathlib.Path(directory)
    config = read_eagle_config(directory)
    check_trained_for(config, target_config, directory, "EAGLE head")
    feature_layers = config.get("feature_layers", [])
    if not isinstance(feature_layers, list) or not all(type(i) is int for i in feature_layers):
        raise ValueError(f"EAGLE head {directory}: feature_layers must be a list of layer ids, got {feature_layers!r}")
    tensors = read_draft_tensors(directory, "EAGLE head")
    with draft_named(directory, "EAGLE head"):
        model = EagleDraftModel(target_config, hot_token_ids=tensors.get("hot_token_ids"),
                                feature_layers=tuple(feature_layers))
    return fill_draft(model, tensors, dtype, device, directory, "EAGLE head", quantization)


def check_trained_for(config: dict, target_config: ModelConfig, directory, what: str) -> None:
    """A saved draft (``config``: its config.json) refused unless it was trained for a target of this shape and
    family (``model_type``, where the draft records it: a Qwen2 target's layers have q/k/v biases, a Llama's none)."""
    trained_for = config["target"]
    names = TARGET_SHAPE_FIELDS + ("num_layers",) + (("model_type",) if "model_type" in trained_for else ())
    for name in names:
        if trained_for.get(name) != getattr(target_config, name):
            raise ValueError(f"{what} {directory} was trained for a target with {name}={trained_for.get(name)!r}, "
                             f"this target has {getattr(target_config, name)!r}")


@contextlib.contextmanager
def draft_named(directory, what: str):
    """A ValueError raised inside (a draft's setting out of range for its target) names the draft's directory."""
    prefix = f"{what} {directory}: "
    try:
        yield
    except ValueError as err:
        if str(err).startswith(prefix):
            raise
        raise ValueError(prefix + str(err)) from None


def read_draft_tensors(directory, what: str) -> dict:
    """A draft directory's ``model.safetensors``: refused, naming the file and the tensor, unless it reads whole and
    holds floating-point, finite weights and integer hot token ids (a truncated copy, an integer cast or a diverged
    training run's NaN would otherwise load as a draft whose every proposal is rejected)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = pathlib.Path(directory) / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{what} {directory} has no weights (missing {WEIGHTS_NAME})")
    try:
        tensors = load_file(path, device="cpu")
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"{what} {directory}: {WEIGHTS_NAME} does not read as safetensors, damaged or cut short "
                         f"({err})") from None
    for name, tensor in tensors.items():
        if name == "hot_token_ids":
            if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
                raise ValueError(f"{what} {directory}: hot_token_ids must be integer token ids, got {tensor.dtype}")
        elif not tensor.is_floating_point():
            raise ValueError(f"{what} {directory}: tensor {name} is {tensor.dtype}; a draft's weights are floating "
                             "point")
        elif not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what} {directory}: tensor {name} holds NaN or infinite values (a diverged training "
                             "run?)")
    return tensors


def fill_draft(model: nn.Module, tensors: dict, dtype, device, directory, what: str, quantization: str | None = None):
    """``model`` with its saved ``tensors`` (every one of its parameters, nothing else, each of its shape), on
    ``device`` in ``dtype``, packed for inference (``pack_for_decode(quantization)``)."""
    own = model.state_dict()
    for name, tensor in tensors.items():
        if name in own and tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{what} {directory}: tensor {name} has shape {list(tensor.shape)}, a draft of this "
                             f"config for this target has {list(own[name].shape)}")
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what} {directory}: missing {missing[:5]}, unexpected {unexpected[:5]} (its tensors are "
                         "not those its config.json describes for this target)")
    model = model.to(device=device, dtype=dtype).eval()
    model.pack_for_decode(quantization)
    return model
