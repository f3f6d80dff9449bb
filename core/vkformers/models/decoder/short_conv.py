"""The gated short convolution (LFM2's ``conv`` blocks), a recurrent mixer for the kit's linear-attention slot.

    [B | C | x] = in_proj(h);  y = out_proj(C * causal_depthwise_conv1d(B * x))

The conv has no activation and ``kernel`` taps (transformers' conv_L_cache). Padded positions of ``h`` are zeroed
first, as transformers' apply_mask_to_padding_states does. With a KV cache the block keeps the last kernel - 1
conv inputs per layer on the cache object (``cache.short_conv_states[layer]``), restarted at position 0; so a
model with these blocks runs its decode steps through the forward (``LinearAttentionSpec`` turns off replay).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.cache import register_row_state
from vkformers.models.layers import Linear
from vkformers.models.module import Module


class ShortConv(Module):
    """in_proj [hidden -> 3 hidden], conv (weight [hidden, 1, kernel], optional bias), out_proj; called by the
    decoder layer as ``(normed hidden states, Context, layer index)``."""

    def __init__(self, spec, *, kernel: int, bias: bool = False):
        super().__init__()
        d = spec.hidden_size
        self.kernel, self.has_bias = kernel, bias
        self.in_proj = Linear(d, 3 * d, bias=bias)
        conv = Module()
        conv.param("weight", (d, 1, kernel))
        if bias:
            conv.param("bias", (d,))
        self.conv = conv
        self.out_proj = Linear(d, d, bias=bias)

    @classmethod
    def module(cls, kernel: int, bias: bool = False):
        """The ``LinearAttentionSpec.module`` factory for blocks of this kernel and bias."""
        return partial(cls, kernel=kernel, bias=bias)

    def forward(self, h, ctx, index: int):
        batch, length, d = h.shape
        keep = ctx.padding_keep(length, h.dtype)
        if keep is not None:
            h = h * keep
        projected = self.in_proj(h)
        b, c, x = (projected[..., i * d:(i + 1) * d] for i in range(3))
        gated = (b * x).contiguous()
        if keep is not None and ctx.padding_is_layout:
            # a server's left padding: its projections' biases feed the convolution nothing either (transformers'
            # do), so that a row's first token sees no input before it, as alone
            gated = gated * keep
        states = None
        if ctx.cache is not None:
            states = ctx.cache.__dict__.setdefault("short_conv_states", {})
            if ctx.cache.position == 0:
                states.pop(index, None)
        history = (states or {}).get(index)
        if history is None:
            history = Tensor(np.zeros((batch, self.kernel - 1, d), np.float32), dtype=gated.dtype)
        out = F.causal_conv1d(gated, self.conv.weight, self.conv.bias if self.has_bias else None,
                              history if self.kernel > 1 else None)
        if states is not None and self.kernel > 1:
            states[index] = F.cat([history, gated], 1)[:, -(self.kernel - 1):].detach()
        return self.out_proj(c * out)


register_row_state("short_conv_states")  # per row: a server's batch moves it with its row's keys and values
