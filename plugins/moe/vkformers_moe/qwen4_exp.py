"""Qwen4-Exp's text decoder on the shared decoder layer: gated-residual streams, PLE and QSA, composed from engine ops.

transformers 5.24 (Qwen4ExpText*), under the names its checkpoints use; Qwen3.5-MoE's layers otherwise (Gated
DeltaNet on linear_attention layers, gated attention with (1 + w) per-head q/k norms, softmax experts with a
sigmoid-gated shared expert in every layer), but no input / post-attention / final norms:

- Residual stream: hc_count copies of the hidden state, flattened [B, T, N D]. Before the attention and before the
  MLP a gated residual (attn_ / mlp_hyper_connection) RMS-normalises each stream ((1 + w) over N D), reads
  mean_n(sigmoid(up(silu(down(y) / N))) * y) as the block input and adds the block output to stream n scaled by
  2 sigmoid(block_inject_weight(y) / N)_n. model.hyper_connection_mixer (no injection) collapses the streams into
  the hidden state the lm_head reads.
- PLE (ple_layer_ids, 1-based, linear layers only), added to the streams before the layer's gated residual: per
  token, hashed n-gram ids (orders 2..ngram_size, heads_per_ngram heads each: the token and the ones before it,
  within the segment after the last eos, multiplied by per-layer odd constants, xor-ed, modulo a prime per head)
  index one embedding table (stored in split_ngram_parts row shards). value = value_proj(e); per stream a key
  norm_key(key_proj(e)) gates it by sigmoid(signed sqrt(<key, norm_query(streams)> / sqrt(D))); the result plus
  silu(a depthwise conv of norm_conv(result), kernel ple_conv_kernel_size, dilation ngram_size). Padding tokens
  hash as eos and add nothing.
- QSA on indexed (full) attention layers: index_qk_proj gives indexer_n_heads query heads (q_layernorm, rotary)
  and one raw key per token; the visible tokens of a query are cut into blocks of indexer_compress_ratio, each
  block's mean key is normed (k_layernorm) and rotated at the block's first position; relu scores summed over the
  heads pick the indexer_budget / ratio best complete blocks, and the incomplete tail is always kept. The query
  attends to those tokens only. The selection has no gradient (top-k indices), so the indexer's weights get none.

The hashing and the selection (from indexer queries and keys read back) run on the host with numpy; the attention
kernels know no such mask, so an indexed layer composes its attention from matmuls, the host mask and a softmax,
over the stored keys with a cache. PLE's token context and conv inputs, and the indexer's raw keys and positions,
live on the cache object, so generate does not capture these decode steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import Linear
from vkformers.models.module import Module, add_param, get_param, join_path, place
from vkformers.models.decoder import DecoderLayer, make_norm


_HIDDEN = -1e30  # added to the scores of keys a query does not see


@dataclass(frozen=True)
class Qwen4ExpLayers:
    """The model's options; called with (spec, index, alibi) it builds layer ``index`` (DecoderSpec.make_layer)."""

    hc_count: int
    hc_lowrank: int
    ple_index: tuple            # per layer: its index among the PLE layers, or None
    ple_dim: int
    ple_kernel: int
    ngram_size: int
    heads_per_ngram: int
    ngram_base: int
    ngram_divisor: int
    ngram_shards: int
    seed: int
    eos: int
    index_heads: int = 0        # 0: no QSA (plain causal attention on the attention layers)
    index_dim: int = 0
    budget: int = 0
    ratio: int = 1

    def __call__(self, spec, index: int, alibi=None) -> "Qwen4ExpLayer":
        return Qwen4ExpLayer(self, spec, index, alibi)


# -- streams

class StreamNorm(Module):
    """(1 + w) RMS norm of each of the n streams of [B, T, n D] (transformers' group_size D)."""

    def __init__(self, n: int, d: int, eps: float):
        super().__init__()
        self.n, self.d, self.eps = n, d, eps
        self.param("weight", (n * d,))

    def forward(self, x):
        b, t, _ = x.shape
        y = F.rms_norm(x.reshape(b, t, self.n, self.d), None, eps=self.eps).reshape(b, t, self.n * self.d)
        return y * (self.weight + 1.0)


