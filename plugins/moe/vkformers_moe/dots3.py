"""dots3-note's text decoder (transformers 5 Dots3NoteTextAttention) on A.X-K2's DSA layer (axk2.py).

- Each layer's MLA has its own sizes (per_layer_config: heads, q / kv LoRA ranks, nope / rope / v head dims), its
  own rotary (rope_parameters per layer type) and a softmax scale of its qk head dim.
- The normed q LoRA is scaled by sqrt(hidden / q_lora_rank) (the indexer reads it scaled too), the normed kv latent
  by sqrt(hidden / kv_lora_rank); the shared rotary key part has its own RMSNorm before the rotation.
- A sigmoid gate per head, g_proj of the layer input, scales the attention output before o_proj.
- "indexed_attention" layers select each query's index_topk keys with GLM-5's indexer (interleaved rotary);
  "sliding_attention" layers see the sliding_window last keys; "full_attention" layers all earlier keys.

A layer's keys and values differ in shape from the others', so the KV cache holds them flattened: one head of
``cache_width`` (the widest layer's heads x head size), each layer's [heads x head size] padded to it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import Linear
from vkformers.models.module import join_path, place

from vkformers_moe.axk2 import Axk2Attention, Axk2Layer, select_keys

_HIDDEN = -1e30  # added to the scores of keys a query does not see


@dataclass(frozen=True)
class Dots3Attention(Axk2Attention):
    """The per-layer specs (``layer_specs[i]``: the DecoderSpec layer i is built with) and which layers run the
    indexer; called with (spec, index, alibi) it builds a layer (DecoderSpec.make_layer)."""

    layer_specs: tuple = ()
    indexed: tuple[bool, ...] = ()
    q_scales: tuple[float, ...] = ()
    cache_width: int = 0

    def __call__(self, spec, index: int, alibi=None) -> "Dots3Layer":
        return Dots3Layer(self, self.layer_specs[index], index, alibi)


class Dots3Layer(Axk2Layer):
    """A.X-K2's layer without its gates, with dots3-note's scaled q LoRA, per-head output gate and per-layer
    sizes; the indexer only on indexed layers."""

    def __init__(self, options: Dots3Attention, spec, index: int, alibi=None):
        super().__init__(options, spec, index, alibi)
        self.indexed = options.indexed[index]
        self.q_scale = options.q_scales[index]
        self.parts["head_gate"] = place(self, join_path(spec.attention.path, "g_proj"),
                                        Linear(spec.hidden_size, spec.num_heads, bias=False))

    def attention(self, h, ctx):
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        residual = p["q_a_norm"](p["q_a"](h)) * self.q_scale
        q, k, v = self._mla_qkv(h, ctx, q=p["q_b"](residual))
        if self.indexed:
            object.__setattr__(self, "_index_scores", self._index(h.detach(), residual.detach(), ctx))
        gate = p["head_gate"](h).sigmoid().reshape(batch, length, s.num_heads, 1)
        gate = gate.expand(batch, length, s.num_heads, s.mla.v_dim).reshape(batch, length, s.num_heads * s.mla.v_dim)
        return self._attend(q, k, v, ctx, batch, length, gate)

    def _through_cache(self, k, v, ctx):
        """Store this step's k, v [B, H, T, D] flattened into the cache; every stored key and value so far."""
        batch, heads, new, dim = k.shape
        width, used = ctx.cache.head_dim, heads * dim

        def flat(t):
            t = t.permute(0, 2, 1, 3).contiguous().reshape(batch, 1, new, used)
            if used < width:
                t = F.cat([t, Tensor(np.zeros((batch, 1, new, width - used), np.float32), dtype=t.dtype)], -1)
            return t

        flat_k = flat(k)
        ctx.cache.attend(self.index, flat_k, flat_k, flat(v), key_padding_mask=ctx.key_padding_mask)  # stores
        end = ctx.cache.position + new

        def unflat(stored):
            part = stored[:, :, :end, :used].cast(k.dtype).contiguous()
            return part.reshape(batch, end, heads, dim).permute(0, 2, 1, 3).contiguous()

        return unflat(ctx.cache.keys[self.index]), unflat(ctx.cache.values[self.index])

    def attend_heads(self, q, k, v, ctx, **options):
        """softmax(q k^T * scale + mask) v, the mask hiding later keys, padding, keys past the window, and on
        indexed layers the keys the indexer drops."""
        batch, heads, new, _ = q.shape
        if ctx.cache is not None:
            k, v = self._through_cache(k, v, ctx)
            key_mask = ctx.cache.mask[:, :k.shape[2]]
        else:
            key_mask = ctx.host_mask
        keys = k.shape[2]
        at = keys - new + np.arange(new)
        columns = np.arange(keys)[None, :]
        visible = columns <= at[:, None]
        if self.window:
            visible = visible & (columns > at[:, None] - self.window)
        visible = visible[None]
        if key_mask is not None:
            visible = visible & key_mask.astype(bool)[:, None, :]
        visible = np.broadcast_to(visible, (batch, new, keys))
        keep = select_keys(self._index_scores.numpy(), visible, self.options.index_topk) if self.indexed else visible
        object.__setattr__(self, "_index_scores", None)
        hidden = Tensor(np.where(keep, 0.0, _HIDDEN).astype(np.float32)[:, None])
        scores = (q @ k.transpose(-1, -2)).float() * options["scale"] + hidden
        return scores.softmax(-1).cast(v.dtype) @ v
