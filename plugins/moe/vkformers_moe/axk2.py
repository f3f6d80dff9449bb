"""DeepSeek-V3.2's sparse attention (DSA) on the shared decoder layer's MLA, and A.X-K2's deltas on it (a gated
query projection and gated RMS norms).

deepseek_v32 and glm_moe_dsa configs (aliases of deepseek_v3) use the layer with gate_rank 0: the plain MLA q_b_proj
of q_a_layernorm(q_a), no gates. glm_moe_dsa rotates the indexer's interleaved pairs, and its "shared" layers
(indexer_types) have no indexer: they reuse the key selection of the previous layer.

transformers 5 (AXK2Attention, DeepseekV32Indexer, AXK2GatedRMSNorm):

- q_b_proj (named q_gate_proj in memory) maps [q_a_layernorm(q_a) | q_a] to each head's query and a gate of
  v_head_dim; the attention output is multiplied by sigmoid(gate) before o_proj.
- The indexer scores every visible key t for query s: sum_h w[s, h] relu(q_h[s] . k[t] / sqrt(D)), q_h from
  wq_b(q_a_layernorm(q_a)), k = LayerNorm(wk(x)) (one key head), both rotated rotate_half on their first
  qk_rope_head_dim dims, w = weights_proj(x) / sqrt(heads). Each query attends to its index_topk best keys only.
  The indexer runs without gradient (its parameters get none).
- input_layernorm, and post_attention_layernorm of the sparse layers, are RMS norms whose output y is scaled by
  sigmoid(W_up(silu(W_down(y)))).

The attention kernels know no per-query key selection: the layer composes its attention from matmuls, a host mask
(causal, padding and the selection) and a softmax, over the stored keys with a cache. The selection is read back to
the host, where numpy picks the top-k; the indexer's keys of the stored tokens are kept on the cache object. So
generate does not capture these decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import LayerNorm, Linear
from vkformers.models.module import join_path, place
from vkformers.models.decoder import DecoderLayer

_HIDDEN = -1e30  # added to the scores of keys a query does not see


@dataclass(frozen=True)
class Axk2Attention:
    """The model's DSA and gate sizes; called with (spec, index, alibi) it builds a layer (DecoderSpec.make_layer)."""

    index_topk: int
    index_heads: int
    index_dim: int
    gate_rank: int = 0                         # A.X-K2's gated query and norms; 0: DeepSeek-V3.2's plain MLA
    index_rope_interleaved: bool = False       # GLM-5's indexer rotates interleaved pairs, DeepSeek-V3.2's halves
    shared_index: tuple[bool, ...] = ()        # GLM-5: layers reusing the previous layer's selection

    def __call__(self, spec, index: int, alibi=None) -> "Axk2Layer":
        return Axk2Layer(self, spec, index, alibi)


def select_keys(scores: np.ndarray, visible: np.ndarray, k: int) -> np.ndarray:
    """[B, S, T] bool: of the visible keys, the k with the largest index scores (all of them when k or fewer)."""
    if scores.shape[-1] <= k:
        return visible
    ranked = np.where(visible, scores, -np.inf)
    best = np.argpartition(-ranked, k - 1, axis=-1)[..., :k]
    keep = np.zeros(visible.shape, bool)
    np.put_along_axis(keep, best, True, axis=-1)
    return keep & visible


