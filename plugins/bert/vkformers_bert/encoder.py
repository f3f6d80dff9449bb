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
from vkformers.engine.rope_scaling import rope_parameters
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import Embedding, LayerNorm, Linear
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
    """Self-attention and MLP, each with a residual and a LayerNorm (after it, or before the sublayer)."""

    def __init__(self, spec: EncoderSpec):
        super().__init__()
        s, d = spec, spec.hidden_size
        self.spec = s
        inter, attn_bias, mlp_bias = s.intermediate_size, s.attn_bias, s.mlp_bias
        fused = s.qkv_proj is not None
        parts = {role: _place(self, path, module) for role, path, module in (
            ("qkv", s.qkv_proj, Linear(d, 3 * d, attn_bias)), ("q", None if fused else s.q_proj, Linear(d, d, attn_bias)),
            ("k", None if fused else s.k_proj, Linear(d, d, attn_bias)),
            ("v", None if fused else s.v_proj, Linear(d, d, attn_bias)), ("o", s.o_proj, Linear(d, d, attn_bias)),
            ("attn_norm", s.attn_norm, LayerNorm(d, eps=s.norm_eps)),
            ("gate", s.gate_proj, Linear(d, inter, mlp_bias)), ("up", s.up_proj, Linear(d, inter, mlp_bias)),
            ("down", s.down_proj, Linear(inter, d, mlp_bias)), ("mlp_norm", s.mlp_norm, LayerNorm(d, eps=s.norm_eps)))
            if path}
        object.__setattr__(self, "parts", parts)  # plain references: _place registered them under HF paths
        self.act = F.activation(s.hidden_act)

    def attention(self, x, ctx: "Context"):
        s, p = self.spec, self.parts
        batch, length, _ = x.shape

        def heads(t):
            return t.reshape(batch, length, s.num_heads, s.head_dim).permute(0, 2, 1, 3)

        if "qkv" in p:  # one fused projection, split into views (the parameter keeps the checkpoint's layout)
            qkv = p["qkv"](x)
            q, k, v = (heads(qkv[..., i * s.hidden_size:(i + 1) * s.hidden_size]) for i in range(3))
        else:
            q, k, v = heads(p["q"](x)), heads(p["k"](x)), heads(p["v"](x))
        if ctx.rotary is not None:
            inv_freq, positions, scaling = ctx.rotary
            rotate = dict(interleaved=s.rotary_interleaved, attention_scaling=scaling)
            q = F.rope(q.contiguous(), positions, inv_freq, **rotate)
            k = F.rope(k.contiguous(), positions, inv_freq, **rotate)
            if s.rotary_value:
                v = F.rope(v.contiguous(), positions, inv_freq, **rotate)
        out = F.scaled_dot_product_attention(q, k, v, causal=False, key_padding_mask=ctx.key_padding_mask)
        return p["o"](out.permute(0, 2, 1, 3).reshape(batch, length, s.hidden_size))

    def mlp(self, x):
        p = self.parts
        hidden = self.act(p["gate"](x)) * p["up"](x) if "gate" in p else self.act(p["up"](x))
        return p["down"](hidden)

    def forward(self, x, ctx: "Context"):
        p = self.parts
        if self.spec.pre_norm:
            x = x + self.attention(p["attn_norm"](x), ctx)
            return x + self.mlp(p["mlp_norm"](x))
        x = p["attn_norm"](x + self.attention(x, ctx))
        return p["mlp_norm"](x + self.mlp(x))


@dataclass
class Context:
    key_padding_mask: object  # bool Tensor [B, T] or None (no padding)
    rotary: tuple | None      # (inv_freq Tensor, positions int32 Tensor [B, T], attention scaling) if rotary


def _as_int_array(value) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.numpy()
    return np.asarray(value).astype(np.int64)


class EncoderForMaskedLM(Module):
    """A bidirectional encoder of any architecture in :data:`vkformers_bert.variants.VARIANTS`."""

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
            embed_norm=_place(self, spec.embed_norm, LayerNorm(e, eps=spec.norm_eps)) if spec.embed_norm else None,
            embed_project=_place(self, spec.embed_project, Linear(e, d)) if spec.embed_project else None,
        )
        # ALBERT: several layer indices share one block path; _place returns the block already there
        refs["layers"] = [_place(self, spec.layer_path(i), EncoderBlock(spec)) for i in range(spec.num_layers)]
        refs["final_norm"] = _place(self, spec.final_norm, LayerNorm(d, eps=spec.norm_eps)) if spec.final_norm else None
        h = spec.head_size or e
        refs["head_dense"] = _place(self, spec.head_dense, Linear(d, h))
        refs["head_norm"] = _place(self, spec.head_norm, LayerNorm(h, eps=spec.norm_eps))
        refs["decoder"] = _place(self, spec.decoder, Linear(h, spec.vocab_size, bias=spec.decoder_bias is None))
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
        if spec.positions == "rotary" and spec.rope_from_config:
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

    def embed(self, ids: np.ndarray, mask: np.ndarray | None, token_type_ids: np.ndarray | None):
        s = self.spec
        x = F.embedding(Tensor(ids.astype(np.int32)), self.word.weight)
        if s.token_dropout:
            x = x * Tensor(self._token_dropout_scale(ids, mask), dtype=x.dtype)
        if self.token_type is not None:
            types = np.zeros(ids.shape, np.int32) if token_type_ids is None else token_type_ids.astype(np.int32)
            x = x + F.embedding(Tensor(types), self.token_type.weight)
        if self.position is not None:
            x = x + F.embedding(Tensor(self._positions(ids)), self.position.weight)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if s.zero_padded_embeddings and mask is not None:
            x = x * Tensor(mask.astype(np.float32)[..., None], dtype=x.dtype)
        if self.embed_project is not None:
            x = self.embed_project(x)
        return x

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        ids = _as_int_array(input_ids)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {ids.shape}")
        batch, length = ids.shape
        if self.position is not None and int(self._positions(ids).max()) >= self.spec.max_position_embeddings:
            raise ValueError(f"{self.architecture_name}: {length} tokens need more positions than the model's "
                             f"{self.spec.max_position_embeddings} (max_position_embeddings)")
        mask = _as_int_array(attention_mask)
        x = self.embed(ids, mask, _as_int_array(token_type_ids))
        rotary = None
        if self.inv_freq is not None:
            positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)).copy()
            rotary = (Tensor(self.inv_freq), Tensor(positions), self.rope_scaling)
        ctx = Context(Tensor(mask.astype(bool)) if mask is not None and not mask.all() else None, rotary)
        for layer in self.layers:
            x = layer(x, ctx)
        if self.final_norm is not None:
            x = self.final_norm(x)
        h = self.head_norm(F.activation(self.spec.head_act)(self.head_dense(x)))
        logits = self.decoder(h)
        if self.spec.decoder_bias:
            logits = logits + _get(self, self.spec.decoder_bias)
        loss = self.loss(logits, labels) if labels is not None else None
        return MaskedLMOutput(logits=logits, loss=loss)

    @staticmethod
    def loss(logits, labels):
        """transformers' masked-LM loss: cross-entropy at every position whose label is not -100 (no shift)."""
        labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
        return F.cross_entropy(logits.float(), Tensor(labels.astype(np.int32)), ignore_index=IGNORE_INDEX)
