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
from vkformers.errors import InputError, VkformersError
from vkformers.models.cache import EncoderDecoderCache
from vkformers.models.inputs import InputLimits
from vkformers.models.layers import Embedding, LayerNorm, Linear, RMSNorm
from vkformers.models.lazy_weights import LazyWeights
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


class PointwiseConv1d(Module):
    """A Conv1d of kernel 1 with ``groups`` channel groups on channels-last inputs (SqueezeBERT's projections):
    group g maps input channels g * in/groups.. to output channels g * out/groups... Weight [out, in / groups, 1]
    as stored; one batched product over the groups."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, bias: bool = True):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{groups} groups do not divide {in_channels} -> {out_channels} channels")
        self.in_channels, self.out_channels, self.groups, self.has_bias = in_channels, out_channels, groups, bias
        self.param("weight", (out_channels, in_channels // groups, 1))
        if bias:
            self.param("bias", (out_channels,))

    def forward(self, x):
        g, inner, outer = self.groups, self.in_channels // self.groups, self.out_channels // self.groups
        bias = self.bias if self.has_bias else None
        if g == 1:
            return F.linear(x, self.weight.reshape(self.out_channels, self.in_channels), bias)
        lead = x.shape[:-1]
        rows = x.reshape(-1, g, inner).permute(1, 0, 2).contiguous()            # [groups, rows, in / groups]
        weight = self.weight.reshape(g, outer, inner).transpose(-2, -1)         # [groups, in / groups, out / groups]
        y = (rows @ weight).permute(1, 0, 2).reshape(*lead, self.out_channels)
        return y + bias if bias is not None else y


class NoNorm(Module):
    """MobileBERT's normalization_type "no_norm": x * weight + bias (no statistics)."""

    def __init__(self, size: int):
        super().__init__()
        self.param("weight", (size,))
        self.param("bias", (size,))

    def forward(self, x):
        return x * self.weight + self.bias