class Axk2Layer(DecoderLayer):
    """The shared MLA layer with DSA key selection (and A.X-K2's gated query projection and gated norms)."""

    capture_decode = False  # the selection is made on the host each step

    def __init__(self, options: Axk2Attention, spec, index: int, alibi=None):
        sparse = spec.moe is not None and spec.moe.layers[index]
        gated = {"attn_in_norm": spec.attn_in_norm, **({"mlp_in_norm": spec.mlp_in_norm} if sparse else {})}
        if not options.gate_rank:
            gated = {}
        layer = replace(spec, attention=replace(spec.attention, output_gate_per_head=False),
                        **{role: join_path(path, "norm") for role, path in gated.items()})
        self.options = options  # before the shared layer's __init__, which calls _init_mla
        self.shares_index = index < len(options.shared_index) and options.shared_index[index]
        super().__init__(layer, index, alibi)
        s, d = self.spec, spec.hidden_size
        object.__setattr__(self, "norm_gates", {
            role: (place(self, join_path(path, "W_down"), Linear(d, options.gate_rank, bias=False)),
                   place(self, join_path(path, "W_up"), Linear(options.gate_rank, d, bias=False)))
            for role, path in gated.items()})
        object.__setattr__(self, "_index_scores", None)
        if self.shares_index:
            return
        indexer, heads, dim = join_path(s.attention.path, "indexer"), options.index_heads, options.index_dim
        self.parts["index_q"] = place(self, join_path(indexer, "wq_b"),
                                      Linear(s.mla.q_lora_rank, heads * dim, bias=False))
        self.parts["index_k"] = place(self, join_path(indexer, "wk"), Linear(d, dim, bias=False))
        self.parts["index_k_norm"] = place(self, join_path(indexer, "k_norm"), LayerNorm(dim, eps=1e-6))
        self.parts["index_w"] = place(self, join_path(indexer, "weights_proj"), Linear(d, heads, bias=False))

    def _init_mla(self, add):
        s = self.spec
        if not self.options.gate_rank:
            return super()._init_mla(add)

        def gated_query(role, path, module):  # q_b_proj reads [normed q_a | q_a] and gives query and gate per head
            if role == "q_b":
                module = Linear(2 * s.mla.q_lora_rank, s.num_heads * (s.mla.nope_dim + s.mla.rope_dim + s.mla.v_dim),
                                bias=False)
            add(role, path, module)
        super()._init_mla(gated_query)

    def _norm(self, role, x):
        y = super()._norm(role, x)
        if role not in self.norm_gates:
            return y
        down, up = self.norm_gates[role]
        return y * up(F.silu(down(y))).sigmoid()

    def attention(self, h, ctx):
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        heads, qk, vdim = s.num_heads, s.mla.nope_dim + s.mla.rope_dim, s.mla.v_dim
        compressed = p["q_a"](h)
        residual = p["q_a_norm"](compressed)
        gate = None
        if self.options.gate_rank:
            both = p["q_b"](F.cat([residual, compressed], -1)).reshape(batch, length, heads, qk + vdim)
            q = both[..., :qk].contiguous().reshape(batch, length, heads * qk)
            gate = both[..., qk:].contiguous().reshape(batch, length, heads * vdim).sigmoid()
        else:
            q = p["q_b"](residual)
        q, k, v = self._mla_qkv(h, ctx, q=q)
        if not self.shares_index:
            object.__setattr__(self, "_index_scores", self._index(h.detach(), residual.detach(), ctx))
        return self._attend(q, k, v, ctx, batch, length, gate)

    def _index(self, h, residual, ctx):
        """The indexer's scores [B, S, T] of the new queries over every key (stored ones included)."""
        s, p, o = self.spec, self.parts, self.options
        batch, length, _ = h.shape
        heads, dim, rdim = o.index_heads, o.index_dim, s.mla.rope_dim
        inv_freq, scaling = ctx.rope_tables[self.index]

        def rotate(x):  # rotate_half (DeepSeek-V3.2) or interleaved pairs (GLM-5) on the first rdim dims
            turned = F.rope(x[..., :rdim].contiguous(), ctx.rope_positions, inv_freq,
                            interleaved=o.index_rope_interleaved, attention_scaling=scaling)
            return F.cat([turned, x[..., rdim:]], -1) if rdim < dim else turned

        q = rotate(p["index_q"](residual).reshape(batch, length, heads, dim).permute(0, 2, 1, 3))
        k = rotate(p["index_k_norm"](p["index_k"](h)).reshape(batch, 1, length, dim))
        if ctx.cache is not None:  # keys of the stored tokens, kept on the cache object
            stored = ctx.cache.__dict__.setdefault("index_keys", {})
            if ctx.cache.position == 0:
                stored.pop(self.index, None)
            keys = k.numpy()
            if self.index in stored:
                keys = np.concatenate([stored[self.index], keys], axis=2)
            stored[self.index] = keys
            k = Tensor(keys, dtype=q.dtype)
        total = k.shape[2]
        k = k.expand(batch, heads, total, dim).contiguous()
        scores = ((q @ k.transpose(-1, -2)).float() * dim ** -0.5).relu()  # [B, heads, S, T]
        weights = (p["index_w"](h).float() * heads ** -0.5).permute(0, 2, 1).contiguous()
        weights = weights.reshape(batch, heads, length, 1)
        return (scores * weights).sum(1)

    def _select_keys(self, visible, key_mask):
        """[B, S, T] bool: the keys each query attends to, from the indexer's output (self._index_scores)."""
        return select_keys(self._index_scores.numpy(), visible, self.options.index_topk)

    def attend_heads(self, q, k, v, ctx, **options):
        """softmax(q k^T * scale + mask) v, the mask hiding later keys, padding and the keys the indexer drops."""
        batch, heads, new, _ = q.shape
        if ctx.cache is not None:  # store the new keys (the cache's causal output is not used), attend over all
            ctx.cache.attend(self.index, q, k, v, scale=options["scale"], key_padding_mask=ctx.key_padding_mask)
            end = ctx.cache.position + new
            k, v = ctx.cache.keys[self.index][:, :, :end], ctx.cache.values[self.index][:, :, :end]
            key_mask = ctx.cache.mask[:, :end]
        else:
            key_mask = ctx.host_mask
        keys = k.shape[2]
        visible = np.arange(keys)[None, None, :] <= (keys - new + np.arange(new))[None, :, None]
        if key_mask is not None:
            visible = visible & key_mask.astype(bool)[:, None, :]
        visible = np.broadcast_to(visible, (batch, new, keys))
        if self.shares_index:  # the selection of the previous layer (GLM-5's shared layers)
            keep = ctx.dsa_keep
        else:
            keep = self._select_keys(visible, key_mask)
            ctx.dsa_keep = keep
        object.__setattr__(self, "_index_scores", None)
        hidden = Tensor(np.where(keep, 0.0, _HIDDEN).astype(np.float32)[:, None])
        scores = (q @ k.transpose(-1, -2)).float() * options["scale"] + hidden
        return scores.softmax(-1).cast(v.dtype) @ v
