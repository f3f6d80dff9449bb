"""DeepSeek-V4 on the shared decoder: hyper-connected residual streams (mHC), compressed attention (CSA / HCA) and
hash-routed experts, composed from engine ops.

transformers 5.24 (DeepseekV4*), under the names its checkpoints and save_pretrained use (attn.wq_a,
ffn.experts.<e>.w1, hc_attn_fn, head, ...):

- Residual stream: hc_mult copies of the hidden state, [B, T, N, D]. Before the attention and before the MLP a
  hyper-connection reads the flattened streams, RMS-normed without weight, through fn [(2 + N) N, N D] (a, a', A):
  pre = sigmoid(a s0 + b) + eps, post = 2 sigmoid(a' s1 + b'), comb = Sinkhorn(softmax(A s2 + B) + eps). The block
  reads sum_n pre_n X_n; the streams become post_n * out + sum_m comb_mn X_m. The hyper head (model.hc_head)
  collapses them the same way (pre only) before the final norm.
- Attention: one KV head whose keys are its values, rope(kv_norm(wkv h)); queries rope(rms(wq_b q_norm(wq_a h))),
  the last norm weightless and per head; interleaved rotary on the trailing qk_rope_head_dim dims, undone on the
  output at the query's position; per-head sinks; a sliding window over the tokens plus compressed entries:
  HCA: one entry per compress_rate tokens, kv_norm(sum over the window of softmax(wgate h + ape) * wkv h), rotated
  at the window's first position; query t sees the entries w < (t + 1) // rate (a single-token forward, a decode
  step, sees them all, as in transformers; they differ where left padding makes positions lag token indices).
  CSA: entry w mixes the first channel half of window w - 1 with the second half of window w (one softmax over
  both); a lightning indexer (its own compressor at index_head_dim, queries wq_b(q_residual), relu scores weighted
  per head by weights_proj) keeps each query's index_topk best causal entries. No gradient reaches the indexer.
  Output: o_groups groups of heads, each projected to o_lora_rank (wo_a), then wo_b.
- Sparse block in every layer: sqrt(softplus) scores; hash layers choose the experts tid2eid[token id] (a
  checkpoint buffer), the others the top-k of scores + the gate.bias buffer; renormalised (+1e-20), scaled; routed
  experts and the shared expert clip gate (max l) and up (+-l) before silu(gate) * up.

The attention kernels know no compressed entries or indexer choices: attention is composed from matmuls, host
masks and one softmax whose last column is the sink logit. With a cache, each layer keeps its attention inputs
(and positions, padding) on the cache object and recomputes keys and compressed entries over them every forward
(the compressed windows need the raw inputs anyway), so decode steps are not captured.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import Linear
from vkformers.models.module import Module, add_param, get_param, place
from vkformers.models.decoder import make_norm

from vkformers_moe import torch_topk
from vkformers_moe.block import MoeSpec, SparseMoeBlock, topk_mask

_HIDDEN = -1e30  # added to the scores of keys a query does not see (finite: the 0/1 concatenation multiplies it)
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class DeepseekV4Layers:
    """The model's options; called with (spec, index, alibi) it builds layer ``index`` (DecoderSpec.make_layer)."""

    layer_types: tuple[str, ...]
    hash_layers: tuple[bool, ...]
    moe: MoeSpec
    hash_moe: MoeSpec
    swiglu_limit: float
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_dim: int
    window: int
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_dim: int
    index_topk: int
    hc_mult: int
    sinkhorn_iters: int
    hc_eps: float

    def __call__(self, spec, index: int, alibi=None) -> "DeepseekV4Layer":
        return DeepseekV4Layer(self, spec, index)


