"""One bidirectional encoder with a masked-LM head for every architecture of the family,
configured by an :class:`~vkformers_bert.variants.EncoderSpec`.

Block (post-LN, BERT): x = LN(x + o(attn(x))); x = LN'(x + down(act(up(x)))); pre-LN variants
apply the norms to the sublayer inputs instead and end with a final norm. Attention is
bidirectional: the fused kernel with ``causal=False`` and ``attention_mask`` as a key padding mask.
Embeddings: word (+ learned absolute positions) (+ token types), optional LayerNorm and
projection to the hidden width. Head: decoder(LN(act(dense(x)))) + bias, the decoder tied to the
word embeddings unless the config unties it.

``model(input_ids, attention_mask=None, token_type_ids=None, labels=None)`` returns ``.logits``
[B, T, vocab] and, with labels, ``.loss``: transformers' masked-LM loss (cross-entropy over the
positions whose label is not -100, no shift).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.rope_scaling import rope_parameters
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.models.inputs import InputLimits
from vkformers.models.layers import Embedding, LayerNorm, Linear, RMSNorm
from vkformers.models.module import Module
from vkformers.runtime import dtypes as dt

from vkformers_bert.variants import EncoderSpec, encoder_spec

IGNORE_INDEX = -100

# Checkpoint tensors that are not parameters of a masked-LM model: buffers, the pre-training heads
# (next-sentence / sentence-order), the pooler, and the decoder copies of tied weights.
IGNORED_CHECKPOINT_KEYS = ("position_ids", "token_type_ids", "rotary_embeddings.inv_freq", "pooler.dense.weight",
                           "pooler.dense.bias", "seq_relationship.weight", "seq_relationship.bias",
                           "sop_classifier.classifier.weight", "sop_classifier.classifier.bias",
                           "predictions.decoder.weight", "predictions.decoder.bias", "lm_head.decoder.weight",
                           "lm_head.decoder.bias", "vocab_projector.weight", "generator_lm_head.weight")


class UnsupportedBaseModel(VkformersError, ValueError):
    """An encoder whose checkpoint layout does not separate the base model from its head."""


@dataclass
class MaskedLMOutput:
    logits: object = None
    loss: object = None


def _place(root: Module, path: str, module: Module) -> Module:
    """Attach ``module`` under a dotted HF path, creating plain container modules on the way."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        node = node._modules[part] if part in node._modules else node.add(part, Module())
    return node._modules[name] if name in node._modules else node.add(name, module)


