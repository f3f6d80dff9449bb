"""GLM-5.3-Flash's text decoder (glm5_next_text) as declared deltas on parts that exist: DeepSeek-V4's hyper-connected
streams (deepseek_v4.py), GLM-5's DSA layer on NoPE MLA (axk2.py) and Gated DeltaNet (vkformers-llama), composed from
engine ops.

transformers 5.24 (Glm5NextText*), under the names its save_pretrained writes:

- Residual stream: hc_mult streams; DeepSeek-V4's hyper-connections (hc_attn_* / hc_ffn_*) around the attention and the
  MLP, but the final collapse is the plain mean of the streams (no hyper head).
- layer_types "linear_attention": Kimi Delta Attention. Gated DeltaNet's split layout (q/k/v_proj, q/k/v_conv1d, silu
  conv, l2-normed q/k, beta = sigmoid(b_proj)) with one key head per value head and three deltas: the decay is per key
  channel, g = lower * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)) (without linear_lower_bound: -exp(A_log) *
  softplus(...)); the output gate is low-rank (g_b_proj(g_a_proj(x))) and sigmoid, not silu.
- layer_types "indexed_attention": MLA without rotary (qk_rope_head_dim 0, q/kv latent norms at rms_norm_eps) with a
  DSA indexer over pools of index_kpool keys: pool keys are the softmax(index_kpool_compress_gate x + ape)-weighted
  sums of the LayerNorm'd indexer keys of each pool (pools counted from the row's first real token); each query keeps
  the index_topk / index_kpool best complete visible pools plus the visible tokens of the incomplete tail pool. The
  indexer has no gradient (as in transformers): its inputs are read back and numpy pools and ranks them. indexer_types
  "shared" layers reuse the previous layer's choice.
- MLPs (mlp_layer_types): dense ones and the experts / shared experts of DeepSeek-V3's sparse block clip gate (max l)
  and up (+-l) before silu(gate) * up, as DeepSeek-V4's.

Decode steps are not captured: the recurrent state and the indexer's pooled keys live on the cache object.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.models.layers import Linear
from vkformers.models.module import Module, add_param, get_param
from vkformers.models.decoder import DecoderLayer, GatedDeltaNet, make_norm
from vkformers.models.decoder.spec import NormSpec

from vkformers_moe.axk2 import Axk2Attention, Axk2Layer
from vkformers_moe.deepseek_v4 import DeepseekV4Layer, DeepseekV4Moe


class KimiDeltaAttention(GatedDeltaNet):
    """Gated DeltaNet with a per-key-channel decay from a low-rank forget gate and a low-rank sigmoid output gate
    (self_attn.f_a_proj / f_b_proj / dt_bias / A_log, g_a_proj / g_b_proj, b_proj, o_norm, o_proj). ``a_log_shape``:
    A_log as the checkpoint stores it, one value per head (Kimi Linear: [1, 1, heads, 1])."""

    def __init__(self, spec, lower_bound: float | None = -5.0, a_log_shape: tuple[int, ...] | None = None):
        Module.__init__(self)  # GatedDeltaNet's own projections (z, a) differ: declared here
        s, d = spec, spec.hidden_size
        heads, dim = s.linear_attention.v_heads, s.linear_attention.v_dim
        width = heads * dim
        self.spec, self.lower_bound = s, lower_bound
        self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.kernel = heads, heads, dim, dim, s.linear_attention.conv_kernel
        self.conv_channels, self.split, self.conv_widths = 3 * width, True, (width,) * 3
        for name in "qkv":
            setattr(self, f"{name}_proj", Linear(d, width, bias=False))
            conv = Module()
            conv.param("weight", (width, 1, self.kernel))
            setattr(self, f"{name}_conv1d", conv)
        self.f_a_proj, self.f_b_proj = Linear(d, dim, bias=False), Linear(dim, width, bias=False)
        self.param("dt_bias", (width,))
        self.param("A_log", a_log_shape or (heads,))
        self.b_proj = Linear(d, heads, bias=False)
        self.g_a_proj, self.g_b_proj = Linear(d, dim, bias=False), Linear(dim, width, bias=False)
        self.o_norm = make_norm(NormSpec("rms", eps=s.linear_attention.norm_eps or s.norms.eps), dim)
        self.o_proj = Linear(width, d, bias=False)
        object.__setattr__(self, "gated_norm", self.o_norm)
        object.__setattr__(self, "output", self.o_proj)

    def _project(self, h):
        return ([self.q_proj(h), self.k_proj(h), self.v_proj(h)], self.g_b_proj(self.g_a_proj(h)), self.b_proj(h),
                self.f_b_proj(self.f_a_proj(h)))

    def _decay(self, a):
        batch, length, _ = a.shape
        g = (a + self.dt_bias).reshape(batch, length, self.v_heads, self.v_dim)
        rate = self.A_log.exp().reshape(1, 1, self.v_heads, 1)
        g = (g * rate).sigmoid() * self.lower_bound if self.lower_bound is not None else F.softplus(g) * rate * -1.0
        return g.exp().permute(0, 2, 1, 3)  # [B, H, T, key_dim]

    @staticmethod
    def _output_gate(z):
        return F.sigmoid(z)


@dataclass(frozen=True)
class Glm5NextLayers(Axk2Attention):
    """The model's options (Axk2Attention's DSA sizes plus pools, clip and hyper-connections); called with
    (spec, index, alibi) it builds layer ``index`` (DecoderSpec.make_layer)."""

    kpool: int = 16
    kpool_tail: bool = True      # index_kpool_always_select_tail
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    def __call__(self, spec, index: int, alibi=None) -> "Glm5NextLayer":
        return Glm5NextLayer(self, spec, index, alibi)


class Glm5NextLayer(Axk2Layer):
    """The shared layer (KDA or NoPE MLA with the pooled DSA indexer; clipped MLP or sparse block) on hc_mult streams.
    Linear layers are built with shared_index set: they have no indexer."""

    _hyper = DeepseekV4Layer._hyper                 # (post, comb, collapsed input) from hc_<site>_fn / base / scale
    _expand = staticmethod(DeepseekV4Layer._expand)
    _swiglu = DeepseekV4Moe._swiglu                 # clipped SwiGLU of an expert (self.limit)

    def __init__(self, options: Glm5NextLayers, spec, index: int, alibi=None):
        super().__init__(options, spec, index, alibi)
        n, d = options.hc_mult, spec.hidden_size
        self.limit = options.swiglu_limit
        for site in ("attn", "ffn"):
            add_param(self, f"hc_{site}_fn", ((2 + n) * n, n * d))
            add_param(self, f"hc_{site}_base", ((2 + n) * n,))
            add_param(self, f"hc_{site}_scale", (3,))
        if not self.linear and not self.shares_index:
            add_param(self, "self_attn.indexer.index_kpool_compress_ape", (options.kpool, options.index_dim))
            add_param(self, "self_attn.indexer.index_kpool_compress_gate", (options.index_dim, d))

    def forward(self, streams, ctx):
        post, comb, x = self._hyper("attn", streams)
        streams = self._expand(post, comb, self.attention(self._norm("attn_in_norm", x), ctx), streams)
        post, comb, x = self._hyper("ffn", streams)
        return self._expand(post, comb, self.mlp(self._norm("mlp_in_norm", x)), streams)

    def attention(self, h, ctx):
        return DecoderLayer.attention(self, h, ctx) if self.linear else super().attention(h, ctx)

    def mlp(self, h):
        p, limit = self.parts, self.limit
        if "moe" not in p:
            return p["down"](F.silu(p["gate"](h).minimum(limit)) * p["up"](h).maximum(-limit).minimum(limit))
        block, lead = p["moe"], h.shape[:-1]
        x = h.reshape(-1, block.hidden)
        weights = block.routing_weights(x).cast(x.dtype)  # DeepSeek-V3's router
        out = block.experts_output(x, weights, self._swiglu)
        if block.shared is not None:
            out = self._swiglu(block.shared, x) + out
        return out.reshape(*lead, block.hidden)

    # -- the pooled indexer (no gradient: its inputs are read back, numpy pools and ranks)

    def _index(self, h, residual, ctx):
        p, o = self.parts, self.options
        batch, length, _ = h.shape
        q = p["index_q"](residual).numpy().reshape(batch, length, o.index_heads, o.index_dim)
        keys = p["index_k_norm"](p["index_k"](h)).numpy()
        gates = F.linear(h, get_param(self, "self_attn.indexer.index_kpool_compress_gate")).numpy()
        weights = p["index_w"](h).numpy() * o.index_heads ** -0.5
        if ctx.cache is not None:  # the stored tokens' keys and gate logits, kept on the cache object
            stored = ctx.cache.__dict__.setdefault("index_pools", {})
            if ctx.cache.position == 0:
                stored.pop(self.index, None)
            if self.index in stored:
                keys, gates = (np.concatenate([old, new], 1) for old, new in zip(stored[self.index], (keys, gates)))
            stored[self.index] = (keys, gates)
        return q, keys, gates, weights

    def _select_keys(self, visible, key_mask):
        o = self.options
        q, keys, gates, weights = self._index_scores
        batch, new, total = visible.shape
        size = o.kpool
        valid = np.ones((batch, total), bool) if key_mask is None else key_mask.astype(bool)
        first = np.where(valid.any(-1), valid.argmax(-1), total)  # pools start at the row's first real token
        pools = -(-total // size)
        index = first[:, None, None] + np.arange(pools * size).reshape(1, pools, size)  # [B, pools, size]
        safe = index.clip(0, total - 1)
        rows = np.arange(batch)[:, None, None]
        slot_valid = valid[rows, safe] & (index < total)
        pool_valid = slot_valid.all(-1)
        ape = get_param(self, "self_attn.indexer.index_kpool_compress_ape").numpy()
        logits = np.where(slot_valid[..., None], gates[rows, safe] + ape, -np.inf)  # [B, pools, size, D]
        with np.errstate(invalid="ignore"):
            probs = np.exp(logits - logits.max(2, keepdims=True))
            probs = np.nan_to_num(probs / probs.sum(2, keepdims=True))
        pooled = (probs * keys[rows, safe]).sum(2)  # [B, pools, D]
        scores = np.maximum(np.einsum("bshd,bpd->bshp", q, pooled) * o.index_dim ** -0.5, 0.0)
        scores = np.einsum("bsh,bshp->bsp", weights, scores)
        ends = np.broadcast_to(safe[:, None, :, -1], (batch, new, pools))
        candidate = np.take_along_axis(visible, ends, -1) & pool_valid[:, None]  # complete pools, last key visible
        best = np.argsort(-np.where(candidate, scores, -np.inf), -1, kind="stable")[..., :min(o.index_topk // size,
                                                                                                pools)]
        chosen = np.take_along_axis(candidate, best, -1)  # [B, S, k]
        tokens = index[np.arange(batch)[:, None, None], best]  # [B, S, k, size]
        keep = np.zeros((batch, new, total), bool)
        b, s, _, _ = np.nonzero(np.broadcast_to(chosen[..., None], tokens.shape))
        keep[b, s, tokens[np.broadcast_to(chosen[..., None], tokens.shape)]] = True
        if o.kpool_tail and size > 1:  # the visible tokens of the incomplete last pool
            count = visible.sum(-1)
            tail = (first[:, None] + count - count % size)[..., None] + np.arange(size - 1)  # [B, S, size - 1]
            ok = (np.arange(size - 1) < (count % size)[..., None]) & (tail < total)
            ok &= np.take_along_axis(visible, tail.clip(0, total - 1), -1)
            b, s, _ = np.nonzero(ok)
            keep[b, s, tail[ok]] = True
        keep &= valid[:, total - new:, None]  # padded queries keep nothing
        return keep & visible