def _hyper_weights(streams, fn, base, scale, eps: float, norm_eps: float):
    """(pre, mixes) of one hyper-connection: mixes = rms(flattened streams) @ fn^T, pre = sigmoid(a s0 + b) + eps."""
    b, t, n, d = streams.shape
    mixes = F.linear(F.rms_norm(streams.reshape(b, t, n * d), None, eps=norm_eps), fn)
    pre = (mixes[..., :n] * scale[0:1] + base[0:n]).sigmoid() + eps
    return pre, mixes


def _collapse(streams, pre):
    b, t, n, d = streams.shape
    return (streams * pre.reshape(b, t, n, 1)).sum(2)


class DeepseekV4Moe(SparseMoeBlock):
    """SparseMoeBlock's router, experts and shared expert with V4's routing and clipped SwiGLU."""

    def __init__(self, moe: MoeSpec, hidden: int, spec, hashed: bool, limit: float):
        super().__init__(moe, hidden, spec)
        self.hashed, self.limit = hashed, limit
        self.table = np.zeros((spec.vocab_size, moe.top_k), np.int64)  # tid2eid, a checkpoint buffer

    def load_buffers(self, arrays, prefix: str) -> None:
        super().load_buffers(arrays, prefix)
        if self.hashed and f"{prefix}.gate.tid2eid" in arrays:
            self.table = np.asarray(arrays[f"{prefix}.gate.tid2eid"]).astype(np.int64)

    def routing_weights(self, x, ids=None):
        moe = self.moe
        scores = F.softplus(self.router(x).float()).sqrt()
        if self.hashed:  # the token's experts come from the table; counted, as transformers adds repeats
            chosen = self.table[np.asarray(ids).reshape(-1)]
            counts = np.zeros((chosen.shape[0], moe.num_experts), np.float32)
            np.add.at(counts, (np.arange(chosen.shape[0])[:, None], chosen), 1.0)
            weights = scores * Tensor(counts)
        else:
            choice = scores.detach() + self.selection_bias.reshape(moe.num_experts)
            weights = F.where(topk_mask(choice, moe.top_k), scores, 0.0)
        return weights / (weights.sum(-1, keepdim=True) + moe.norm_eps) * moe.routed_scale

    def _swiglu(self, mlp, x, live_rows=None):
        """An expert's (or the shared expert's) SwiGLU with V4's clipping; ``live_rows``: see Linear.forward."""
        gate, up, down = mlp.projections
        # minimum/maximum rather than Tensor.clamp, whose backward multiplies two bool masks (unsupported)
        g, u = gate(x, live_rows).minimum(self.limit), up(x, live_rows).maximum(-self.limit).minimum(self.limit)
        return down(F.silu(g) * u, live_rows)

    def forward(self, h, ids=None):
        lead = h.shape[:-1]
        x = h.reshape(-1, self.hidden)
        weights = self.routing_weights(x, ids).cast(x.dtype)
        out = self._swiglu(self.shared, x) + self.experts_output(x, weights, self._swiglu)
        return out.reshape(*lead, self.hidden)


