"""DiffLlama's differential attention on the shared decoder layer.

transformers 5 (DiffLlamaAttention): the value heads are split in two halves along the KV-head axis, each repeated
to the full KV-head count (v1 from the first half, v2 from the second); with A_h the softmax of query head h,
head h yields [A_h v1 | A_h v2] (2 head_dim values). Heads h and h + H/2 form one output pair:
out_p = x_p - lambda * x_{p + H/2}, lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init,
lambda_init = 0.8 - 0.6 exp(-0.3 layer); then a weightless RMS norm over the pair's 2 head_dim values, times
(1 - lambda_init), and o_proj over the H/2 pairs.

Like transformers, the layer runs two attention calls over the same queries and keys, one per value half; with a
cache, the keys and values are stored as usual and both calls read them back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from vkformers.engine import functional as F
from vkformers.models.decoder import DecoderLayer
from vkformers.models.module import add_param, join_path

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


@dataclass(frozen=True)
class DiffAttention:
    """The options; called with (spec, index, alibi) it builds a layer (DecoderSpec.make_layer)."""

    eps: float

    def __call__(self, spec, index: int, alibi=None) -> "DiffLlamaLayer":
        return DiffLlamaLayer(self, spec, index, alibi)


class DiffLlamaLayer(DecoderLayer):
    """The shared decoder layer whose attention is differential."""

    def __init__(self, options: DiffAttention, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        self.eps = options.eps
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * index)
        for name in LAMBDAS:
            add_param(self, join_path(spec.attention.path, name), (spec.head_dim,))

    capture_decode = False  # the two calls read the cache's stored keys, outside its captured decode attention

    def attend_heads(self, q, k, v, ctx, **options):
        heads, new = q.shape[1], q.shape[2]
        if ctx.cache is not None:  # store the new keys and values (the cache's own output is not used), read all
            ctx.cache.attend(self.index, q, k, v, **options)
            end = ctx.cache.position + new
            k, v = ctx.cache.keys[self.index][:, :, :end], ctx.cache.values[self.index][:, :, :end]
            mask = ctx.cache.step_inputs(new)[1]
            options = dict(options, key_padding_mask=None if mask is None else mask[:, :end])
        half = v.shape[1] // 2
        halves = (F.cat([v[:, :half], v[:, :half]], dim=1), F.cat([v[:, half:], v[:, half:]], dim=1))
        x = F.cat([F.scaled_dot_product_attention(q, k, part, causal=True, **options) for part in halves], dim=-1)
        lq1, lk1, lq2, lk2 = (self._param(name).float() for name in LAMBDAS)
        lam = (lq1 * lk1).sum().exp() - (lq2 * lk2).sum().exp() + self.lambda_init
        pairs = heads // 2  # heads h and h + H/2 make one output pair: [B, H/2, T, 2D]
        out = x[:, :pairs] - x[:, pairs:] * lam.reshape(1, 1, 1, 1).cast(x.dtype)
        return F.rms_norm(out, None, eps=self.eps) * (1.0 - self.lambda_init)