class GatedResidual(Module):
    """attn_ / mlp_hyper_connection and the model's hyper_connection_mixer (combine=False)."""

    def __init__(self, n: int, d: int, rank: int, eps: float, combine: bool = True):
        super().__init__()
        self.n, self.d, self.combine = n, d, combine
        self.hc_norm = StreamNorm(n, d, eps)
        self.input_mix_weight_down = Linear(n * d, rank, bias=False)
        self.input_mix_weight_up = Linear(rank, n * d, bias=False)
        if combine:
            self.block_inject_weight = Linear(n * d, n, bias=False)

    def forward(self, streams):
        """The block input [B, T, D] and (with combine) the injection weights [B, T, n]."""
        b, t, _ = streams.shape
        y = self.hc_norm(streams)
        mix = self.input_mix_weight_up(F.silu(self.input_mix_weight_down(y) * (1.0 / self.n))).sigmoid()
        x = (mix * y).reshape(b, t, self.n, self.d).mean(2)
        if not self.combine:
            return x
        return x, (self.block_inject_weight(y) * (1.0 / self.n)).sigmoid() * 2.0

    def inject(self, streams, out, weights):
        b, t, _ = streams.shape
        added = out.reshape(b, t, 1, self.d) * weights.reshape(b, t, self.n, 1)
        return streams + added.reshape(b, t, self.n * self.d)


