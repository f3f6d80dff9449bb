"""Llama 4's attention deltas on the shared decoder layer: chunked attention, NoPE temperature, weightless q/k norm.

transformers 5 (Llama4TextAttention): layers of type "chunked_attention" let query i see key j only when
j <= i and both lie in the same chunk of ``attention_chunk_size`` positions, counted from the row's first
non-padding position; rotary layers normalise q and k after the rotation by an RMS norm without weight
(use_qk_norm); the layers without rotary (NoPE) scale their queries by 1 + attn_scale * log(1 + floor((pos + 1) /
floor_scale)) (attn_temperature_tuning), pos being the cache position (past + arange(T)) in every row.

The chunk mask is not one the attention kernels know: a chunked layer composes its attention from matmuls, a
host-built mask and a softmax (over the stored keys when there is a cache). That mask, like the temperature,
changes with the position, so generate does not capture these models' decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.decoder import DecoderLayer

_HIDDEN = -1e30  # added to the scores of keys a query does not see


@dataclass(frozen=True)
class Llama4Attention:
    """The per-layer options; called with (spec, index, alibi) it builds a layer (DecoderSpec.make_layer)."""

    chunks: tuple[int, ...]      # per layer: chunk size, 0 for full attention
    qk_norm: tuple[bool, ...]    # per layer: weightless RMS norm of q and k after the rotation
    temperature: tuple[bool, ...]  # per layer: NoPE query temperature
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    eps: float = 1e-5

    def __call__(self, spec, index: int, alibi=None) -> "Llama4Layer":
        return Llama4Layer(self, spec, index, alibi)


class Llama4Layer(DecoderLayer):
    """The shared decoder layer whose attention (given q, k, v after projections and rotary) is Llama 4's."""

    capture_decode = False  # the chunk mask and the temperature are built on the host from the position

    def __init__(self, options: Llama4Attention, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        self.options = options
        self.chunk = options.chunks[index]

    def attend_heads(self, q, k, v, ctx, **options):
        o = self.options
        past = ctx.cache.position if ctx.cache is not None else 0
        positions = past + np.arange(q.shape[2], dtype=np.float32)
        if o.qk_norm[self.index]:
            q, k = F.rms_norm(q, None, eps=o.eps), F.rms_norm(k, None, eps=o.eps)
        if o.temperature[self.index]:
            scale = 1.0 + o.attn_scale * np.log1p(np.floor((positions + 1.0) / np.float32(o.floor_scale)))
            q = q * Tensor(scale.astype(np.float32).reshape(1, 1, -1, 1), dtype=q.dtype)
        if not self.chunk:
            return super().attend_heads(q, k, v, ctx, **options)
        return self._chunked(q, k, v, ctx, positions.astype(np.int64), options["scale"])

    def _chunked(self, q, k, v, ctx, positions, scale: float):
        """softmax(q k^T * scale + mask) v, the mask hiding later keys, keys of other chunks and padding."""
        batch, heads, new, dim = q.shape
        if ctx.cache is not None:  # store the new keys (the cache's causal output is not used), attend over all
            ctx.cache.attend(self.index, q, k, v, scale=scale, key_padding_mask=ctx.key_padding_mask)
            end = ctx.cache.position + new
            k, v = ctx.cache.keys[self.index][:, :, :end], ctx.cache.values[self.index][:, :, :end]
            key_mask = ctx.cache.mask[:, :end]
        else:
            key_mask = ctx.host_mask
        kv_heads, keys = k.shape[1], k.shape[2]
        group = heads // kv_heads
        k, v = (t.reshape(batch, kv_heads, 1, keys, dim).expand(batch, kv_heads, group, keys, dim).contiguous()
                .reshape(batch, heads, keys, dim) for t in (k, v))
        query_pos, key_pos = positions[None, :, None], np.arange(keys)[None, None, :]
        # chunks start after each row's left padding, as transformers counts them
        start = (np.cumsum(key_mask, axis=1) == 0).sum(1)[:, None, None] if key_mask is not None else 0
        same_chunk = (key_pos - start) // self.chunk == (query_pos - start) // self.chunk
        visible = (key_pos <= query_pos) & same_chunk
        if key_mask is not None:
            visible = visible & key_mask.astype(bool)[:, None, :]
        hidden = Tensor(np.where(visible, 0.0, _HIDDEN).astype(np.float32)[:, None])
        scores = (q @ k.transpose(-1, -2)).float() * scale + hidden
        return scores.softmax(-1).cast(v.dtype) @ v
