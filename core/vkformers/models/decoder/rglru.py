"""Griffin's recurrent block (RecurrentGemma's ``recurrent`` layers), a recurrent mixer for the kit's linear-attention
slot, from engine ops.

    y = act(linear_y(h));  x = causal_depthwise_conv1d(linear_x(h)) (with bias, no activation)
    i_t, r_t = sigmoid(x_t W_i + b_i), sigmoid(x_t W_r + b_r)       block-diagonal: one [width, width] per head
    log a_t = -8 r_t softplus(recurrent_param)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)                   at position 0: h_t = i_t x_t (a reset)
    out = linear_out(h * y)

The recurrence runs token by token in float32 with ordinary engine ops, so autograd gives the backward pass
(sequences here are a prompt's prefill and one token per decode step). transformers clips the gradient of
sqrt(1 - a^2) at 1000 (SqrtBoundDerivative: only where 1 - a^2 < 2.5e-7, a gate within 1e-7 of 1); this block's is
the exact one. Positions are the context's, so a
left-padded prompt in generation restarts at its first token as transformers' does (its position ids are 0 there).
With a KV cache the block keeps the last kernel - 1 conv inputs and h per layer on the cache object
(``cache.rglru_states[layer]``), restarted at position 0. On a cache whose padding only lays rows out (a server's
batch) padded positions feed the convolution zeros.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.cache import register_row_state
from vkformers.models.layers import Linear
from vkformers.models.module import Module


class RGLRU(Module):
    """The real-gated linear recurrent unit's parameters (recurrent_param, input / recurrent gates per head)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        block = width // heads
        self.heads, self.block = heads, block
        self.param("recurrent_param", (width,))
        for gate in ("input_gate", "recurrent_gate"):
            self.param(f"{gate}_weight", (heads, block, block))
            self.param(f"{gate}_bias", (heads, block))

    def gate(self, x, name: str):
        """sigmoid(x W + b) per head block: x [B, T, width]."""
        batch, length, width = x.shape
        per_head = x.reshape(batch * length, self.heads, self.block).permute(1, 0, 2)      # [H, BT, block]
        out = F.matmul(per_head, getattr(self, f"{name}_weight")) + getattr(self, f"{name}_bias").reshape(
            self.heads, 1, self.block)
        return F.sigmoid(out.permute(1, 0, 2).contiguous().reshape(batch, length, width))


class RecurrentBlock(Module):
    """linear_y, linear_x, conv_1d, rg_lru, linear_out; called by the decoder layer as ``(normed hidden states,
    Context, layer index)``."""

    def __init__(self, spec, *, width: int, heads: int, kernel: int, activation: str):
        super().__init__()
        d = spec.hidden_size
        self.width, self.kernel = width, kernel
        self.linear_y = Linear(d, width, bias=True)
        self.linear_x = Linear(d, width, bias=True)
        self.linear_out = Linear(width, d, bias=True)
        conv = Module()
        conv.param("weight", (width, 1, kernel))
        conv.param("bias", (width,))
        self.conv_1d = conv
        self.rg_lru = RGLRU(width, heads)
        self.act = F.activation(activation)

    @classmethod
    def module(cls, width: int, heads: int, kernel: int, activation: str):
        """The ``LinearAttentionSpec.module`` factory for blocks of these sizes."""
        return partial(cls, width=width, heads=heads, kernel=kernel, activation=activation)

    def forward(self, h, ctx, index: int):
        batch, length, _ = h.shape
        y = self.act(self.linear_y(h))
        x_in = self.linear_x(h).contiguous()
        keep = ctx.padding_keep(length, x_in.dtype) if ctx.padding_is_layout else None
        if keep is not None:
            # a server's left padding (transformers convolves padding as tokens): no input to the convolution, so
            # that a row's first token sees none before it, as alone
            x_in = x_in * keep
        states = None
        if ctx.cache is not None:
            states = ctx.cache.__dict__.setdefault("rglru_states", {})
            if ctx.cache.position == 0:
                states.pop(index, None)
        history, state = (states or {}).get(index, (None, None))
        if history is None:
            history = Tensor(np.zeros((batch, self.kernel - 1, self.width), np.float32), dtype=x_in.dtype)
            state = Tensor(np.zeros((batch, self.width), np.float32))
        x = F.causal_conv1d(x_in, self.conv_1d.weight, self.conv_1d.bias, history if self.kernel > 1 else None)
        lru = self.rg_lru
        log_a = lru.gate(x, "recurrent_gate").float() * F.softplus(lru.recurrent_param.float()) * -8.0
        gated = (x * lru.gate(x, "input_gate")).float()
        reset = (np.asarray(ctx.host_positions)[:, -length:] == 0).astype(np.float32)[:, :, None]
        keep = Tensor(1.0 - reset)
        scale = ((log_a * 2.0).exp() * -1.0 + 1.0).sqrt() * keep + Tensor(reset)
        normalized = gated * scale
        a = log_a.exp() * keep
        outputs = []
        for t in range(length):
            state = a[:, t] * state + normalized[:, t]
            outputs.append(state)
        out = F.stack(outputs, 1)
        if states is not None:
            past = self.kernel - 1
            states[index] = ((F.cat([history, x_in], 1)[:, -past:] if past else history).detach(), state.detach())
        return self.linear_out(out.cast(h.dtype) * y)


register_row_state("rglru_states")  # per row: a server's batch moves it with its row's keys and values