# -- PLE: hashed n-gram embeddings

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's output function of z + golden (the seeds of the per-layer multipliers)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def ngram_multipliers(vocab: int, ngram_size: int, ple_index: int, seed: int) -> np.ndarray:
    """Odd constants, one per n-gram position, small enough that token * constant fits an int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + 10007 * ple_index
    return np.array([2 * (_mix64((base + _GOLDEN * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)],
                    np.int64)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, math.isqrt(n) + 1))


def ngram_head_sizes(base: int, heads: int, ple_index: int) -> list[int]:
    """Head h of PLE layer k hashes modulo the (k * heads + h + 1)-th prime above base - 1."""
    sizes, p = [], base - 1
    while len(sizes) < (ple_index + 1) * heads:
        p += 1
        if _is_prime(p):
            sizes.append(p)
    return sizes[ple_index * heads:]


class PerLayerEmbedding(Module):
    """A layer's ``ple``: n-gram embedding, gated per stream, plus a dilated depthwise conv."""

    def __init__(self, o: Qwen4ExpLayers, spec, index: int):
        super().__init__()
        n, d, e = o.hc_count, spec.hidden_size, o.ple_dim
        self.o, self.n, self.d, self.index = o, n, d, index
        self.orders = o.ngram_size - 1
        heads = self.orders * o.heads_per_ngram
        self.sizes = ngram_head_sizes(o.ngram_base, heads, o.ple_index[index])
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.multipliers = ngram_multipliers(spec.vocab_size, o.ngram_size, o.ple_index[index], o.seed)
        rows = -(-sum(self.sizes) // o.ngram_divisor) * o.ngram_divisor
        chunk = -(-rows // o.ngram_shards)  # torch.chunk's split of the saved table
        self.shards = [min(chunk, rows - i * chunk) for i in range(o.ngram_shards) if i * chunk < rows]
        for i, size in enumerate(self.shards):
            add_param(self, f"ple_embedding.ngram_embedding.shard_{i}.weight", (size, e // heads))
        self.key_proj = Linear(e, n * d, bias=False)
        self.value_proj = Linear(e, d, bias=False)
        eps = spec.norms.eps
        self.norm_key, self.norm_query, self.norm_conv = (StreamNorm(n, d, eps) for _ in range(3))
        self.conv1d = Module()
        self.conv1d.param("weight", (n * d, 1, o.ple_kernel))
        self.history = (o.ple_kernel - 1) * o.ngram_size  # conv inputs kept between calls

    def load_buffers(self, arrays, prefix: str) -> None:
        """The checkpoint's hash constants (they are derived from the config; a file may hold others)."""
        for name, attr in (("layer_multipliers", "multipliers"), ("ngram_heads_vocab_sizes", "sizes"),
                           ("ngram_heads_offsets", "offsets")):
            key = f"{prefix}.ple_embedding.{name}"
            if key in arrays:
                setattr(self, attr, np.asarray(arrays[key]).astype(np.int64))

    def _ids(self, history: np.ndarray, new: int) -> np.ndarray:
        """[B, new, heads] table rows of the last ``new`` tokens of ``history`` [B, L] (int64)."""
        eos = self.o.eos
        b, length = history.shape
        pos = np.arange(length)
        is_eos = np.where(history == eos, pos, -1)
        last = np.maximum.accumulate(is_eos, axis=1)
        start = np.concatenate([np.full((b, 1), -1), last[:, :-1]], axis=1) + 1  # segment start: after an eos
        shifted = []
        for s in range(self.o.ngram_size):
            src = np.maximum(pos - s, 0)
            ok = (pos[None] - start >= s) & (pos - s >= 0)[None]
            shifted.append(np.where(ok, history[:, src], eos).astype(np.int64))
        sizes, per = np.asarray(self.sizes, np.int64), self.o.heads_per_ngram
        blocks = []
        for order in range(2, self.o.ngram_size + 1):
            mixed = shifted[0] * self.multipliers[0]
            for s in range(1, order):
                mixed = mixed ^ (shifted[s] * self.multipliers[s])
            lo = (order - 2) * per
            blocks.append(mixed[..., None] % sizes[lo:lo + per] + self.offsets[lo:lo + per])
        return np.concatenate(blocks, -1)[:, -new:]

    def _table(self):
        shards = [get_param(self, f"ple_embedding.ngram_embedding.shard_{i}.weight") for i in range(len(self.shards))]
        return F.cat(shards, 0)

    def forward(self, streams, ctx):
        b, t, _ = streams.shape
        n, d, o = self.n, self.d, self.o
        ids = np.asarray(ctx.input_ids, np.int64)
        keep = None
        if ctx.host_mask is not None:
            keep = ctx.host_mask[:, -t:].astype(bool)
            ids = np.where(keep, ids, o.eos)
        state = None
        if ctx.cache is not None:
            state = ctx.cache.__dict__.setdefault("qwen4_ple", {})
            if ctx.cache.position == 0:
                state.pop(self.index, None)
        context, conv_past = (state or {}).get(self.index, (None, None))
        if context is None:
            context = np.full((b, self.orders), o.eos, np.int64)
            conv_past = Tensor(np.zeros((b, self.history, n * d), np.float32), dtype=streams.dtype)
        history = np.concatenate([context, ids], 1)
        rows = self._ids(history, t)
        emb = F.embedding(Tensor(rows.reshape(b, -1).astype(np.int32)), self._table()).reshape(b, t, o.ple_dim)
        key = self.norm_key(self.key_proj(emb)).reshape(b, t, n, d)
        query = self.norm_query(streams).reshape(b, t, n, d)
        gate = (key * query).sum(-1) * (d ** -0.5)                            # [B, T, n]
        gate = gate * gate.abs().maximum(1e-6).rsqrt()                       # sign(g) sqrt(max(|g|, 1e-6))
        value = self.value_proj(emb).reshape(b, t, 1, d)
        gated = (gate.sigmoid().reshape(b, t, n, 1) * value).reshape(b, t, n * d)
        normed = self.norm_conv(gated)
        if keep is not None and not keep.all():
            m = Tensor(keep.astype(np.float32)[:, :, None], dtype=gated.dtype)
            gated, normed = gated * m, normed * m
        full = F.cat([conv_past, normed], 1)
        weight, r, k = self.conv1d.weight, o.ngram_size, o.ple_kernel
        conv = None
        for j in range(k):  # output t reads inputs t - (k - 1 - j) r
            term = full[:, j * r:j * r + t] * weight[:, 0, j]
            conv = term if conv is None else conv + term
        if state is not None:
            state[self.index] = (history[:, -self.orders:], full[:, t:].contiguous().detach())
        return gated + F.silu(conv)


# -- the layer

class Qwen4ExpLayer(DecoderLayer):
    """The shared layer (no norms of its own) between two gated residuals, with PLE and QSA where configured."""

    capture_decode = False  # PLE and the indexer keep host state on the cache object

    def __init__(self, options: Qwen4ExpLayers, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        o, d = options, spec.hidden_size
        self.options = options
        for name, path in (("attn_hc", "attn_hyper_connection"), ("mlp_hc", "mlp_hyper_connection")):
            object.__setattr__(self, name, place(self, path, GatedResidual(o.hc_count, d, o.hc_lowrank,
                                                                             spec.norms.eps)))
        object.__setattr__(self, "ple", None)
        if o.ple_index[index] is not None:
            object.__setattr__(self, "ple", place(self, "ple", PerLayerEmbedding(o, spec, index)))
        self.indexed = not self.linear and o.index_heads > 0
        self._keep = None
        if self.indexed:
            path = join_path(self.spec.attention.path, "indexer")
            self.parts["index_qk"] = place(self, join_path(path, "index_qk_proj"),
                                           Linear(d, (o.index_heads + 1) * o.index_dim, bias=False))
            self.parts["index_q_norm"] = place(self, join_path(path, "q_layernorm"), make_norm(self.spec, o.index_dim))
            self.parts["index_k_norm"] = place(self, join_path(path, "k_layernorm"), make_norm(self.spec, o.index_dim))

    def forward(self, streams, ctx):
        if self.ple is not None:
            streams = streams + self.ple(streams, ctx)
        x, weights = self.attn_hc(streams)
        streams = self.attn_hc.inject(streams, self.attention(x, ctx), weights)
        x, weights = self.mlp_hc(streams)
        return self.mlp_hc.inject(streams, self.mlp(x), weights)

    # -- QSA

    def attention(self, h, ctx):
        if not self.indexed:
            return super().attention(h, ctx)
        self._keep = self._select(h.detach(), ctx)
        try:
            return super().attention(h, ctx)
        finally:
            self._keep = None

    def _history(self, raw, ctx, new):
        """(raw indexer keys [B, K, dim], positions [B, K], padding mask [B, K]) of every token so far."""
        b = raw.shape[0]
        mask = (ctx.host_mask[:, -new:] if ctx.host_mask is not None else np.ones((b, new))).astype(bool)
        positions = ctx.positions.numpy().astype(np.int64)
        if ctx.cache is None:
            return raw, positions, mask
        states = ctx.cache.__dict__.setdefault("qwen4_index", {})
        if ctx.cache.position == 0:
            states.pop(self.index, None)
        if self.index in states:
            past = states[self.index]
            raw, positions, mask = (np.concatenate([p, x], 1) for p, x in zip(past, (raw, positions, mask)))
        states[self.index] = (raw, positions, mask)
        return raw, positions, mask

    def _select(self, h, ctx):
        """[B, T, K] bool: the tokens each new query attends to (its chosen blocks and tail; visible ones only)."""
        o, p = self.options, self.parts
        b, t, _ = h.shape
        heads, dim, ratio = o.index_heads, o.index_dim, o.ratio
        qk = p["index_qk"](h)
        inv_freq, scaling = ctx.rope_tables[self.index]
        q = p["index_q_norm"](qk[..., :heads * dim].contiguous().reshape(b, t, heads, dim)).permute(0, 2, 1, 3)
        q = F.rope(q.contiguous(), ctx.rope_positions, inv_freq, interleaved=False, attention_scaling=scaling)
        q = q.numpy().astype(np.float64)                                            # [B, heads, T, dim]
        raw, positions, mask = self._history(qk[..., heads * dim:].contiguous().numpy(), ctx, t)
        keys = raw.shape[1]
        norm = p["index_k_norm"]
        w = norm.weight.numpy().astype(np.float64) + (1.0 if norm.unit_offset else 0.0)
        freqs = inv_freq.numpy().astype(np.float64)
        rot = 2 * freqs.shape[0]
        keep = np.zeros((b, t, keys), bool)
        first = keys - t
        for row in range(b):
            seen = np.flatnonzero(mask[row])                                        # visible tokens, in order
            blocks = len(seen) // ratio
            if blocks:
                members = seen[:blocks * ratio].reshape(blocks, ratio)
                k = raw[row, members.reshape(-1)].astype(np.float64).reshape(blocks, ratio, dim).mean(1)
                k = k / np.sqrt((k * k).mean(-1, keepdims=True) + norm.eps) * w
                angle = positions[row, members[:, 0]][:, None].astype(np.float64) * freqs[None]
                cos, sin = np.cos(angle) * scaling, np.sin(angle) * scaling
                x1, x2 = k[:, :rot // 2], k[:, rot // 2:rot]
                k = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, k[:, rot:]], -1)
                scores = np.maximum(np.einsum("hqd,md->hqm", q[row], k), 0.0).sum(0) / math.sqrt(dim)  # [T, M]
            for i in range(t):
                visible = seen[seen <= first + i]
                complete = len(visible) // ratio
                if complete:
                    best = np.argsort(-scores[i, :complete], kind="stable")[:min(o.budget // ratio, complete)]
                    keep[row, i, members[best].reshape(-1)] = True
                keep[row, i, visible[complete * ratio:]] = True
        return keep

    def attend_heads(self, q, k, v, ctx, **options):
        if self._keep is None:
            return super().attend_heads(q, k, v, ctx, **options)
        batch, heads, new, dim = q.shape
        if ctx.cache is not None:  # store the new keys (the cache's causal output is not used), attend over all
            ctx.cache.attend(self.index, q, k, v, scale=options["scale"], key_padding_mask=ctx.key_padding_mask)
            end = ctx.cache.position + new
            k, v = ctx.cache.keys[self.index][:, :, :end], ctx.cache.values[self.index][:, :, :end]
        keys, kv_heads = k.shape[2], k.shape[1]
        group = heads // kv_heads
        if group > 1:
            k, v = (x.reshape(batch, kv_heads, 1, keys, dim).expand(batch, kv_heads, group, keys, dim).contiguous()
                    .reshape(batch, heads, keys, dim) for x in (k, v))
        # the selection holds visible tokens only (earlier, not padding)
        hidden = Tensor(np.where(self._keep, 0.0, _HIDDEN).astype(np.float32)[:, None])
        scores = (q @ k.transpose(-1, -2)).float() * options["scale"] + hidden
        return scores.softmax(-1).cast(v.dtype) @ v
