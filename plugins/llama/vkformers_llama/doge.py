"""Doge's dynamic mask attention and learned residual scales on the shared decoder layer.

transformers 5 (DogeAttention): each key gets one additive score bias per KV head, computed from its value,
exp(A * softplus(dt_proj(values))), shared by every query that may attend to it; scores = scale q k + bias. The
layer adds it through the attention kernel itself: one more head dimension, 1 in every query and bias / scale in
every key (zeros in the values, sliced off), so masks, GQA, the backward and the cache stay the kernel's. Top-k
masking past keep_window_size keys is not implemented (the variant refuses such configs). The residuals are
input_residual * x + attn and post_attention_residual * x + mlp, both learned per channel.

CDMoE (is_moe): the dense SwiGLU MLP plus num_keys^2 single-neuron experts (down_embed / up_embed rows). As
transformers computes it, router_gate's [tokens, 2 num_keys] logits are reinterpreted as [2, tokens, num_keys] (a
view of the contiguous buffer: in a prefill the two key halves of a row come from other tokens' logits), expert
a * num_keys + b scores x_a + y_b, the top_k experts are chosen and weighted by the softmax of their scores, and
each adds act(down_embed_e . h) * weight_e * up_embed_e. Here every expert's product is computed and the
unchosen ones weigh zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.ops.routing import topk_mask
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
    num_experts: int = 0          # CDMoE's experts (0: a dense MLP only)
    top_k: int = 0
    norm_topk: bool = False

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
        self.options = options
        if options.num_experts:
            keys = math.isqrt(options.num_experts)
            object.__setattr__(self, "router_gate", place(self, join_path(spec.mlp.path, "router_gate"),
                                                          Linear(spec.hidden_size, 2 * keys, bias=False)))
            for name in ("down_embed", "up_embed"):
                add_param(self, join_path(spec.mlp.path, name, "weight"), (options.num_experts, spec.hidden_size))
        add_param(self, "input_residual", (spec.hidden_size,))
        add_param(self, "post_attention_residual", (spec.hidden_size,))

    def attend_heads(self, q, k, v, ctx, **options):
        new = q.shape[2]
        host_mask = ctx.host_mask
        if ctx.cache is not None:  # store the new keys and values (the cache's own output is not used), read all
            ctx.cache.attend(self.index, q, k, v, **options)
            end = ctx.cache.position + new
            k, v = ctx.cache.keys[self.index][:, :, :end], ctx.cache.values[self.index][:, :, :end]
            mask = ctx.cache.step_inputs(new)[1]
            options = dict(options, key_padding_mask=None if mask is None else mask[:, :end])
            host_mask = ctx.cache.mask[:, :end]
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

        key_states = k
        ones = Tensor(np.ones((*q.shape[:3], 1), np.float32), dtype=q.dtype)
        q = F.cat([q, ones, zeros(q, extra - 1)], -1)
        k = F.cat([k, (bias * (1.0 / options["scale"])).cast(k.dtype), zeros(k, extra - 1)], -1)
        v = F.cat([v, zeros(v, extra)], -1)
        out = F.scaled_dot_product_attention(q, k, v, causal=True, **options)[..., :dim]
        return self._blind_rows(out, q[..., :dim], key_states, v[..., :dim], host_mask, options["scale"])

    @staticmethod
    def _blind_rows(out, q, k, v, host_mask, scale):
        """A query that may attend to no key (left padding) gets, as in transformers' eager attention, where every
        masked score is the dtype's minimum, the plain average of all the values, and its scores still pass the
        softmax's gradient (at the uniform weights) to q and k; the kernel gives zeros. Only CDMoE's routing, which
        mixes tokens, carries these rows to others."""
        if host_mask is None:
            return out
        batch, heads, new, dim = out.shape
        blind = np.cumsum(np.asarray(host_mask) != 0, axis=1)[:, -new:] == 0
        if not blind.any():
            return out
        kv_heads, keys = v.shape[1], v.shape[2]

        def per_head(t):
            return t.reshape(batch, kv_heads, 1, keys, dim).expand(batch, kv_heads, heads // kv_heads, keys, dim) \
                .reshape(batch, heads, keys, dim)

        scores = F.matmul(q, per_head(k).permute(0, 1, 3, 2)).float() * scale
        weights = F.softmax(scores - scores.detach(), dim=-1)  # uniform, with the softmax's gradient
        average = F.matmul(weights.cast(v.dtype), per_head(v))
        return F.where(Tensor(blind[:, None, :, None]), average, out)

    def mlp(self, h):
        out = self._mlp(h)
        return out if not self.options.num_experts else out + self._experts(h)

    def _experts(self, h):
        o, mlp = self.options, self.spec.mlp.path
        batch, length, d = h.shape
        keys = math.isqrt(o.num_experts)
        used = keys * keys
        logits = self.router_gate(h).contiguous().reshape(2, batch * length, keys)  # transformers' view
        scores = (logits[0].reshape(batch * length, keys, 1) + logits[1].reshape(batch * length, 1, keys)).reshape(
            batch * length, used).float()
        chosen = topk_mask(scores, o.top_k)
        top = scores.max(-1, keepdim=True).detach()
        weights = F.where(chosen, (scores - top).exp(), 0.0)
        weights = weights / weights.sum(-1, keepdim=True)
        if o.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        down = get_param(self, join_path(mlp, "down_embed", "weight"))[:used]
        up = get_param(self, join_path(mlp, "up_embed", "weight"))[:used]
        flat = h.reshape(batch * length, d)
        activations = self.act(F.linear(flat, down)) * weights.cast(h.dtype)
        return F.matmul(activations, up).reshape(batch, length, d)

    def _sequential_residual(self, x, ctx):
        attn = self.attention(self._norm("attn_in_norm", x), ctx)
        x = x * get_param(self, "input_residual") + attn
        mlp = self.mlp(self._norm("mlp_in_norm", x))
        return x * get_param(self, "post_attention_residual") + mlp