def _declare(root: Module, path: str, shape) -> None:
    """A lone parameter under a dotted HF path (``cls.predictions.bias``)."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        node = node._modules[part] if part in node._modules else node.add(part, Module())
    node.param(name, shape)


def _get(root: Module, path: str) -> Tensor:
    *parents, name = path.split(".")
    node = root
    for part in parents:
        node = node._modules[part]
    return getattr(node, name)


def _modern_name(name: str) -> str:
    if name.endswith("LayerNorm.gamma"):
        return name[:-len("gamma")] + "weight"
    if name.endswith("LayerNorm.beta"):
        return name[:-len("beta")] + "bias"
    return name


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


class EncoderBlock(Module):
    """Self-attention and MLP, each with a residual and a norm (after it, or before the sublayer).

    ``root``/``index``: XLM keeps each part in its own per-layer list (``transformer.attentions.{i}.q_lin``,
    ``transformer.layer_norm1.{i}``); the parts are then placed under the model at those formatted full paths."""

    def __init__(self, spec: EncoderSpec, root: Module | None = None, index: int = 0):
        super().__init__()
        s, d = spec, spec.hidden_size
        self.spec, self.index = s, index
        inter, attn_bias, mlp_bias, kv = s.intermediate_size, s.attn_bias, s.mlp_bias, s.kv_heads * s.head_dim
        host = self if root is None else root
        fused = s.qkv_proj is not None
        attn_norm = s.attn_norm if (index > 0 or not s.first_attn_norm_identity) else None

        def norm():
            return RMSNorm(d, eps=s.norm_eps) if s.norm == "rms" else LayerNorm(d, eps=s.norm_eps, bias=s.norm_bias)

        parts = {role: _place(host, path.format(i=index) if root is not None else path, module)
                 for role, path, module in (
            ("qkv", s.qkv_proj, Linear(d, d + 2 * kv, attn_bias)),
            ("q", None if fused else s.q_proj, Linear(d, d, attn_bias)),
            ("k", None if fused else s.k_proj, Linear(d, kv, attn_bias)),
            ("v", None if fused else s.v_proj, Linear(d, kv, attn_bias)), ("o", s.o_proj, Linear(d, d, attn_bias)),
            ("q_norm", s.qk_norm[0] if s.qk_norm else None, LayerNorm(d, eps=s.qk_norm_eps, bias=False)),
            ("k_norm", s.qk_norm[1] if s.qk_norm else None, LayerNorm(kv, eps=s.qk_norm_eps, bias=False)),
            ("attn_norm", attn_norm, norm()),
            ("gate", s.gate_proj, Linear(d, inter, mlp_bias)),
            ("up", s.up_proj, Linear(d, 2 * inter if s.fused_up_gate else inter, mlp_bias)),
            ("down", s.down_proj, Linear(inter, d, mlp_bias)), ("mlp_norm", s.mlp_norm, norm()))
            if path}
        object.__setattr__(self, "parts", parts)  # plain references: _place registered them under HF paths
        self.act = F.activation(s.hidden_act)
        self.window = s.layer_windows[index] if s.layer_windows else 0

    def attention(self, x, ctx: "Context"):
        s, p = self.spec, self.parts
        batch, length, _ = x.shape
        kv = s.kv_heads * s.head_dim

        def heads(t, n):
            return t.reshape(batch, length, n, s.head_dim).permute(0, 2, 1, 3)

        if "qkv" in p:  # one fused projection, split into views (the parameter keeps the checkpoint's layout)
            qkv = p["qkv"](x)
            q, k, v = qkv[..., :s.hidden_size], qkv[..., s.hidden_size:s.hidden_size + kv], qkv[..., s.hidden_size + kv:]
        else:
            q, k, v = p["q"](x), p["k"](x), p["v"](x)
        if "q_norm" in p:  # ESMC: LayerNorm over the whole projection, before the heads split
            q, k = p["q_norm"](q), p["k_norm"](k)
        q, k, v = heads(q, s.num_heads), heads(k, s.kv_heads), heads(v, s.kv_heads)
        rotary = ctx.rotary[self.index] if ctx.rotary is not None else None
        if rotary is not None:
            inv_freq, positions, scaling = rotary
            rotate = dict(interleaved=s.rotary_interleaved, attention_scaling=scaling)
            q = F.rope(q.contiguous(), positions, inv_freq, **rotate)
            k = F.rope(k.contiguous(), positions, inv_freq, **rotate)
            if s.rotary_value:
                v = F.rope(v.contiguous(), positions, inv_freq, **rotate)
        if self.window:  # bidirectional window |i - j| <= window: composed from ops with an additive mask
            scores = (q @ k.transpose(-2, -1)) * (1.0 / float(np.sqrt(s.head_dim)))
            out = (scores + ctx.window_bias(self.window, batch, length)).softmax(-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, causal=False, key_padding_mask=ctx.key_padding_mask)
        return p["o"](out.permute(0, 2, 1, 3).reshape(batch, length, s.hidden_size))

    def mlp(self, x):
        p, s = self.parts, self.spec
        if s.fused_up_gate:  # ModernBERT's Wi: [input; gate], act(input) * gate
            both = p["up"](x)
            hidden = self.act(both[..., :s.intermediate_size]) * both[..., s.intermediate_size:]
        else:
            hidden = self.act(p["gate"](x)) * p["up"](x) if "gate" in p else self.act(p["up"](x))
        return p["down"](hidden)

    def forward(self, x, ctx: "Context"):
        p, scale = self.parts, self.spec.residual_scale
        if self.spec.pre_norm:
            h = p["attn_norm"](x) if "attn_norm" in p else x
            a = self.attention(h, ctx)
            x = x + (a * (1.0 / scale) if scale != 1.0 else a)
            m = self.mlp(p["mlp_norm"](x))
            return x + (m * (1.0 / scale) if scale != 1.0 else m)
        x = p["attn_norm"](x + self.attention(x, ctx))
        return p["mlp_norm"](x + self.mlp(x))


@dataclass
class Context:
    key_padding_mask: object  # bool Tensor [B, T] or None (no padding)
    rotary: list | None       # per layer: (inv_freq Tensor, positions int32 Tensor [B, T], attention scaling), if rotary
    mask: np.ndarray | None = None  # the int attention mask [B, T] (window attention builds its bias from it)

    def window_bias(self, window: int, batch: int, length: int) -> Tensor:
        """0 where query i may see key j (|i - j| <= window and j not padding), -1e30 elsewhere: [B, 1, T, T]."""
        pos = np.arange(length)
        allowed = np.abs(pos[:, None] - pos[None, :]) <= window
        keys = np.ones((batch, length), bool) if self.mask is None else self.mask.astype(bool)
        allowed = allowed[None, None] & keys[:, None, None, :]
        return Tensor(np.where(allowed, np.float32(0), np.float32(-1e30)).astype(np.float32))


def _as_bool(mask) -> np.ndarray:
    """A mask as the bytes a bool tensor holds (the array then becomes the graph input as it is)."""
    return (np.asarray(mask) != 0).astype(np.uint8)


def _as_int32(ids) -> np.ndarray:
    return np.asarray(ids).astype(np.int32)


def _as_int_array(value) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.numpy()
    return np.asarray(value).astype(np.int64)


class EncoderForMaskedLM(Module):
    """A bidirectional encoder of any architecture in :data:`vkformers_bert.variants.VARIANTS`."""

    supports_gradient_checkpointing = True  # forward runs its layers through call_layer

    def __init__(self, config: dict, architecture):
        super().__init__()
        name = getattr(architecture, "name", architecture)
        spec = encoder_spec(config, name)
        self.config, self.architecture_name, self.spec = config, name, spec
        self.dtype = dt.float32  # from_pretrained sets the loaded dtype
        e, d = spec.embed_dim, spec.hidden_size
        emb = spec.embeddings
        refs = dict(
            word=_place(self, _join(emb, spec.word), Embedding(spec.vocab_size, e)),
            position=(_place(self, _join(emb, spec.position), Embedding(spec.max_position_embeddings, e))
                      if spec.position else None),
            token_type=(_place(self, _join(emb, spec.token_type), Embedding(spec.type_vocab_size, e))
                        if spec.token_type and spec.type_vocab_size else None),
            embed_norm=(_place(self, spec.embed_norm, LayerNorm(e, eps=spec.norm_eps, bias=spec.norm_bias))
                        if spec.embed_norm else None),
            embed_project=_place(self, spec.embed_project, Linear(e, d)) if spec.embed_project else None,
            # RoCBERT: word ++ shape ++ pronunciation embeddings, mapped back to the embedding width
            concat=[_place(self, path, Embedding(rows, width)) for path, rows, width in spec.concat_embeds],
            concat_map=(_place(self, spec.concat_map, Linear(e + sum(w for _, _, w in spec.concat_embeds), e))
                        if spec.concat_map else None),
        )
        if spec.scattered_layers:  # XLM: parts live in per-layer lists under the model, no block module
            refs["layers"] = [EncoderBlock(spec, root=self, index=i) for i in range(spec.num_layers)]
        else:  # ALBERT: several layer indices share one block path; _place returns the block already there
            refs["layers"] = [_place(self, spec.layer_path(i), EncoderBlock(spec, index=i))
                              for i in range(spec.num_layers)]
        final_norm = (RMSNorm(d, eps=spec.norm_eps) if spec.norm == "rms"
                      else LayerNorm(d, eps=spec.norm_eps, bias=spec.norm_bias and spec.final_norm_bias))
        refs["final_norm"] = _place(self, spec.final_norm, final_norm) if spec.final_norm else None
        h = (spec.head_size or e) if spec.head_dense else d
        refs["head_dense"] = _place(self, spec.head_dense, Linear(d, h, spec.head_dense_bias)) if spec.head_dense else None
        refs["head_norm"] = (_place(self, spec.head_norm, LayerNorm(h, eps=spec.head_norm_eps or spec.norm_eps,
                                                                    bias=spec.head_norm_bias))
                             if spec.head_norm else None)
        refs["decoder"] = _place(self, spec.decoder, Linear(h, spec.vocab_size,
                                                            bias=spec.decoder_bias is None and spec.decoder_linear_bias))
        for key, module in refs.items():
            object.__setattr__(self, key, module)
        if spec.decoder_bias:
            _declare(self, spec.decoder_bias, (spec.vocab_size,))
        if spec.tie_embeddings:
            if h != e:
                raise ValueError(f"{name}: a tied decoder needs the head width {h} to equal the embedding width {e}")
            self.tie(f"{spec.decoder}.weight", f"{_join(emb, spec.word)}.weight")
        for path in spec.frozen:
            _declare(self, path, (spec.max_position_embeddings, spec.head_dim))
        for path, shape in spec.unused:
            _declare(self, path, shape)
        self.ignored_checkpoint_keys = IGNORED_CHECKPOINT_KEYS
        self.inv_freq, self.rope_scaling = None, 1.0
        self.layer_rope = None  # per layer (inv_freq, scaling) when layer types rotate differently (ModernBERT)
        if spec.positions == "rotary" and spec.layer_rope_types:
            self.layer_rope = [rope_parameters(config, layer_type=t) for t in spec.layer_rope_types]
        elif spec.positions == "rotary" and spec.rope_from_config:
            self.inv_freq, self.rope_scaling = rope_parameters(config)
        elif spec.positions == "rotary":
            theta = float(config.get("rope_theta", spec.rope_theta))
            exponents = np.arange(0, spec.head_dim, 2, dtype=np.float32) / np.float32(spec.head_dim)
            self.inv_freq = (1.0 / theta ** exponents).astype(np.float32)

    def load_state_dict(self, arrays, *args, **kwargs):
        # TF-era names that transformers still reads (and writes for ESM): LayerNorm.gamma / .beta
        arrays = {_modern_name(name): array for name, array in arrays.items()}
        super().load_state_dict(arrays, *args, **kwargs)
        # tables the checkpoint holds but training never changes: no gradient, so no optimizer update either
        for name, slot in self.named_slots():
            if name in self.spec.frozen and slot.tensor is not None:
                slot.tensor.requires_grad = False

    # -- forward

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        s = self.spec
        batch, length = ids.shape
        if s.positions_from_padding:  # fairseq: real tokens count from pad + 1, padding tokens sit at pad
            real = (ids != s.pad_token_id).astype(np.int64)
            return (np.cumsum(real, axis=1) * real + s.pad_token_id).astype(np.int32)
        return np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)).copy()

    def _token_dropout_scale(self, ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """ESM: the mask token's embedding is zeroed and the rest scaled by (1 - 0.15 * 0.8) / (1 - observed ratio)."""
        is_mask = ids == self.spec.mask_token_id
        lengths = mask.sum(-1) if mask is not None else np.full(ids.shape[0], ids.shape[1])
        observed = is_mask.sum(-1).astype(np.float32) / lengths.astype(np.float32)
        scale = np.float32(1 - 0.15 * 0.8) / (np.float32(1) - observed)
        return np.where(is_mask, np.float32(0), scale[:, None]).astype(np.float32)[..., None]

    def _concat_embeddings(self, x, shape):
        """map([word; shape; pronunciation]) as a sum of slices of the map's weight (no concatenation op). The
        extra ids default to 0 (transformers' default when none are given); a lookup of the padding row passes it no
        gradient (nn.Embedding's padding_idx): the tables' gradient is then zero, not missing, as in torch."""
        weight, start = self.concat_map.weight, x.shape[-1]
        out = F.linear(x, weight[:, :start].contiguous(), self.concat_map.bias)
        for table in self.concat:
            width = table.weight.shape[-1]
            rows = F.embedding(Tensor(np.zeros(shape, np.int32)), table.weight, padding_idx=self.spec.pad_token_id)
            out = out + F.linear(rows, weight[:, start:start + width].contiguous())
            start += width
        return out

    def embed(self, ids: np.ndarray, mask: np.ndarray | None, token_type_ids: np.ndarray | None, source=None):
        """``source``: the input_ids as the caller gave them; a captured training step (engine.lazy.StepCapture)
        derives the ids and positions anew from the next batch's."""
        s = self.spec
        source = ids if source is None else source
        x = F.embedding(Tensor(lazy.derived_input(ids.astype(np.int32), source, _as_int32)), self.word.weight,
                        padding_idx=s.pad_token_id if s.word_padding_idx else None)
        if self.concat_map is not None:
            x = self._concat_embeddings(x, ids.shape)
        if s.token_dropout:
            x = x * Tensor(self._token_dropout_scale(ids, mask), dtype=x.dtype)
        if self.token_type is not None:
            # the caller's int32 array itself where it is one: a captured training step reads the next batch's
            types = np.zeros(ids.shape, np.int32) if token_type_ids is None else \
                np.ascontiguousarray(token_type_ids, np.int32)
            x = x + F.embedding(Tensor(types), self.token_type.weight)
        if self.position is not None:
            # positions counted from padding (RoBERTa): pads read row pad_token_id, a padding_idx in transformers
            positions = lazy.derived_input(self._positions(ids), source, lambda a: self._positions(_as_int_array(a)))
            x = x + F.embedding(Tensor(positions), self.position.weight,
                                padding_idx=s.pad_token_id if s.positions_from_padding else None)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if s.zero_padded_embeddings and mask is not None:
            x = x * Tensor(mask.astype(np.float32)[..., None], dtype=x.dtype)
        if self.embed_project is not None:
            x = self.embed_project(x)
        return x

    def input_limits(self) -> InputLimits:
        s = self.spec
        max_length = None
        if self.position is not None:  # fairseq positions (RoBERTa) start past the padding id: pad + 1
            max_length = s.max_position_embeddings - (s.pad_token_id + 1 if s.positions_from_padding else 0)
        return InputLimits(vocab_size=s.vocab_size, max_length=max_length,
                           type_vocab_size=s.type_vocab_size if self.token_type is not None else None)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        x = self.encode(input_ids, attention_mask, token_type_ids)
        h = x
        if self.head_dense is not None:
            h = F.activation(self.spec.head_act)(self.head_dense(h))
        if self.head_norm is not None:
            h = self.head_norm(h)
        logits = self.decoder(h)
        if self.spec.decoder_bias:
            logits = logits + _get(self, self.spec.decoder_bias)
        loss = self.loss(logits, labels) if labels is not None else None
        return MaskedLMOutput(logits=logits, loss=loss)

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, hidden_states: list | None = None):
        """The encoder's last hidden states [B, T, hidden] (after the final norm of pre-LN encoders), before any
        head; ``hidden_states``, a list, receives the embeddings' output and each layer's (the last one normed)."""
        ids = _as_int_array(input_ids)
        batch, length = ids.shape
        mask = _as_int_array(attention_mask)
        types = token_type_ids.numpy() if isinstance(token_type_ids, Tensor) else token_type_ids
        x = self.embed(ids, mask, None if types is None else np.asarray(types), source=input_ids)
        rotary = None
        if self.inv_freq is not None or self.layer_rope is not None:
            positions = Tensor(np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)).copy())
            ropes = self.layer_rope or [(self.inv_freq, self.rope_scaling)] * len(self.layers)
            tables = {}
            for inv_freq, scaling in ropes:
                tables.setdefault(id(inv_freq), (Tensor(inv_freq), positions, scaling))
            rotary = [tables[id(inv_freq)] for inv_freq, _ in ropes]
        padding = None
        if mask is not None and not mask.all():  # a captured training step derives it anew from the next mask
            padding = Tensor(lazy.derived_input(_as_bool(mask), attention_mask, _as_bool), dtype=dt.bool_)
        ctx = Context(padding, rotary, mask)
        keep = (Tensor(mask.astype(np.float32)[..., None], dtype=x.dtype)
                if self.spec.zero_padded_hidden and mask is not None else None)
        if keep is not None:
            x = x * keep
        if hidden_states is not None:
            hidden_states.append(x)
        for layer in self.layers:
            x = self.call_layer(layer, x, ctx)
            if keep is not None:  # XLM zeroes the padded positions after every layer
                x = x * keep
            if hidden_states is not None:
                hidden_states.append(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
            if hidden_states is not None:
                hidden_states[-1] = x
        return x

    @staticmethod
    def loss(logits, labels):
        """transformers' masked-LM loss: cross-entropy at every position whose label is not -100 (no shift)."""
        labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
        return F.cross_entropy(logits.float(), Tensor(labels.astype(np.int32)), ignore_index=IGNORE_INDEX)
