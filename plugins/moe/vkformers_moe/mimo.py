"""MiMo-V2-Flash's attention deltas on the shared decoder layer: KV heads per layer, value heads narrower than the
query/key heads, a value scale, and attention sinks on the sliding layers only.

transformers 5 (MiMoV2FlashAttention): sliding-window layers have twice the KV heads of the full-attention layers
and per-head sinks (saved as self_attn.attention_sink_bias); v_proj gives v_head_dim per head (q/k: head_dim),
scaled by attention_value_scale; o_proj reads the value heads and has no bias (q/k/v follow attention_bias).

The KV cache has one head count and one head size for all layers: the largest KV head count and head_dim. A layer
with fewer KV heads repeats each of them (query head h still reads key head h // (heads / kv_heads)), and values are
zero-padded to head_dim, the attention output sliced back, as the shared decoder does for MLA.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.module import join_path, place
from vkformers.models.decoder import DecoderLayer, make_projection


@dataclass(frozen=True)
class MimoAttention:
    """The per-layer options; called with (spec, index, alibi) it builds a layer (DecoderSpec.make_layer)."""

    kv_heads: tuple[int, ...]    # per layer
    sinks: tuple[bool, ...]      # per layer: attention sinks (DecoderSpec.attention.sinks names them)
    v_head_dim: int
    value_scale: float = 1.0

    def __call__(self, spec, index: int, alibi=None) -> "MimoLayer":
        return MimoLayer(self, spec, index, alibi)


class MimoLayer(DecoderLayer):
    """The shared decoder layer with this layer's KV heads and sinks, and value heads of v_head_dim."""

    def __init__(self, options: MimoAttention, spec, index: int, alibi=None):
        layer = replace(spec, num_kv_heads=options.kv_heads[index],
                        attention=replace(spec.attention, o_bias=False,
                                          sinks=spec.attention.sinks if options.sinks[index] else None))
        super().__init__(layer, index, alibi)
        self.options, self.cache_kv_heads = options, spec.num_kv_heads
        s, d, vdim = self.spec, spec.hidden_size, options.v_head_dim
        a = s.attention
        self.parts["v"] = place(self, join_path(a.path, a.v_proj), make_projection(s, d, s.num_kv_heads * vdim, a.v_bias))
        self.parts["o"] = place(self, join_path(a.path, a.o_proj), make_projection(s, s.num_heads * vdim, d, False))

    def attention(self, h, ctx):
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        q = p["q"](h).reshape(batch, length, s.num_heads, s.head_dim).permute(0, 2, 1, 3)
        k = p["k"](h).reshape(batch, length, s.num_kv_heads, s.head_dim).permute(0, 2, 1, 3)
        v = (p["v"](h) * self.options.value_scale).reshape(batch, length, s.num_kv_heads, self.options.v_head_dim)
        v = v.permute(0, 2, 1, 3)
        if self.rotates:
            inv_freq, scaling = ctx.rope_tables[self.index]
            q = F.rope(q, ctx.rope_positions, inv_freq, interleaved=s.positions.rope_interleaved,
                       attention_scaling=scaling)
            k = F.rope(k, ctx.rope_positions, inv_freq, interleaved=s.positions.rope_interleaved,
                       attention_scaling=scaling)
        return self._attend(q, k, v, ctx, batch, length)  # sinks and o_proj as in the shared layer

    def attend_heads(self, q, k, v, ctx, **options):
        batch, kv_heads, length, vdim = v.shape
        dim = k.shape[-1]
        if vdim < dim:  # the attention kernel has one head size
            padding = Tensor(np.zeros((batch, kv_heads, length, dim - vdim), np.float32), dtype=v.dtype)
            v = F.cat([v, padding], -1)
        repeat = self.cache_kv_heads // kv_heads
        if repeat > 1:  # the cache's head count: each KV head repeated, in place
            k, v = (t.reshape(batch, kv_heads, 1, length, dim).expand(batch, kv_heads, repeat, length, dim)
                    .contiguous().reshape(batch, kv_heads * repeat, length, dim) for t in (k, v))
        out = super().attend_heads(q, k, v.contiguous(), ctx, **options)
        if options.get("return_lse"):
            out, lse = out
            return out[..., :vdim], lse
        return out[..., :vdim]
