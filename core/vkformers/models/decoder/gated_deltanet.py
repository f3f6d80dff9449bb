"""Gated DeltaNet linear attention (the linear layers of Qwen3.5's hybrid decoder), from engine ops.

Per value head h with a state S [key_dim, value_dim] (zero at the start of a sequence):

    S <- S * exp(g_t)                                  decay, g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T            delta rule, beta_t = sigmoid(b_t) (OLMo Hybrid: 2x that)
    o_t = S^T q_t

with q, k l2-normalised per head (q also scaled by key_dim^-1/2) after a causal depthwise conv1d + silu
over [q | k | v]; then RMSNorm(o) * silu(z) and out_proj. Key heads are shared by consecutive value
heads. The conv is depthwise, so OLMo Hybrid's three convs (q_conv1d, k_conv1d, v_conv1d, as its
checkpoints store them) run one per projection, with no concatenation. The recurrence runs token by
token with ordinary engine ops, so autograd gives the backward pass; sequences here are short (prefill
of a prompt, one token per decode step).

With a KV cache the layer keeps its own state between calls on the cache object: the last kernel - 1
inputs of each conv and S (``cache.linear_states[layer]``), restarted when the cache is at position 0.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import Linear
from vkformers.models.lazy_weights import LazyWeights, concatenated
from vkformers.models.decoder.norms import make_norm
from vkformers.models.decoder.spec import NormSpec
from vkformers.models.module import Module


class GatedDeltaNet(Module):
    """Qwen3.5's ``linear_attn``: parameters under its names (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, or
    Qwen3-Next's grouped in_proj_qkvz and in_proj_ba; conv1d.weight [C, 1, kernel], dt_bias, A_log, norm.weight,
    out_proj), or OLMo Hybrid's (q/k/v_proj, g_proj (z), b_proj, a_proj, q/k/v_conv1d.weight, o_norm, o_proj)."""

    def __init__(self, spec):
        super().__init__()
        s, lin, d = spec, spec.linear_attention, spec.hidden_size
        self.spec = s
        self.k_heads, self.v_heads = lin.k_heads, lin.v_heads
        self.k_dim, self.v_dim, self.kernel = lin.k_dim, lin.v_dim, lin.conv_kernel
        key_width, value_width = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_channels = 2 * key_width + value_width
        self.split = lin.split_projections
        self.conv_widths = (key_width, key_width, value_width) if self.split else (self.conv_channels,)
        if self.split:  # OLMo Hybrid
            for name, width in (("q", key_width), ("k", key_width), ("v", value_width)):
                setattr(self, f"{name}_proj", Linear(d, width, bias=False))
                conv = Module()
                conv.param("weight", (width, 1, self.kernel))
                setattr(self, f"{name}_conv1d", conv)
            self.g_proj = Linear(d, value_width, bias=False)
            self.b_proj = Linear(d, self.v_heads, bias=False)
            self.a_proj = Linear(d, self.v_heads, bias=False)
        elif lin.grouped_projections:
            self.in_proj_qkvz = Linear(d, self.conv_channels + value_width, bias=False)
            self.in_proj_ba = Linear(d, 2 * self.v_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(d, self.conv_channels, bias=False)
            self.in_proj_z = Linear(d, value_width, bias=False)
            self.in_proj_b = Linear(d, self.v_heads, bias=False)
            self.in_proj_a = Linear(d, self.v_heads, bias=False)
        if not self.split:
            conv = Module()
            conv.param("weight", (self.conv_channels, 1, self.kernel))
            self.conv1d = conv
        self.param("dt_bias", (self.v_heads,))
        self.param("A_log", (self.v_heads,))
        # the gated norm has a plain weight, also in (1 + w) models
        norm = make_norm(NormSpec("rms", eps=lin.norm_eps or s.norms.eps), self.v_dim)
        out_proj = Linear(value_width, d, bias=False)
        setattr(self, "o_norm" if self.split else "norm", norm)
        setattr(self, "o_proj" if self.split else "out_proj", out_proj)
        object.__setattr__(self, "gated_norm", norm)  # plain references (not registered twice) under either name
        object.__setattr__(self, "output", out_proj)

    def _conv_weights(self):
        if self.split:
            return [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        return [self.conv1d.weight]

    def convert_checkpoint(self, arrays: LazyWeights, path: str) -> LazyWeights:
        """transformers 5.24 saves OLMo Hybrid's q/k/v_conv1d as three EQUAL chunks of the concatenated conv
        (torch.chunk), not at their sizes (key, key, value widths) as the released checkpoints hold them: re-split
        such a file. Returns ``arrays``, or a copy with those three replaced (split when read)."""
        names = [f"{path}.{n}_conv1d.weight" for n in "qkv"] if self.split else []
        if not names or not all(n in arrays for n in names):
            return arrays
        widths = list(self.conv_widths)
        shapes = [arrays.shape(n) for n in names]
        if [shape[0] for shape in shapes] == widths:
            return arrays
        if sum(shape[0] for shape in shapes) != sum(widths):
            return arrays  # some other layout: load_state_dict names the mismatch
        full = concatenated([arrays.weight(n) for n in names], axis=0)
        bounds = np.cumsum([0] + widths)
        return arrays.updated({name: full.converted(partial(_rows, int(a), int(b)), shape=(b - a, *shapes[0][1:]))
                               for name, a, b in zip(names, bounds[:-1], bounds[1:])})

    def _project(self, h):
        """The inputs of each conv ([q | k | v], or q, k, v apart), z, b and a."""
        if self.split:
            return [self.q_proj(h), self.k_proj(h), self.v_proj(h)], self.g_proj(h), self.b_proj(h), self.a_proj(h)
        if not self.spec.linear_attention.grouped_projections:
            return [self.in_proj_qkv(h)], self.in_proj_z(h), self.in_proj_b(h), self.in_proj_a(h)
        # per key head: [q (k_dim), k (k_dim), v, z (its value heads' v_dim each)] and [b, a (one per value head)]
        batch, length = h.shape[:2]
        kd, vd, heads, repeat = self.k_dim, self.v_dim, self.k_heads, self.v_heads // self.k_heads
        grouped = self.in_proj_qkvz(h).reshape(batch, length, heads, 2 * kd + 2 * repeat * vd)
        bounds = (0, kd, 2 * kd, 2 * kd + repeat * vd, 2 * kd + 2 * repeat * vd)
        q, k, v, z = (grouped[..., a:b].contiguous().reshape(batch, length, heads * (b - a))
                      for a, b in zip(bounds, bounds[1:]))
        ba = self.in_proj_ba(h).reshape(batch, length, heads, 2 * repeat)
        b, a = (ba[..., i * repeat:(i + 1) * repeat].contiguous().reshape(batch, length, self.v_heads)
                for i in range(2))
        return [F.cat([q, k, v], -1)], z, b, a

    def _conv(self, x, history, weight):
        """Causal depthwise conv1d + silu over time: x [B, T, C], history [B, kernel - 1, C] (the inputs before)."""
        length = x.shape[1]
        full = F.cat([history, x], 1)
        out = None
        for j in range(self.kernel):  # output t reads inputs t - kernel + 1 .. t, i.e. full[t + j]
            term = full[:, j:j + length] * weight[:, 0, j]
            out = term if out is None else out + term
        return F.silu(out), full[:, length:]

    def _heads(self, x, heads, dim, repeat=1):
        """[B, T, heads * dim] -> [B, repeat * heads, T, dim], each head repeated ``repeat`` times in a row."""
        batch, length = x.shape[:2]
        x = x.reshape(batch, length, heads, 1, dim)
        if repeat > 1:
            x = x.expand(batch, length, heads, repeat, dim)
        return x.contiguous().reshape(batch, length, heads * repeat, dim).permute(0, 2, 1, 3)

    @staticmethod
    def _l2norm(x, eps=1e-6):
        return x * ((x * x).sum(-1, keepdim=True) + eps).pow(-0.5)

    def _decay(self, a):
        """exp(g) [B, H, T]: g = -exp(A_log) * softplus(a + dt_bias), one per head (a variant may decay each key
        channel: [B, H, T, key_dim])."""
        return (F.softplus(a + self.dt_bias) * (self.A_log.exp() * -1.0)).exp().permute(0, 2, 1)

    @staticmethod
    def _output_gate(z):
        return F.silu(z)

    def forward(self, h, ctx, index: int):
        batch, length, _ = h.shape
        keep = ctx.padding_keep(length, h.dtype)
        if keep is not None:  # padded positions contribute nothing
            h = h * keep
        states = None
        if ctx.cache is not None:
            states = ctx.cache.__dict__.setdefault("linear_states", {})
            if ctx.cache.position == 0:
                states.pop(index, None)
        inputs, z, b, a = self._project(h)
        weights = self._conv_weights()
        histories, state = (states or {}).get(index, (None, None))
        if histories is None:
            histories = [Tensor(np.zeros((batch, self.kernel - 1, width), np.float32), dtype=h.dtype)
                         for width in self.conv_widths]
            state = Tensor(np.zeros((batch, self.v_heads, self.k_dim, self.v_dim), np.float32), dtype=h.dtype)
        convolved = [self._conv(x, past, w) for x, past, w in zip(inputs, histories, weights)]
        histories = [past for _, past in convolved]
        key_width = self.k_heads * self.k_dim
        if len(convolved) == 3:
            q, k, v = (out for out, _ in convolved)
        else:
            mixed = convolved[0][0]
            q, k, v = mixed[..., :key_width], mixed[..., key_width:2 * key_width], mixed[..., 2 * key_width:]
        repeat = self.v_heads // self.k_heads
        q = self._l2norm(self._heads(q, self.k_heads, self.k_dim, repeat)) * (self.k_dim ** -0.5)
        k = self._l2norm(self._heads(k, self.k_heads, self.k_dim, repeat))
        v = self._heads(v, self.v_heads, self.v_dim)
        beta = F.sigmoid(b).permute(0, 2, 1)                                       # [B, H, T]
        if self.spec.linear_attention.beta_scale != 1.0:  # OLMo Hybrid (allow_neg_eigval): beta in [0, 2]
            beta = beta * self.spec.linear_attention.beta_scale
        decay = self._decay(a)

        heads, kd, vd = self.v_heads, self.k_dim, self.v_dim
        outputs = []
        for t in range(length):
            k_t = k[:, :, t].reshape(batch, heads, kd, 1)
            state = state * decay[:, :, t].reshape(batch, heads, -1, 1)           # per head or per key channel
            remembered = (state * k_t).sum(-2)                                     # S^T k: [B, H, vd]
            delta = (v[:, :, t] - remembered) * beta[:, :, t].reshape(batch, heads, 1)
            state = state + k_t * delta.reshape(batch, heads, 1, vd)
            o_t = (state * q[:, :, t].reshape(batch, heads, kd, 1)).sum(-2)
            outputs.append(o_t)
        out = F.stack(outputs, 2)                                                  # [B, H, T, vd]
        if states is not None:
            states[index] = ([past.detach() for past in histories], state.detach())

        z = z.reshape(batch, length, heads, vd)
        gated = self.gated_norm(out.permute(0, 2, 1, 3)) * self._output_gate(z)
        return self.output(gated.reshape(batch, length, heads * vd))


def _rows(start: int, stop: int, array):
    return array[start:stop]