class MobileBertBlock(Module):
    """MobileBERT's block at ``bottleneck_size`` inside a hidden-wide stream: an input bottleneck (dense + NoNorm)
    for the residual, q and k from a shared bottleneck (or the input one, or the block input), v from the block
    input (or the bottleneck), attention + output dense + NoNorm, extra feed-forward networks each with its
    residual and NoNorm, the last one, then the output bottleneck back to hidden with the block input as residual."""

    def __init__(self, spec: EncoderSpec, index: int = 0):
        super().__init__()
        s, d, b, inter = spec, spec.hidden_size, spec.bottleneck_size, spec.intermediate_size
        self.spec, self.index = s, index
        value_width = b if s.bottleneck_attention else d
        layout = [("in", "bottleneck.input.dense", Linear(d, b)), ("in_norm", "bottleneck.input.LayerNorm", NoNorm(b)),
                  ("q", "attention.self.query", Linear(b if (s.bottleneck_attention or s.shared_qk_bottleneck) else d, b)),
                  ("k", "attention.self.key", Linear(b if (s.bottleneck_attention or s.shared_qk_bottleneck) else d, b)),
                  ("v", "attention.self.value", Linear(value_width, b)),
                  ("o", "attention.output.dense", Linear(b, b)), ("o_norm", "attention.output.LayerNorm", NoNorm(b)),
                  ("up", "intermediate.dense", Linear(b, inter)), ("down", "output.dense", Linear(inter, b)),
                  ("down_norm", "output.LayerNorm", NoNorm(b)),
                  ("out", "output.bottleneck.dense", Linear(b, d)), ("out_norm", "output.bottleneck.LayerNorm", NoNorm(d))]
        if s.shared_qk_bottleneck and not s.bottleneck_attention:
            layout += [("qk", "bottleneck.attention.dense", Linear(d, b)),
                       ("qk_norm", "bottleneck.attention.LayerNorm", NoNorm(b))]
        for i in range(s.extra_ffns):
            layout += [(f"ffn{i}_up", f"ffn.{i}.intermediate.dense", Linear(b, inter)),
                       (f"ffn{i}_down", f"ffn.{i}.output.dense", Linear(inter, b)),
                       (f"ffn{i}_norm", f"ffn.{i}.output.LayerNorm", NoNorm(b))]
        object.__setattr__(self, "parts", {role: _place(self, path, module) for role, path, module in layout})
        self.act = F.activation(s.hidden_act)

    def forward(self, x, ctx: "Context"):
        s, p = self.spec, self.parts
        batch, length, _ = x.shape
        heads, head_dim = s.num_heads, s.bottleneck_size // s.num_heads
        residual = p["in_norm"](p["in"](x))
        if s.bottleneck_attention:
            qk_in, v_in = residual, residual
        elif s.shared_qk_bottleneck:
            qk_in, v_in = p["qk_norm"](p["qk"](x)), x
        else:
            qk_in, v_in = x, x

        def split(t):
            return t.reshape(batch, length, heads, head_dim).permute(0, 2, 1, 3)

        out = F.scaled_dot_product_attention(split(p["q"](qk_in)), split(p["k"](qk_in)), split(p["v"](v_in)),
                                             causal=False, key_padding_mask=ctx.key_padding_mask)
        out = out.permute(0, 2, 1, 3).reshape(batch, length, s.bottleneck_size)
        h = p["o_norm"](p["o"](out) + residual)
        for i in range(s.extra_ffns):
            h = p[f"ffn{i}_norm"](p[f"ffn{i}_down"](self.act(p[f"ffn{i}_up"](h))) + h)
        h = p["down_norm"](p["down"](self.act(p["up"](h))) + h)
        return p["out_norm"](p["out"](h) + x)


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

        pointwise = dict(s.pointwise_groups)

        def projection(role, inp, out, bias):  # a Linear, or a grouped pointwise convolution where declared
            return PointwiseConv1d(inp, out, pointwise[role], bias) if role in pointwise else Linear(inp, out, bias)

        qkv_width = s.conv_width or d  # ConvBERT: q / k / v of the attention half only
        parts = {role: _place(host, path.format(i=index) if root is not None else path, module)
                 for role, path, module in (
            ("qkv", s.qkv_proj, Linear(d, d + 2 * kv, attn_bias if s.qkv_bias is None else s.qkv_bias)),
            ("q", None if fused else s.q_proj, projection("q", d, qkv_width if s.conv_width else d, attn_bias)),
            ("k", None if fused else s.k_proj, projection("k", d, qkv_width if s.conv_width else kv, attn_bias)),
            ("v", None if fused else s.v_proj, projection("v", d, qkv_width if s.conv_width else kv, attn_bias)),
            ("o", s.o_proj, projection("o", d, d, attn_bias)),
            ("q_norm", s.qk_norm[0] if s.qk_norm else None, LayerNorm(d, eps=s.qk_norm_eps, bias=False)),
            ("k_norm", s.qk_norm[1] if s.qk_norm else None, LayerNorm(kv, eps=s.qk_norm_eps, bias=False)),
            ("attn_norm", attn_norm, norm()),
            ("gate", s.gate_proj, Linear(d, inter, mlp_bias)),
            ("up", s.up_proj, projection("up", d, 2 * inter if s.fused_up_gate else inter,
                                         mlp_bias if s.up_bias is None else s.up_bias)),
            ("down", s.down_proj, projection("down", inter, d, mlp_bias)), ("mlp_norm", s.mlp_norm, norm()),
            ("pos_key", s.pos_key_proj if s.relative_attention and not s.share_att_key and "c2p" in s.score_terms
             else None, Linear(d, d, s.pos_key_bias)),
            ("pos_query", s.pos_query_proj if s.relative_attention and not s.share_att_key and "p2c" in s.score_terms
             else None, Linear(d, d)),
            ("conv_kernel", "attention.self.conv_kernel_layer" if s.conv_kernel else None,
             Linear(s.conv_width, s.num_heads * s.conv_kernel)),
            ("conv_out", "attention.self.conv_out_layer" if s.conv_kernel else None, Linear(d, s.conv_width)),
            ("adapter_up", f"{s.lang_adapter}.dense1" if s.lang_adapter else None, Linear(d, s.adapter_size)),
            ("adapter_down", f"{s.lang_adapter}.dense2" if s.lang_adapter else None, Linear(s.adapter_size, d)),
            *((role, path, Linear(d, d)) for role, path in zip(("q_global", "k_global", "v_global"),
                                                               s.global_projections or (None, None, None))))
            if path}
        object.__setattr__(self, "parts", parts)  # plain references: _place registered them under HF paths
        idle = [_place(host, f"{path}.{name}", Linear(*sizes)) for path in s.idle_adapters
                for name, sizes in (("dense1", (d, s.adapter_size)), ("dense2", (s.adapter_size, d)))]
        object.__setattr__(self, "idle_adapters", idle)
        if s.conv_kernel:  # the separable convolution's lone parameters, in the checkpoint's shapes
            conv = "attention.self.key_conv_attn_layer"
            for name, shape in (("depthwise.weight", (d, 1, s.conv_kernel)), ("pointwise.weight", (s.conv_width, d, 1)),
                                ("bias", (s.conv_width, 1))):
                _declare(self, f"{conv}.{name}", shape)
        if s.value_conv:
            _declare(self, f"{s.value_conv}.weight", (s.num_heads, 1, s.value_conv_kernel, 1))
        if s.qv_bias:
            if root is not None:
                raise ValueError("qv_bias needs the parts under the block")
            for path in s.qv_bias:
                _declare(self, path, (d,))
        self.act = F.activation(s.hidden_act)
        self.window = s.layer_windows[index] if s.layer_windows else 0
        cross = {}
        if s.cross_attention:  # BertLMHeadModel as a decoder: BERT's attention over the encoder's states
            for role, name in (("q", "self.query"), ("k", "self.key"), ("v", "self.value"), ("o", "output.dense")):
                cross[role] = _place(self, f"{s.cross_attention}.{name}", Linear(d, d, attn_bias))
            cross["norm"] = _place(self, f"{s.cross_attention}.output.LayerNorm", norm())
        object.__setattr__(self, "cross", cross)

    def cross_keys_values(self, states):
        """The cross-attention's keys and values [B, heads, S, head_dim] of the encoder's states."""
        return tuple(self._heads(self.cross[role](states)) for role in ("k", "v"))

    def _heads(self, t):
        return t.reshape(t.shape[0], t.shape[1], self.spec.num_heads, self.spec.head_dim).permute(0, 2, 1, 3)

    def cross_attend(self, x, ctx: "Context"):
        """Post-LN cross-attention: norm(x + o(attention(q(x), k(states), v(states)))), the encoder's padding hidden;
        the keys and values from the cache where it holds them (EncoderDecoderCache)."""
        s, c = self.spec, self.cross
        batch, length, _ = x.shape
        cross = getattr(ctx.cache, "cross", None)
        k, v = cross[self.index] if cross else self.cross_keys_values(ctx.encoder_states)
        out = F.scaled_dot_product_attention(self._heads(c["q"](x)), k, v, causal=False,
                                             key_padding_mask=ctx.encoder_padding_mask)
        return c["norm"](x + c["o"](out.permute(0, 2, 1, 3).reshape(batch, length, s.hidden_size)))

    def conv_attention(self, x, ctx: "Context"):
        """ConvBERT: [attention heads; dynamic-convolution heads] -> attention.output.dense. A convolution head's
        output at t is sum_j w[t, j] * conv_out[t + j - (K - 1) / 2] (zeros past the ends, padding included as in
        transformers), w = softmax over j of conv_kernel_layer(separable_conv(x) * query)."""
        s, p = self.spec, self.parts
        batch, length, d = x.shape
        heads, k, width = s.num_heads, s.conv_kernel, s.conv_width
        size = width // heads
        conv = "attention.self.key_conv_attn_layer"
        q = p["q"](x)

        def zeros(*shape):
            return Tensor(np.zeros(shape, np.float32)).cast(x.dtype)

        def split(t):
            return t.reshape(batch, length, heads, size).permute(0, 2, 1, 3)

        depthwise = F.depthwise_conv1d(x, _get(self, f"{conv}.depthwise.weight"), k // 2)
        key_conv = F.linear(depthwise, _get(self, f"{conv}.pointwise.weight").reshape(width, d),
                            _get(self, f"{conv}.bias").reshape(width))
        weights = p["conv_kernel"](key_conv * q).reshape(batch, length, heads, k).softmax(-1)
        values = p["conv_out"](x).reshape(batch, length, heads, size)
        half = (k - 1) // 2
        values = F.cat([zeros(batch, half, heads, size), values, zeros(batch, k - 1 - half, heads, size)], 1)
        mixed = None
        for j in range(k):
            term = values[:, j:j + length] * weights[..., j:j + 1]
            mixed = term if mixed is None else mixed + term
        attended = F.scaled_dot_product_attention(split(q), split(p["k"](x)), split(p["v"](x)), causal=False,
                                                  key_padding_mask=ctx.key_padding_mask).permute(0, 2, 1, 3)
        out = F.cat([attended, mixed], 2).reshape(batch, length, 2 * width)
        return p["o"](out)

    def fourier(self, x):
        """FNet: Re(F_T x F_H) = C_T x C_H - S_T x S_H, F_n the DFT matrix of n points (C, S its cosines and
        sines), as the products of two real matrices on each side."""
        def dft(n):
            angle = (2 * np.pi / n) * (np.outer(np.arange(n), np.arange(n)) % n)
            return (Tensor(np.cos(angle).astype(np.float32)).cast(x.dtype),
                    Tensor(np.sin(angle).astype(np.float32)).cast(x.dtype))
        (cos_t, sin_t), (cos_h, sin_h) = dft(x.shape[1]), dft(x.shape[2])
        return (cos_t @ x) @ cos_h - (sin_t @ x) @ sin_h

    def nystrom(self, q, k, v, ctx: "Context"):
        """Nyströmformer: softmax(q kl^T) pinv(softmax(ql kl^T)) softmax(ql k^T + key mask) v with the landmarks
        ql, kl the means of ``landmarks`` equal segments of q and k [B, H, T, D]; exact softmax attention when every
        position is a landmark."""
        s = self.spec
        batch, heads, length, size = q.shape
        if s.landmarks == s.landmark_length:
            return F.scaled_dot_product_attention(q, k, v, causal=False, key_padding_mask=ctx.key_padding_mask)
        if length != s.landmark_length:
            raise InputError(f"nystromformer: this model takes its {s.landmarks} landmarks from sequences of exactly "
                             f"segment_means_seq_len={s.landmark_length} tokens; pad input_ids to that length (got "
                             f"{length})")
        scale = float(size) ** -0.25
        q, k = q * scale, k * scale
        segments = (batch, heads, s.landmarks, length // s.landmarks, size)
        q_marks, k_marks = q.reshape(*segments).mean(-2), k.reshape(*segments).mean(-2)
        kernel_1 = (q @ k_marks.transpose(-2, -1)).softmax(-1)
        kernel_2 = (q_marks @ k_marks.transpose(-2, -1)).softmax(-1)
        scores = q_marks @ k.transpose(-2, -1)
        if ctx.key_bias is not None:
            scores = scores + ctx.key_bias
        return (kernel_1 @ F.iterative_pinv(kernel_2, 6, "global")) @ (scores.softmax(-1) @ v)

    def value_convolution(self, v):
        """The depthwise convolution over positions of the values [B, T, heads * size], one kernel per head."""
        s = self.spec
        kernel = s.value_conv_kernel
        weight = _get(self, f"{s.value_conv}.weight").reshape(s.num_heads, 1, kernel)
        weight = weight.expand(s.num_heads, s.head_dim, kernel).reshape(s.hidden_size, kernel)
        return F.depthwise_conv1d(v, weight, kernel // 2)

    def attention(self, x, ctx: "Context"):
        s, p = self.spec, self.parts
        if s.mixing == "fourier":
            return self.fourier(x)
        if s.conv_kernel:
            return self.conv_attention(x, ctx)
        batch, length, _ = x.shape
        kv = s.kv_heads * s.head_dim

        def heads(t, n):
            return t.reshape(batch, length, n, s.head_dim).permute(0, 2, 1, 3)

        if s.qkv_per_head:  # DeBERTa's in_proj: [q_h; k_h; v_h] for each head h in turn, then q_bias and v_bias
            hd = s.head_dim
            qkv = p["qkv"](x).reshape(batch, length, s.num_heads, 3 * hd)
            q, k, v = (qkv[..., i * hd:(i + 1) * hd].contiguous().reshape(batch, length, s.hidden_size)
                       for i in range(3))
            if s.qv_bias:
                q, v = q + _get(self, s.qv_bias[0]), v + _get(self, s.qv_bias[1])
        elif "qkv" in p:  # one fused projection, split into views (the parameter keeps the checkpoint's layout)
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
        if s.mixing == "nystrom":
            out = self.nystrom(q, k, v, ctx)
        elif s.mixing == "lsh":  # YOSO: no mask (transformers' is 1 everywhere), unit rows in and out
            out = F.normalize(F.lsh_expectation_attention(F.normalize(q), F.normalize(k), v, s.hash_bits))
        elif s.score_terms or s.relative_attention:
            out = self.disentangled(q, k, v, ctx)
        elif ctx.position_bias is not None:  # MPNet: scores + the layers' shared relative-position bias
            scores = (q @ k.transpose(-2, -1)) * (1.0 / float(np.sqrt(s.head_dim))) + ctx.position_bias
            if ctx.key_bias is not None:
                scores = scores + ctx.key_bias
            out = scores.softmax(-1) @ v
        elif self.window:  # bidirectional window |i - j| <= window: composed from ops with an additive mask
            scores = (q @ k.transpose(-2, -1)) * (1.0 / float(np.sqrt(s.head_dim)))
            out = (scores + ctx.window_bias(self.window, batch, length)).softmax(-1) @ v
            if s.global_projections:
                out = self.global_attention(x, out, ctx, heads)
        elif ctx.cache is not None:  # a decoder's generation step: its keys and values kept on the cache
            out = ctx.cache.attend(self.index, q, k, v, key_padding_mask=ctx.mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, causal=s.causal, key_padding_mask=ctx.key_padding_mask)
        out = out.permute(0, 2, 1, 3).reshape(batch, length, s.hidden_size)
        if s.value_conv:
            values = v.permute(0, 2, 1, 3).reshape(batch, length, s.hidden_size)
            if s.value_conv_masked and ctx.value_keep is not None:
                values = values * ctx.value_keep
            out = out + self.value_convolution(values)
        return p["o"](out)

    def global_attention(self, x, local, ctx: "Context", heads):
        """Longformer: the rows of global tokens replaced by their attention to every real key through the global
        projections, padded rows zeroed (transformers zeroes their probabilities); ``local`` [B, H, T, head_dim]."""
        s, p = self.spec, self.parts
        batch, length = ctx.mask_shape
        real = np.ones((batch, length), bool) if ctx.mask is None else ctx.mask.astype(bool)
        glob = ctx.global_tokens if ctx.global_tokens is not None else np.zeros((batch, length), bool)
        local_rows = Tensor((real & ~glob).astype(np.float32)[:, None, :, None]).cast(local.dtype)
        if not glob.any():
            return local * local_rows
        q, k, v = heads(p["q_global"](x), s.num_heads), heads(p["k_global"](x), s.num_heads), \
            heads(p["v_global"](x), s.num_heads)
        keys = Tensor(np.where(real, np.float32(0), np.float32(-1e30))[:, None, None, :].astype(np.float32))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / float(np.sqrt(s.head_dim))) + keys
        rows = Tensor(glob.astype(np.float32)[:, None, :, None]).cast(local.dtype)
        return local * local_rows + (scores.softmax(-1) @ v) * rows

    def disentangled(self, q, k, v, ctx: "Context"):
        """DeBERTa: softmax(scale * (q k^T + c2p + p2c) + mask) v, scale = 1 / sqrt(head_dim * (1 + terms)).
        c2p[i, j] = q_i . pos_key[c2p_index[i, j]], p2c[i, j] = k_j . pos_query[p2c_index[j, i]], the keys and
        queries of the relative-position table (its own projections, or q / k's when share_att_key)."""
        s, p = self.spec, self.parts
        batch, _, length, _ = q.shape
        scale = 1.0 / float(np.sqrt(s.head_dim * (1 + len(s.score_terms))))
        scores = q @ k.transpose(-2, -1)
        if s.relative_attention:
            table, c2p_index, p2c_index = ctx.relative
            rows = table.shape[0]

            def positions(proj):
                return proj(table).reshape(1, rows, s.num_heads, s.head_dim).permute(0, 2, 1, 3)

            if "c2p" in s.score_terms:
                pos_key = positions(p["k"] if s.share_att_key else p["pos_key"])
                scores = scores + F.take_along_last(q @ pos_key.transpose(-2, -1), c2p_index)
            if "p2c" in s.score_terms:
                pos_query = positions(p["q"] if s.share_att_key else p["pos_query"])
                scores = scores + F.take_along_last(k @ pos_query.transpose(-2, -1), p2c_index).transpose(-2, -1)
        scores = scores * scale
        if ctx.pair_mask is not None:  # transformers' mask[i] * mask[j]: a padded query row attends to every key
            # evenly, as its masked_fill of every score gives (float32: -1e30 overflows a 16-bit type)
            scores = F.where(ctx.pair_mask, scores.float(), -1e30)
        return scores.softmax(-1).cast(v.dtype) @ v

    def mlp(self, x):
        p, s = self.parts, self.spec
        if s.fused_up_gate:  # ModernBERT's Wi: [input; gate], act(input) * gate; GTE's [up; gate], up * act(gate)
            both = p["up"](x)
            first, second = both[..., :s.intermediate_size], both[..., s.intermediate_size:]
            hidden = self.act(second) * first if s.fused_act_half else self.act(first) * second
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
        if self.cross:
            x = self.cross_attend(x, ctx)
        h = x + self.mlp(x)
        if "adapter_up" in p:  # X-MOD: the language adapter between two applications of the MLP's norm
            normed = p["mlp_norm"](h)
            h = p["adapter_down"](self.act(p["adapter_up"](normed))) + (normed if self.spec.adapter_ln_before else h)
            if self.idle_adapters:  # read at run time: loading replaces the parameter tensors
                h = F.gradient_use(h, used=[t for module in self.idle_adapters for t in module.parameters()])
        return p["mlp_norm"](h)


@dataclass
class Context:
    key_padding_mask: object  # bool Tensor [B, T] or None (no padding)
    rotary: list | None       # per layer: (inv_freq Tensor, positions int32 Tensor [B, T], attention scaling), if rotary
    mask: np.ndarray | None = None  # the int attention mask [B, T] (window attention builds its bias from it)
    relative: tuple | None = None   # DeBERTa: (position table Tensor [2 span, hidden], c2p index, p2c index)
    pair_mask: object = None        # DeBERTa: bool Tensor [B, 1, T, T], query and key both real
    position_bias: object = None    # MPNet: Tensor [1, H, T, T] added to every layer's scores
    key_bias: object = None         # MPNet: float32 Tensor [B, 1, 1, T], -1e30 at padded keys
    global_tokens: np.ndarray | None = None  # Longformer: bool [B, T], the real tokens with global attention
    mask_shape: tuple = (0, 0)      # (batch, length)
    value_keep: object = None       # YOSO: Tensor [B, T, 1], the attention mask the convolved values are scaled by
    encoder_states: object = None   # a decoder with cross-attention: the encoder's last hidden states [B, S, D]
    encoder_padding_mask: object = None  # and its bool Tensor [B, S] padding mask, or None
    cache: object = None            # a decoder's generation: the EncoderDecoderCache its layers attend over

    def window_bias(self, window: int, batch: int, length: int) -> Tensor:
        """0 where query i may see key j (|i - j| <= window, or j a global token; j not padding), -1e30 elsewhere:
        [B, 1, T, T]."""
        pos = np.arange(length)
        allowed = (np.abs(pos[:, None] - pos[None, :]) <= window)[None, None]
        if self.global_tokens is not None:
            allowed = allowed | self.global_tokens[:, None, None, :]
        keys = np.ones((batch, length), bool) if self.mask is None else self.mask.astype(bool)
        allowed = allowed & keys[:, None, None, :]
        return Tensor(np.where(allowed, np.float32(0), np.float32(-1e30)).astype(np.float32))


def relative_span(spec: EncoderSpec) -> int:
    """How many relative positions each side of zero DeBERTa's table holds."""
    return spec.position_buckets if spec.position_buckets > 0 else spec.max_relative_positions


def relative_positions(length: int, buckets: int, max_position: int) -> np.ndarray:
    """query - key [T, T], beyond buckets / 2 mapped to log-spaced buckets (DeBERTa-v2's make_log_bucket_position,
    in float32 as transformers computes it)."""
    ids = np.arange(length, dtype=np.int64)
    rel = ids[:, None] - ids[None, :]
    if buckets <= 0 or max_position <= 0:
        return rel
    mid = buckets // 2
    abs_pos = np.where((rel < mid) & (rel > -mid), mid - 1, np.abs(rel))
    ratio = np.log((abs_pos / mid).astype(np.float32)) / np.log(np.float32((max_position - 1) / mid))
    log_pos = np.ceil(ratio * np.float32(mid - 1)) + np.float32(mid)
    return np.where(abs_pos <= mid, rel, log_pos * np.sign(rel)).astype(np.int64)


def relative_position_buckets(length: int, buckets: int, max_distance: int) -> np.ndarray:
    """int32 [T, T]: the bucket of key j - query i, T5's bidirectional buckets (half for each sign, exact below a
    quarter of the buckets, log-spaced up to max_distance), as MPNet computes them."""
    ids = np.arange(length, dtype=np.int64)
    n = -(ids[None, :] - ids[:, None])
    half = buckets // 2
    out = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    exact = half // 2
    far = np.maximum(n, exact).astype(np.float32)  # the log branch only counts where n >= exact
    large = exact + (np.log(far / exact) / np.float32(np.log(max_distance / exact)) * (half - exact)).astype(np.int64)
    out += np.where(n < exact, n, np.minimum(large, half - 1))
    return out.astype(np.int32)


def _as_bool(mask) -> np.ndarray:
    """A mask as the bytes a bool tensor holds (the array then becomes the graph input as it is)."""
    return (np.asarray(mask) != 0).astype(np.uint8)


def _pair_mask(mask) -> np.ndarray:
    """[B, 1, T, T] bytes of a bool tensor: query i and key j both real (DeBERTa's attention mask)."""
    real = np.asarray(mask.numpy() if isinstance(mask, Tensor) else mask) != 0
    return (real[:, None, :, None] & real[:, None, None, :]).astype(np.uint8)


def _keep_column(mask) -> np.ndarray:
    """float32 [B, T, 1]: 1 at real tokens, 0 at padding."""
    return _as_bool(mask).astype(np.float32)[..., None]


def _key_bias(mask) -> np.ndarray:
    """float32 [B, 1, 1, T]: 0 at real keys, -1e30 at padding (an additive attention mask)."""
    real = np.asarray(mask.numpy() if isinstance(mask, Tensor) else mask) != 0
    return np.where(real, np.float32(0), np.float32(-1e30)).astype(np.float32)[:, None, None, :]


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
        words = spec.word_size or e
        refs = dict(
            word=_place(self, _join(emb, spec.word), Embedding(spec.vocab_size, words)),
            embed_transform=(_place(self, spec.embed_transform, Linear(words * (3 if spec.trigram_input else 1), d))
                             if spec.embed_transform else None),
            position=(_place(self, _join(emb, spec.position), Embedding(spec.max_position_embeddings, e))
                      if spec.position else None),
            token_type=(_place(self, _join(emb, spec.token_type), Embedding(spec.type_vocab_size, e))
                        if spec.token_type and spec.type_vocab_size else None),
            embed_norm=(_place(self, spec.embed_norm, NoNorm(e) if spec.block == "mobilebert"
                               else LayerNorm(e, eps=spec.norm_eps, bias=spec.norm_bias))
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
            block = MobileBertBlock if spec.block == "mobilebert" else EncoderBlock
            refs["layers"] = [_place(self, spec.layer_path(i), block(spec, index=i)) for i in range(spec.num_layers)]
        final_norm = (RMSNorm(d, eps=spec.norm_eps) if spec.norm == "rms"
                      else LayerNorm(d, eps=spec.norm_eps, bias=spec.norm_bias and spec.final_norm_bias))
        refs["final_norm"] = _place(self, spec.final_norm, final_norm) if spec.final_norm else None
        refs["rel_table"] = (_place(self, spec.rel_embeddings, Embedding(2 * relative_span(spec), d))
                             if spec.rel_embeddings else None)
        refs["rel_bias"] = (_place(self, spec.relative_bias, Embedding(spec.relative_bias_buckets, spec.num_heads))
                            if spec.relative_bias else None)
        refs["rel_norm"] = _place(self, spec.rel_norm, LayerNorm(d, eps=spec.norm_eps)) if spec.rel_norm else None
        h = (spec.head_size or e) if spec.head_dense else d
        refs["head_dense"] = _place(self, spec.head_dense, Linear(d, h, spec.head_dense_bias)) if spec.head_dense else None
        refs["head_norm"] = (_place(self, spec.head_norm, LayerNorm(h, eps=spec.head_norm_eps or spec.norm_eps,
                                                                    bias=spec.head_norm_bias))
                             if spec.head_norm else None)
        decoded = words if spec.split_decoder else h  # MobileBERT: the word width; the rest through split_decoder
        refs["decoder"] = _place(self, spec.decoder, Linear(decoded, spec.vocab_size,
                                                            bias=spec.decoder_bias is None and spec.decoder_linear_bias))
        for key, module in refs.items():
            object.__setattr__(self, key, module)
        if spec.decoder_bias:
            _declare(self, spec.decoder_bias, (spec.vocab_size,))
        if spec.split_decoder:
            _declare(self, f"{spec.split_decoder}.weight", (h - words, spec.vocab_size))
        if spec.tie_embeddings:
            if decoded != words:
                raise ValueError(f"{name}: a tied decoder needs the head width {decoded} to equal the embedding width "
                                 f"{words}")
            self.tie(f"{spec.decoder}.weight", f"{_join(emb, spec.word)}.weight")
        for path in spec.frozen:
            _declare(self, path, (spec.max_position_embeddings, spec.head_dim))
        for path, shape in spec.unused:
            _declare(self, path, shape)
        self.ignored_checkpoint_keys = IGNORED_CHECKPOINT_KEYS + spec.ignored_suffixes
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
        arrays = LazyWeights.of(arrays).renamed(_modern_name)
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
        return np.broadcast_to(np.arange(s.position_offset, s.position_offset + length, dtype=np.int32),
                               (batch, length)).copy()

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

    def embed(self, ids: np.ndarray, mask: np.ndarray | None, token_type_ids: np.ndarray | None, source=None,
              past: int = 0):
        """``source``: the input_ids as the caller gave them; a captured training step (engine.lazy.StepCapture)
        derives the ids and positions anew from the next batch's. ``past``: the tokens a decoder's cache holds
        before these."""
        s = self.spec
        source = ids if source is None else source
        x = F.embedding(Tensor(lazy.derived_input(ids.astype(np.int32), source, _as_int32)), self.word.weight,
                        padding_idx=s.pad_token_id if s.word_padding_idx else None)
        if self.concat_map is not None:
            x = self._concat_embeddings(x, ids.shape)
        if s.trigram_input:  # MobileBERT: [the next token's; this; the previous token's], zeros past the ends
            zero = Tensor(np.zeros((ids.shape[0], 1, x.shape[-1]), np.float32)).cast(x.dtype)
            after = F.cat([x[:, 1:], zero], 1) if ids.shape[1] > 1 else zero
            before = F.cat([zero, x[:, :-1]], 1) if ids.shape[1] > 1 else zero
            x = F.cat([after, x, before], -1)
        if self.embed_transform is not None:
            x = self.embed_transform(x)
        if s.token_dropout:
            x = x * Tensor(self._token_dropout_scale(ids, mask), dtype=x.dtype)
        if self.token_type is not None:
            # the caller's int32 array itself where it is one: a captured training step reads the next batch's
            types = np.zeros(ids.shape, np.int32) if token_type_ids is None else \
                np.ascontiguousarray(token_type_ids, np.int32)
            x = x + F.embedding(Tensor(types), self.token_type.weight)
        if self.position is not None:
            # positions counted from padding (RoBERTa): pads read row pad_token_id, a padding_idx in transformers
            positions = lazy.derived_input(self._positions(ids), source, lambda a: self._positions(_as_int_array(a))) \
                if not past else self._positions(ids) + np.int32(past)
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
            max_length = s.max_position_embeddings - (s.pad_token_id + 1 if s.positions_from_padding
                                                      else s.position_offset)
        return InputLimits(vocab_size=s.vocab_size, max_length=max_length,
                           type_vocab_size=s.type_vocab_size if self.token_type is not None else None)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None, encoder_hidden_states=None,
                encoder_attention_mask=None, cache=None):
        """``cache`` (a decoder with cross-attention, BertLMHeadModel): the EncoderDecoderCache of
        :meth:`encoder_decoder_cache`, whose tokens precede these and which this call advances."""
        x = self.encode(input_ids, attention_mask, token_type_ids, encoder_hidden_states=encoder_hidden_states,
                        encoder_attention_mask=encoder_attention_mask, cache=cache)
        h = x
        if self.head_dense is not None:
            h = F.activation(self.spec.head_act)(self.head_dense(h))
        if self.head_norm is not None:
            h = self.head_norm(h)
        if self.spec.split_decoder:  # MobileBERT: h @ [word_embeddings^T; dense.weight]
            words = self.word.weight.shape[-1]
            logits = self.decoder(h[..., :words].contiguous()) + \
                h[..., words:].contiguous() @ _get(self, f"{self.spec.split_decoder}.weight")
        else:
            logits = self.decoder(h)
        if self.spec.decoder_bias:
            logits = logits + _get(self, self.spec.decoder_bias)
        loss = self.loss(logits, labels) if labels is not None else None
        return MaskedLMOutput(logits=logits, loss=loss)

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, hidden_states: list | None = None,
               global_attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None, cache=None):
        """The encoder's last hidden states [B, T, hidden] (after the final norm of pre-LN encoders), before any
        head; ``hidden_states``, a list, receives the embeddings' output and each layer's (the last one normed).
        ``global_attention_mask`` (Longformer): 1 at the tokens with global attention; an attention mask of 2 says
        the same, as in transformers."""
        ids = _as_int_array(input_ids)
        batch, length = ids.shape
        mask = _as_int_array(attention_mask) if self.spec.reads_mask else None
        global_tokens = None
        if self.spec.global_projections:
            marks = np.ones((batch, length), np.int64) if mask is None else mask.astype(np.int64)
            if global_attention_mask is not None:
                marks = marks * (_as_int_array(global_attention_mask).astype(np.int64) + 1)
            global_tokens = marks > 1 if (marks > 1).any() else None
            mask = None if mask is None else (mask > 0).astype(mask.dtype)
        elif global_attention_mask is not None:
            raise UnsupportedBaseModel(f"{self.architecture_name} takes no global_attention_mask; leave it out")
        types = token_type_ids.numpy() if isinstance(token_type_ids, Tensor) else token_type_ids
        # the caller's array itself (not a copy): a captured training step finds the batch's segment ids by it
        if cache is not None and not self.spec.cross_attention:
            raise UnsupportedBaseModel(f"{self.architecture_name}: a cache serves a decoder with cross-attention "
                                       "(is_decoder, add_cross_attention); leave it out")
        past = cache.position if cache is not None else 0
        x = self.embed(ids, mask, None if types is None else np.asarray(types), source=input_ids, past=past)
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
        ctx = Context(padding, rotary, mask, self._relative(length) if self.rel_table is not None else None,
                      global_tokens=global_tokens, mask_shape=(batch, length), cache=cache)
        if self.spec.cross_attention:
            if encoder_hidden_states is None:
                raise UnsupportedBaseModel(f"{self.architecture_name}: a decoder with cross-attention needs "
                                           "encoder_hidden_states")
            ctx.encoder_states = encoder_hidden_states
            source = None if encoder_attention_mask is None else _as_int_array(encoder_attention_mask)
            if source is not None and not source.all():
                ctx.encoder_padding_mask = Tensor(_as_bool(source), dtype=dt.bool_)
        elif encoder_hidden_states is not None:
            raise UnsupportedBaseModel(f"{self.architecture_name} has no cross-attention (add_cross_attention): "
                                       "leave encoder_hidden_states out")
        if self.rel_bias is not None:
            buckets = relative_position_buckets(length, self.spec.relative_bias_buckets,
                                                self.spec.relative_bias_max_distance)
            bias = F.embedding(Tensor(buckets), self.rel_bias.weight)   # [T, T, heads]
            ctx.position_bias = bias.permute(2, 0, 1).reshape(1, self.spec.num_heads, length, length)
            if padding is not None:
                ctx.key_bias = Tensor(lazy.derived_input(_key_bias(mask), attention_mask, _key_bias))
        elif padding is not None and self.spec.mixing == "nystrom":
            ctx.key_bias = Tensor(lazy.derived_input(_key_bias(mask), attention_mask, _key_bias))
        if padding is not None and self.spec.value_conv_masked:
            ctx.value_keep = Tensor(lazy.derived_input(_keep_column(mask), attention_mask, _keep_column), dtype=x.dtype)
        if padding is not None and (self.spec.score_terms or self.spec.relative_attention):
            ctx.pair_mask = Tensor(lazy.derived_input(_pair_mask(mask), attention_mask, _pair_mask), dtype=dt.bool_)
        keep = (Tensor(mask.astype(np.float32)[..., None], dtype=x.dtype)
                if self.spec.zero_padded_hidden and mask is not None else None)
        if keep is not None:
            x = x * keep
        if hidden_states is not None:
            hidden_states.append(x)
        count = len(self.layers)
        per_part = self.layers_per_part(x, count)
        for i, layer in enumerate(self.layers):
            x = self.call_layer(layer, x, ctx)
            if keep is not None:  # XLM zeroes the padded positions after every layer
                x = x * keep
            if hidden_states is not None:
                hidden_states.append(x)
            self.submit_part(x, i + 1, count, per_part)
        if self.final_norm is not None:
            x = self.final_norm(x)
            if hidden_states is not None:
                hidden_states[-1] = x
        if cache is not None:
            cache.advance(length)
        return x

    def encoder_decoder_cache(self, batch: int, max_len: int, encoder_states, encoder_mask=None) -> EncoderDecoderCache:
        """A cache for decoding over ``encoder_states`` (an encoder-decoder's generate): the self-attention's keys
        and values, and every layer's cross-attention keys and values, computed here once."""
        s = self.spec
        if not s.cross_attention:
            raise UnsupportedBaseModel(f"{self.architecture_name}: an encoder without cross-attention "
                                       "(add_cross_attention) attends to no other encoder")
        cache = EncoderDecoderCache(len(self.layers), batch, s.kv_heads, s.head_dim, max_len, self.dtype,
                                    self.word.weight.device, encoder_states, encoder_mask)
        cache.fill_cross([layer.cross_keys_values(encoder_states) for layer in self.layers])
        return cache

    def _relative(self, length: int):
        """DeBERTa's table of relative-position embeddings (normed when the config says so) and the int32 indices
        [T, T] that pick its rows for c2p (query - key) and p2c (key - query), clamped to the table."""
        table = self.rel_table.weight
        if self.rel_norm is not None:
            table = self.rel_norm(table)
        span = relative_span(self.spec)
        if self.spec.span_from_length and length < span:  # DeBERTa (v1): the 2 min(T, max) middle rows
            table, span = table[span - length:span + length].contiguous(), length
        rel = relative_positions(length, self.spec.position_buckets, self.spec.max_relative_positions)
        c2p = np.clip(rel + span, 0, 2 * span - 1).astype(np.int32)
        p2c = np.clip(-rel + span, 0, 2 * span - 1).astype(np.int32)
        return table, Tensor(c2p), Tensor(p2c)

    @staticmethod
    def loss(logits, labels):
        """transformers' masked-LM loss: cross-entropy at every position whose label is not -100 (no shift)."""
        labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
        return F.cross_entropy(logits.float(), Tensor(labels.astype(np.int32)), ignore_index=IGNORE_INDEX)
