"""Doge's dynamic mask attention and learned residual scales on the shared decoder layer.

transformers 5 (DogeAttention): each key gets one additive score bias per KV head, computed from its value,
exp(A * softplus(dt_proj(values))), shared by every query that may attend to it; scores = scale q k + bias. The
layer adds it through the attention kernel itself: one more head dimension, 1 in every query and bias / scale in
every key (zeros in the values, sliced off), so masks, GQA, the backward and the cache stay the kernel's. Top-k
masking past keep_window_size keys is not implemented (the variant refuses such configs). The residuals are
input_residual * x + attn and post_attention_residual * x + mlp, both learned per channel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.errors import InputError
from vkformers.models.decoder import DecoderLayer
from vkformers.models.layers import Linear
from vkformers.models.module import add_param, get_param, join_path, place


@dataclass(frozen=True)
class DynamicMaskAttention:
    """The options; called with (spec, index, alibi) it builds a layer (DecoderSpec.make_layer)."""

    keep_window_size: int
    dt_bias: bool

    def __call__(self, spec, index: int, alibi=None) -> "DogeLayer":
        return DogeLayer(self, spec, index, alibi)


class DogeLayer(DecoderLayer):
    """The shared decoder layer with Doge's key biases and per-channel residual scales."""

    capture_decode = False  # the biases read every cached value, outside the cache's captured decode attention

    def __init__(self, options: DynamicMaskAttention, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        self.keep_window_size = options.keep_window_size
        kv_heads = spec.num_kv_heads
        add_param(self, join_path(spec.attention.path, "A"), (kv_heads,))
        object.__setattr__(self, "dt_proj", place(self, join_path(spec.attention.path, "dt_proj"),
                                                  Linear(kv_heads * spec.head_dim, kv_heads, bias=options.dt_bias)))
        add_param(self, "input_residual", (spec.hidden_size,))
        add_param(self, "post_attention_residual", (spec.hidden_size,))

    def attend_heads(self, q, k, v, ctx, **options):
        new = q.shape[2]
        if ctx.cache is not None:  # store the new keys and values (the cache's own output is not used), read all
            ctx.cache.attend(self.index, q, k, v, **options)
            end = ctx.cache.position + new
            k, v = ctx.cache.keys[self.index][:, :, :end], ctx.cache.values[self.index][:, :, :end]
            mask = ctx.cache.step_inputs(new)[1]
            options = dict(options, key_padding_mask=None if mask is None else mask[:, :end])
        batch, kv_heads, keys, dim = v.shape
        if keys > self.keep_window_size:
            raise InputError(f"doge: {keys} keys exceed keep_window_size {self.keep_window_size}, past which "
                             "transformers keeps only the top-scoring keys (not implemented); use shorter sequences")
        dt = self.dt_proj(v.permute(0, 2, 1, 3).reshape(batch, keys, kv_heads * dim))
        bias = (F.softplus(dt) * self._param("A")).exp().permute(0, 2, 1).reshape(batch, kv_heads, keys, 1)
        # the bias rides in one extra head dimension (padded to a multiple of 8 with zeros)
        extra = 1 + (-(dim + 1)) % 8

        def zeros(t, width):
            return Tensor(np.zeros((*t.shape[:3], width), np.float32), dtype=t.dtype)

        ones = Tensor(np.ones((*q.shape[:3], 1), np.float32), dtype=q.dtype)
        q = F.cat([q, ones, zeros(q, extra - 1)], -1)
        k = F.cat([k, (bias * (1.0 / options["scale"])).cast(k.dtype), zeros(k, extra - 1)], -1)
        v = F.cat([v, zeros(v, extra)], -1)
        out = F.scaled_dot_product_attention(q, k, v, causal=True, **options)
        return out[..., :dim]

    def _sequential_residual(self, x, ctx):
        attn = self.attention(self._norm("attn_in_norm", x), ctx)
        x = x * get_param(self, "input_residual") + attn
        mlp = self.mlp(self._norm("mlp_in_norm", x))
        return x * get_param(self, "post_attention_residual") + mlp
