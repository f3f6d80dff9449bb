"""MiniMax-M3's deltas on the shared decoder layer: lightning-indexer block-sparse attention, clipped SwiGLU MLP.

transformers 5 (MiniMaxM3VLAttention / MiniMaxM3VLIndexer): on the layers of type "minimax_m3_sparse" an indexer
scores every key for every query with its own small heads (q_proj [index_n_heads * index_head_dim], one shared key
k_proj [index_head_dim], (1 + w) RMS norms, rotary on the first dims of the main rotary table), no scaling. Keys whose
slot lies after the query's position score -inf; the scores are max-pooled over blocks of index_block_size keys
(counted from key slot 0); the block of the query's position and the index_local_blocks - 1 before it score +inf
(slots and positions differ in a left-padded row under generate, whose positions count only real tokens); the top
index_topk_blocks blocks of finite score are kept. Query head h attends only to the keys of the blocks its indexer
head h // (heads / index_n_heads) kept, on top of the causal and padding mask. The selection has no gradient (top-k
indices), so the indexer's weights get none. Dense MLPs (fused gate_up_proj) use GPT-OSS's clipped SwiGLU, as the experts do.

The attention kernels know no such mask: a sparse layer composes its attention from matmuls, the selection (block
maxima on the device, the top-k on the host, equal scores resolved as torch.topk does: vkformers_moe.torch_topk) and
a softmax, over the stored keys with a cache.
The indexer's keys of earlier tokens live on the cache object (``cache.index_keys``), so generate does not capture
these models' decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import Linear
from vkformers.models.lazy_weights import LazyWeights, concatenated, stacked
from vkformers.models.module import join_path, place
from vkformers.models.decoder import DecoderLayer, make_norm

from vkformers_moe import torch_topk
from vkformers_moe.block import clipped_swiglu

_HIDDEN = -1e30  # a score no kept key has (finite: 0 * it stays 0 in the matmul concatenations)


@dataclass(frozen=True)
class MinimaxM3Attention:
    """The per-layer options; called with (spec, index, alibi) it builds a layer (DecoderSpec.make_layer)."""

    sparse: tuple[bool, ...]          # per layer: lightning-indexer block-sparse attention
    index_heads: int = 4
    index_dim: int = 128
    block: int = 128
    topk_blocks: int = 16
    local_blocks: int = 1
    swiglu_clip: tuple[float, float] = (1.702, 7.0)  # (alpha, limit) of the dense MLPs' clipped SwiGLU
    indexer: str = "indexer"          # inside the attention module

    def __call__(self, spec, index: int, alibi=None) -> "MinimaxM3Layer":
        return MinimaxM3Layer(self, spec, index, alibi)


# MiniMax's release layout (as transformers 5.24 also saves the minimax_m3_vl wrapper) -> the text model's names, as
# transformers' conversion for it renames them; split gate / up and per-expert w1 / w3 / w2 are fused after
RELEASE_RENAMES = (("self_attn.index_q_proj.", "self_attn.indexer.q_proj."),
                   ("self_attn.index_k_proj.", "self_attn.indexer.k_proj."),
                   ("self_attn.index_q_norm.", "self_attn.indexer.q_norm."),
                   ("self_attn.index_k_norm.", "self_attn.indexer.k_norm."),
                   ("block_sparse_moe.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
                   ("block_sparse_moe.", "mlp."))


class MinimaxM3Layer(DecoderLayer):
    """The shared decoder layer with MiniMax-M3's dense MLP and, on sparse layers, its block-sparse attention."""

    capture_decode = False  # the indexer keys grow on the cache object; the masks are built from the position

    def __init__(self, options: MinimaxM3Attention, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        self.options, self.sparse = options, options.sparse[index]
        self._selection = None
        if self.sparse:
            s, o, d = self.spec, options, spec.hidden_size
            path = join_path(s.attention.path, o.indexer)
            for role, name, module in (("index_q", "q_proj", Linear(d, o.index_heads * o.index_dim, bias=False)),
                                       ("index_k", "k_proj", Linear(d, o.index_dim, bias=False)),
                                       ("index_q_norm", "q_norm", make_norm(s, o.index_dim)),
                                       ("index_k_norm", "k_norm", make_norm(s, o.index_dim))):
                self.parts[role] = place(self, join_path(path, name), module)

    def convert_checkpoint(self, arrays: LazyWeights, path: str) -> LazyWeights:
        """A file in MiniMax's release layout (RELEASE_RENAMES; gate_proj + up_proj, experts.<e>.w1 / w3 / w2) gets
        this layer's names (fused gate_up_proj [gate | up], experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I]).
        Returns ``arrays``, or a copy with this layer's tensors renamed (fused and stacked when read)."""
        prefix = f"{path}."
        mine = [n[len(prefix):] for n in arrays if n.startswith(prefix)]
        if not any(n.startswith(old) for n in mine for old, _ in RELEASE_RENAMES) and \
                not any(n.endswith((".gate_proj.weight", ".w1.weight")) for n in mine):
            return arrays
        renamed = {}
        for name in mine:
            old, new = next(((o, r) for o, r in RELEASE_RENAMES if name.startswith(o)), ("", ""))
            renamed[new + name[len(old):]] = arrays.weight(prefix + name)
        for gate in [n for n in renamed if n.endswith(".gate_proj.weight")]:  # dense MLP, shared experts
            up = gate[:-len("gate_proj.weight")] + "up_proj.weight"
            if up in renamed:
                fused = concatenated([renamed.pop(gate), renamed.pop(up)], axis=0)
                renamed[gate[:-len("gate_proj.weight")] + "gate_up_proj.weight"] = fused
        moe = self.spec.moe
        experts = join_path(self.spec.mlp.path, moe.experts) if moe and moe.fused_experts else None
        count = sum(1 for n in renamed if experts and n.startswith(f"{experts}.") and n.endswith(".w1.weight"))
        if count:
            w = {k: [renamed.pop(f"{experts}.{e}.{k}.weight") for e in range(count)] for k in ("w1", "w3", "w2")}
            gate_up, down = moe.fused_experts
            renamed[f"{experts}.{gate_up}"] = stacked([concatenated(p, axis=0) for p in zip(w["w1"], w["w3"])])
            renamed[f"{experts}.{down}"] = stacked(w["w2"])
        return arrays.filtered(lambda n: not n.startswith(prefix)).updated({prefix + n: w for n, w in renamed.items()})

    def mlp(self, h):
        if "gate_up" not in self.parts:  # the sparse block (its experts clip likewise: MoeSpec.swiglu_clip)
            return super().mlp(h)
        both, inner = self.parts["gate_up"](h), self.spec.intermediate_size
        return self.parts["down"](clipped_swiglu(both[..., :inner], both[..., inner:], self.options.swiglu_clip))

    def attention(self, h, ctx):
        if not self.sparse:
            return super().attention(h, ctx)
        self._selection = self._select(h, ctx)
        try:
            return super().attention(h, ctx)
        finally:
            self._selection = None

    def attend_heads(self, q, k, v, ctx, **options):
        if self._selection is None:
            return super().attend_heads(q, k, v, ctx, **options)
        kept, queries, keys = self._selection
        batch, heads, new, dim = q.shape
        key_mask = ctx.host_mask
        if ctx.cache is not None:  # store the new keys (the cache's causal output is not used), attend over all
            ctx.cache.attend(self.index, q, k, v, scale=options["scale"], key_padding_mask=ctx.key_padding_mask)
            k, v = ctx.cache.keys[self.index][:, :, :keys], ctx.cache.values[self.index][:, :, :keys]
            key_mask = ctx.cache.mask[:, :keys]
        kv_heads = k.shape[1]
        group = heads // kv_heads
        k, v = (t.reshape(batch, kv_heads, 1, keys, dim).expand(batch, kv_heads, group, keys, dim).contiguous()
                .reshape(batch, heads, keys, dim) for t in (k, v))
        visible = np.arange(keys)[None, None, :] <= queries[None, :, None]
        if key_mask is not None:
            visible = visible & key_mask.astype(bool)[:, None, -keys:]
        visible = np.broadcast_to(visible[:, None], (batch, heads, new, keys))
        hidden = F.where(kept, Tensor(np.where(visible, 0.0, _HIDDEN).astype(np.float32)), _HIDDEN)
        scores = (q @ k.transpose(-1, -2)).float() * options["scale"] + hidden
        return scores.softmax(-1).cast(v.dtype) @ v

    # -- the lightning indexer

    def _select(self, h, ctx):
        """(kept [B, H, T, keys] bool, query positions, keys): the keys each query head may see (by its selection;
        the causal and padding mask come on top)."""
        o, p = self.options, self.parts
        batch, new, _ = h.shape
        past = ctx.cache.position if ctx.cache is not None else 0
        keys = past + new
        queries = past + np.arange(new)
        q = p["index_q_norm"](p["index_q"](h).reshape(batch, new, o.index_heads, o.index_dim)).permute(0, 2, 1, 3)
        k = p["index_k_norm"](p["index_k"](h).reshape(batch, new, 1, o.index_dim)).permute(0, 2, 1, 3)
        inv_freq, scaling = ctx.rope_tables[self.index]
        q = F.rope(q, ctx.rope_positions, inv_freq, interleaved=self.spec.positions.rope_interleaved,
                   attention_scaling=scaling)
        k = F.rope(k, ctx.rope_positions, inv_freq, interleaved=self.spec.positions.rope_interleaved,
                   attention_scaling=scaling)
        k = k.detach().transpose(-1, -2)  # [B, 1, D, new]
        if ctx.cache is not None:
            stored = ctx.cache.__dict__.setdefault("index_keys", {})
            if past == 0:
                stored.pop(self.index, None)
            if self.index in stored:
                k = F.cat([stored[self.index], k], -1)
            stored[self.index] = k
        blocks = -(-keys // o.block)
        width = blocks * o.block
        if width > keys:  # whole blocks: the padding keys lie after every query, hidden below
            k = F.cat([k, Tensor(np.zeros((batch, 1, o.index_dim, width - keys), np.float32), dtype=k.dtype)], -1)
        # As transformers: key slots are compared with the query's position (its slot only without left padding;
        # generate's positions count a row's real tokens), and the query's own block is its position's.
        positions = np.broadcast_to(ctx.host_positions, (batch, new))[:, None, :, None]  # [B, 1, T, 1]
        future = np.arange(width) > positions
        scores = (q.detach() @ k).float() + Tensor(np.where(future, _HIDDEN, 0.0).astype(np.float32))
        pooled = scores.reshape(batch, o.index_heads, new, blocks, o.block).max(-1)
        own, block = positions // o.block, np.arange(blocks)
        local = (block <= own) & (block > own - o.local_blocks)  # [B, 1, T, blocks]
        # the choice on the host, as torch.topk makes it: blocks of left padding tie (the pads' keys are equal)
        pooled = pooled.numpy()
        pooled = np.where(pooled > _HIDDEN / 2, pooled, -np.inf)  # blocks all in the query's future
        if o.local_blocks > 0:
            pooled = np.where(local, np.inf, pooled)
        chosen = torch_topk.topk_mask(pooled, min(o.topk_blocks, blocks)) & (pooled > -np.inf)
        kept = Tensor(chosen.astype(np.float32))
        heads = self.spec.num_heads
        kept = (kept.reshape(batch, o.index_heads, new, blocks, 1)
                .expand(batch, o.index_heads, new, blocks, o.block).contiguous()
                .reshape(batch, o.index_heads, new, width)[..., :keys].contiguous()
                .reshape(batch, o.index_heads, 1, new, keys)
                .expand(batch, o.index_heads, heads // o.index_heads, new, keys).contiguous()
                .reshape(batch, heads, new, keys))
        return kept > 0.5, queries, keys