class DeepseekV4Layer(Module):
    """One block on the hyper-connected streams: its hyper-connections, attention and sparse block."""

    capture_decode = False  # the keys are recomputed from inputs kept on the cache object, on the host's schedule

    def __init__(self, options: DeepseekV4Layers, spec, index: int):
        super().__init__()
        o, d, heads, dim = options, spec.hidden_size, spec.num_heads, spec.head_dim
        self.options, self.spec, self.index, self.kind = o, spec, index, o.layer_types[index]
        object.__setattr__(self, "parts", {})

        def add(role, path, module):
            self.parts[role] = place(self, path, module)

        def linear(role, path, n_in, n_out):
            add(role, path, Linear(n_in, n_out, bias=False))

        def compressor(role, path, width, size):  # the softmax-gated pooling of wkv over each window
            linear(f"{role}_wkv", f"{path}.wkv", d, width)
            linear(f"{role}_wgate", f"{path}.wgate", d, width)
            add(f"{role}_norm", f"{path}.norm", make_norm(spec, size))
            add_param(self, f"{path}.ape", (self.rate, width))
            self.ape[role] = f"{path}.ape"

        self.rate = {SLIDING: 0, CSA: o.csa_rate, HCA: o.hca_rate}[self.kind]
        self.ape = {}
        add("attn_norm", "attn_norm", make_norm(spec, d))
        add("ffn_norm", "ffn_norm", make_norm(spec, d))
        mixes = (2 + o.hc_mult) * o.hc_mult
        for site in ("attn", "ffn"):
            add_param(self, f"hc_{site}_fn", (mixes, o.hc_mult * d))
            add_param(self, f"hc_{site}_base", (mixes,))
            add_param(self, f"hc_{site}_scale", (3,))
        linear("wq_a", "attn.wq_a", d, o.q_lora_rank)
        add("q_norm", "attn.q_norm", make_norm(spec, o.q_lora_rank))
        linear("wq_b", "attn.wq_b", o.q_lora_rank, heads * dim)
        linear("wkv", "attn.wkv", d, dim)
        add("kv_norm", "attn.norm", make_norm(spec, dim))
        add_param(self, "attn.wo_a.weight", (o.o_groups * o.o_lora_rank, heads * dim // o.o_groups))
        linear("wo_b", "attn.wo_b", o.o_groups * o.o_lora_rank, d)
        add_param(self, "attn.attn_sink", (heads,))
        if self.kind != SLIDING:
            width = 2 * dim if self.kind == CSA else dim  # CSA: two series per token, for this window and the next
            compressor("c", "attn.compressor", width, dim)
        if self.kind == CSA:
            compressor("i", "attn.indexer.compressor", 2 * o.index_dim, o.index_dim)
            linear("i_wq_b", "attn.indexer.wq_b", o.q_lora_rank, o.index_heads * o.index_dim)
            linear("i_weights", "attn.indexer.weights_proj", d, o.index_heads)
        hashed = o.hash_layers[index]
        block = DeepseekV4Moe(o.hash_moe if hashed else o.moe, d, spec, hashed, o.swiglu_limit)
        add("ffn", block.path, block)

    # -- hyper-connections

    def _hyper(self, site, streams):
        """(post, comb, collapsed input) of the attention's or the MLP's hyper-connection."""
        o, (b, t, n, d) = self.options, streams.shape
        base, scale = get_param(self, f"hc_{site}_base"), get_param(self, f"hc_{site}_scale")
        pre, mixes = _hyper_weights(streams, get_param(self, f"hc_{site}_fn"), base, scale, o.hc_eps,
                                    self.spec.norms.eps)
        post = (mixes[..., n:2 * n] * scale[1:2] + base[n:2 * n]).sigmoid() * 2.0
        comb = (mixes[..., 2 * n:] * scale[2:3] + base[2 * n:]).reshape(b, t, n, n).softmax(-1) + o.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + o.hc_eps)  # Sinkhorn: columns, then rows and columns
        for _ in range(o.sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + o.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + o.hc_eps)
        return post, comb, _collapse(streams, pre)

    @staticmethod
    def _expand(post, comb, out, streams):
        b, t, n, d = streams.shape
        return post.reshape(b, t, n, 1) * out.reshape(b, t, 1, d) + comb.transpose(-1, -2) @ streams

    def forward(self, streams, ctx):
        p = self.parts
        post, comb, x = self._hyper("attn", streams)
        streams = self._expand(post, comb, self.attention(p["attn_norm"](x), ctx), streams)
        post, comb, x = self._hyper("ffn", streams)
        return self._expand(post, comb, p["ffn"](p["ffn_norm"](x), ctx.input_ids), streams)

    # -- attention

    def _rotate(self, x, positions, ctx):
        """The interleaved rotary on the trailing rope_dim dims of x [B, heads, T, D] (positions [B, T])."""
        inv_freq, scaling = ctx.rope_tables[self.index]
        nope = x.shape[-1] - self.options.rope_dim
        rotated = F.rope(x[..., nope:].contiguous(), positions, inv_freq, interleaved=True, attention_scaling=scaling)
        return F.cat([x[..., :nope], rotated], -1) if nope else rotated

    def _history(self, h, ctx):
        """(attention inputs of every token so far [B, K, D], their positions [B, K] and padding mask [B, K] on the
        host, index of the first new token). A cache keeps them per layer, restarted at position 0."""
        batch, length, _ = h.shape
        mask = (ctx.host_mask[:, -length:] if ctx.host_mask is not None
                else np.ones((batch, length), np.int64)).astype(bool)
        positions = ctx.host_positions
        if ctx.cache is None:
            return h, positions, mask, 0
        states = ctx.cache.__dict__.setdefault("deepseek_v4_inputs", {})
        if ctx.cache.position == 0:
            states.pop(self.index, None)
        if self.index in states:
            past, past_positions, past_mask = states[self.index]
            h = F.cat([past, h], -2)
            positions, mask = np.concatenate([past_positions, positions], 1), np.concatenate([past_mask, mask], 1)
        states[self.index] = (h, positions, mask)
        return h, positions, mask, h.shape[1] - length

    def _compress(self, h, role, dim, ctx):
        """Compressed entries [B, 1, W, dim] of the complete windows of h [B, K, D], rotated, or None."""
        b, keys, _ = h.shape
        rate, p = self.rate, self.parts
        windows = keys // rate
        if not windows:
            return None
        h = h[:, :windows * rate]
        kv = p[f"{role}_wkv"](h).reshape(b, windows, rate, -1)
        gate = p[f"{role}_wgate"](h).reshape(b, windows, rate, -1) + get_param(self, self.ape[role])
        kv, gate = kv.permute(0, 1, 3, 2), gate.permute(0, 1, 3, 2)  # [B, W, channels, slots]
        if kv.shape[2] != dim:  # CSA: this window's second half with the previous window's first half
            shift = Tensor(np.eye(windows, k=1, dtype=np.float32))  # column w takes row w - 1
            first = Tensor(np.where(np.arange(windows) == 0, _HIDDEN, 0.0).astype(np.float32).reshape(1, windows, 1, 1))
            previous = [(t[:, :, :dim].permute(0, 2, 3, 1) @ shift).permute(0, 3, 1, 2) for t in (kv, gate)]
            kv = F.cat([previous[0], kv[:, :, dim:]], -1)
            gate = F.cat([previous[1] + first, gate[:, :, dim:]], -1)
        entries = p[f"{role}_norm"]((kv * gate.softmax(-1)).sum(-1))  # [B, W, dim]
        starts = np.broadcast_to(np.arange(windows, dtype=np.int32) * rate, (b, windows)).copy()
        return self._rotate(entries.reshape(b, 1, windows, dim), Tensor(starts), ctx)

    def _indexer_choice(self, h_all, h, q_residual, query_positions, ctx, visible):
        """[B, 1, T, W] bool: each query's index_topk causal entries with the best indexer scores (no gradient)."""
        o, p = self.options, self.parts
        b, t, _ = h.shape
        keys = self._compress(h_all, "i", o.index_dim, ctx)  # [B, 1, W, index_dim]
        windows = keys.shape[2]
        q = p["i_wq_b"](q_residual).reshape(b, t, o.index_heads, o.index_dim).permute(0, 2, 1, 3)
        q = self._rotate(q, query_positions, ctx)
        keys = keys.expand(b, o.index_heads, windows, o.index_dim).contiguous()
        scores = (q @ keys.transpose(-1, -2)).relu() * (o.index_dim ** -0.5)  # [B, heads, T, W]
        weights = (p["i_weights"](h) * (o.index_heads ** -0.5)).permute(0, 2, 1).reshape(b, o.index_heads, t, 1)
        scores = np.where(visible, (scores * weights).sum(1).numpy(), -np.inf)  # [B, T, W], read back
        # the host picks exactly k per query, equal scores as torch.topk picks them (relu scores often tie at 0)
        chosen = torch_topk.topk_mask(scores, min(o.index_topk, windows))
        return Tensor((chosen & visible)[:, None])

    def attention(self, h, ctx):
        o, s, p = self.options, self.spec, self.parts
        b, t, _ = h.shape
        heads, dim = s.num_heads, s.head_dim
        h_all, key_positions, key_mask, start = self._history(h, ctx)
        keys = h_all.shape[1]
        query_positions = Tensor(key_positions[:, start:].astype(np.int32))
        q_residual = p["q_norm"](p["wq_a"](h))
        q = p["wq_b"](q_residual).reshape(b, t, heads, dim).permute(0, 2, 1, 3)
        q = self._rotate(F.rms_norm(q, None, eps=s.norms.eps), query_positions, ctx)
        kv = p["kv_norm"](p["wkv"](h_all)).reshape(b, 1, keys, dim)
        kv = self._rotate(kv, Tensor(key_positions.astype(np.int32)), ctx).expand(b, heads, keys, dim).contiguous()

        index = start + np.arange(t)  # the queries' token indices
        j = np.arange(keys)
        visible = (j <= index[:, None]) & (index[:, None] - j < o.window)
        visible = visible[None] & key_mask[:, None, :]  # [B, T, K]
        scale = dim ** -0.5
        parts = [(q @ kv.transpose(-1, -2)) * scale + Tensor(np.where(visible, 0.0, _HIDDEN)[:, None]
                                                              .astype(np.float32))]
        values = [kv]
        entries = self._compress(h_all, "c", dim, ctx) if self.rate else None
        if entries is not None:
            windows = entries.shape[2]
            entries = entries.expand(b, heads, windows, dim).contiguous()
            causal = np.arange(windows) < ((key_positions[:, start:] + 1) // self.rate)[:, :, None]  # [B, T, W]
            if t == 1 and self.kind == HCA:
                # transformers masks HCA entries by position only for a forward of several tokens: a single token
                # (a decode step) sees every entry, even where left padding puts its position behind its index
                causal = np.ones_like(causal)
            scores = (q @ entries.transpose(-1, -2)) * scale
            if self.kind == CSA:
                scores = F.where(self._indexer_choice(h_all, h, q_residual, query_positions, ctx, causal),
                                 scores, _HIDDEN)
            else:
                scores = scores + Tensor(np.where(causal, 0.0, _HIDDEN)[:, None].astype(np.float32))
            parts.append(scores)
            values.append(entries)
        sinks = get_param(self, "attn.attn_sink").float().reshape(1, heads, 1, 1).expand(b, heads, t, 1)
        probs = F.cat([*parts, sinks], -1).softmax(-1)
        out, offset = None, 0
        for v in values:
            size = v.shape[2]
            term = probs[..., offset:offset + size].contiguous() @ v
            out, offset = term if out is None else out + term, offset + size
        out = self._rotate(out, -query_positions, ctx)  # keys are the values: undo their rotation at the query
        return self._grouped_output(out)

    def _grouped_output(self, out):
        """wo_b(cat over groups g of heads_g @ wo_a_g^T): each group of heads projected to o_lora_rank first."""
        o, p = self.options, self.parts
        b, heads, t, dim = out.shape
        groups, rank = o.o_groups, o.o_lora_rank
        width = heads * dim // groups
        x = out.permute(0, 2, 1, 3).reshape(b * t, groups, width).permute(1, 0, 2)  # [G, B T, width]
        weight = get_param(self, "attn.wo_a.weight").reshape(groups, rank, width).transpose(-1, -2)
        y = (x.contiguous() @ weight.contiguous()).permute(1, 0, 2).reshape(b, t, groups * rank)
        return p["wo_b"](y)
