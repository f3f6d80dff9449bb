"""RWKV-4's blocks on the decoder kit: the time mix (WKV recurrence) in the linear-attention slot, the channel mix in
the MLP slot, and the layer that passes both the context (their token shift and state live on the cache).

Token shift: each mix reads ``x_t * mix + x_{t-1} * (1 - mix)`` of its normed input (x_{-1}: zeros, or the last
token of the previous call with a cache).

    time mix:     r, k, v = sigmoid(receptance(.)), key(.), value(.) of three shifted mixes
                  wkv_t = (sum_{i<t} e^{-(t-1-i) e^w + k_i} v_i + e^{u + k_t} v_t) / (same with v = 1)
                  out = output(r * wkv)                                             (w: time_decay, u: time_first)
    channel mix:  sigmoid(receptance(.)) * value(relu(key(.))^2)

The recurrence runs token by token in float32 from engine ops, as transformers' CPU path does, keeping numerator
and denominator scaled by a running maximum of the exponents. That maximum is computed without gradient: the
ratios do not depend on it, so autograd through the rest gives the exact backward pass. transformers' RWKV reads no
attention mask (padding runs as tokens), and neither do these blocks, except on a cache whose padding only lays rows
out (``KVCache.padding_is_layout``, a server's batch): there left padding leaves the state as it was and the first
token after it sees zeros as its predecessor, as if the row were alone. ``rescale_every`` (transformers halves the
stream and the output weights every that many layers in eval mode, against float16 overflow) changes the results
only through the layer norms' eps, and is not applied.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.cache import register_row_state
from vkformers.models.decoder import DecoderLayer, make_norm
from vkformers.models.layers import Linear
from vkformers.models.module import Module, place

_NO_EXPONENT = -1e38  # the running maximum before any token (transformers' initial max_state)


def row_states(ctx, name: str, index: int):
    """This layer's entry of the cache's per-row state ``name`` (restarted at position 0), and the dict, or
    (None, None) without a cache."""
    if ctx.cache is None:
        return None, None
    states = ctx.cache.__dict__.setdefault(name, {})
    if ctx.cache.position == 0:
        states.pop(index, None)
    return states.get(index), states


def layout_padding(ctx, length: int):
    """The current tokens' mask [B, T] (float32 numpy) where the cache says padding is layout and some is here,
    else None (padding runs as tokens)."""
    return ctx.padding_mask(length) if ctx.padding_is_layout else None


def _shifted(h, previous, mask=None):
    """[previous | h[:, :-1]]: each token's predecessor; ``previous`` [B, hidden] or None (zeros). With ``mask``
    (layout padding) a padded predecessor reads as zeros."""
    batch, length, d = h.shape
    if previous is None:
        previous = Tensor(np.zeros((batch, d), np.float32), dtype=h.dtype)
    first = previous.reshape(batch, 1, d)
    shifted = F.cat([first, h[:, :length - 1]], 1) if length > 1 else first
    if mask is not None:
        before = np.concatenate([np.ones((batch, 1), np.float32), mask[:, :length - 1]], 1)
        shifted = shifted * Tensor(before[:, :, None], dtype=h.dtype)
    return shifted


def _last_token(h, mask=None):
    """The token shift's state for the next call: the last token, zeros in rows where it is padding (so that the
    next call's first token finds none before it, as within one call)."""
    last = h[:, h.shape[1] - 1].contiguous()
    if mask is not None and not mask[:, -1].all():
        last = last * Tensor(mask[:, -1:], dtype=h.dtype)
    return last.detach()


def _mixed(h, shifted, mix):
    return h * mix + shifted * (mix * -1.0 + 1.0)


class RwkvTimeMix(Module):
    """RWKV-4's attention (``attention``): time_decay, time_first, time_mix_{key,value,receptance}, and the key,
    value, receptance, output projections; called ``(normed hidden states, Context, layer index)``."""

    def __init__(self, spec, *, width: int):
        super().__init__()
        d = spec.hidden_size
        self.param("time_decay", (width,))
        self.param("time_first", (width,))
        for name in ("key", "value", "receptance"):
            self.param(f"time_mix_{name}", (1, 1, d))
            setattr(self, name, Linear(d, width, bias=False))
        self.output = Linear(width, d, bias=False)

    @classmethod
    def module(cls, width: int):
        """The ``LinearAttentionSpec.module`` factory for time mixes of this attention width."""
        return partial(cls, width=width)

    def forward(self, h, ctx, index: int):
        batch, length, _ = h.shape
        state, states = row_states(ctx, "rwkv_states", index)
        previous, num, den, top = state if state is not None else (None, None, None, None)
        padding = layout_padding(ctx, length)
        shifted = _shifted(h, previous, padding)
        key = self.key(_mixed(h, shifted, self.time_mix_key)).float()
        value = self.value(_mixed(h, shifted, self.time_mix_value)).float()
        receptance = F.sigmoid(self.receptance(_mixed(h, shifted, self.time_mix_receptance)))
        width = key.shape[-1]
        if num is None:
            num = Tensor(np.zeros((batch, width), np.float32))
            den = Tensor(np.zeros((batch, width), np.float32))
            top = Tensor(np.full((batch, width), _NO_EXPONENT, np.float32))
        decay = self.time_decay.float().exp() * -1.0
        first = self.time_first.float()
        decay_const, first_const = decay.detach(), first.detach()
        outputs = []
        for t in range(length):
            k, v = key[:, t], value[:, t]
            bonus = k + first
            top_out = top.maximum(k.detach() + first_const)
            e1, e2 = (top - top_out).exp(), (bonus - top_out).exp()
            outputs.append((e1 * num + e2 * v) / (e1 * den + e2))
            aged = top + decay
            top_next = (top + decay_const).maximum(k.detach())
            e1, e2 = (aged - top_next).exp(), (k - top_next).exp()
            if padding is None:
                num, den, top = e1 * num + e2 * v, e1 * den + e2, top_next
            else:  # a padded token leaves the state as it was
                real = Tensor(padding[:, t:t + 1])
                pad = Tensor(1.0 - padding[:, t:t + 1])
                num, den = (e1 * num + e2 * v) * real + num * pad, (e1 * den + e2) * real + den * pad
                top = top_next * real + top * pad
        wkv = F.stack(outputs, 1)
        if states is not None:
            states[index] = (_last_token(h, padding), num.detach(), den.detach(), top.detach())
        return self.output(receptance * wkv.cast(h.dtype))


class RwkvChannelMix(Module):
    """RWKV-4's feed-forward (``feed_forward``): time_mix_{key,receptance}, key [hidden -> width], receptance,
    value [width -> hidden]; called ``(normed hidden states, Context, layer index)``."""

    path = "feed_forward"

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.param("time_mix_key", (1, 1, hidden))
        self.param("time_mix_receptance", (1, 1, hidden))
        self.key = Linear(hidden, width, bias=False)
        self.receptance = Linear(hidden, hidden, bias=False)
        self.value = Linear(width, hidden, bias=False)

    def forward(self, h, ctx, index: int):
        length = h.shape[1]
        previous, states = row_states(ctx, "rwkv_channel_states", index)
        padding = layout_padding(ctx, length)
        shifted = _shifted(h, previous, padding)
        hidden = F.relu(self.key(_mixed(h, shifted, self.time_mix_key))).square()
        out = F.sigmoid(self.receptance(_mixed(h, shifted, self.time_mix_receptance))) * self.value(hidden)
        if states is not None:
            states[index] = _last_token(h, padding)
        return out


class RwkvChannelMixes:
    """The decoder kit's MLP slot filled with RWKV's channel mix on every layer."""

    def __init__(self, width: int):
        self.width = width

    def block(self, spec, index: int) -> RwkvChannelMix:
        return RwkvChannelMix(spec.hidden_size, self.width)


class RwkvLayer(DecoderLayer):
    """An RWKV block: (layer 0: ``pre_ln`` on the embeddings), x += time_mix(ln1(x)), x += channel_mix(ln2(x));
    the channel mix gets the context for its token shift's state."""

    def __init__(self, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        if index == 0:
            self.parts["pre_ln"] = place(self, "pre_ln", make_norm(spec, spec.hidden_size))

    def _sequential_residual(self, x, ctx):
        if "pre_ln" in self.parts:
            x = self.parts["pre_ln"](x)
        x = x + self.attention(self._norm("attn_in_norm", x), ctx)
        return x + self.parts["moe"](self._norm("mlp_in_norm", x), ctx, self.index)

    def _fused_decode_plan(self):
        return None  # the fused decode kernels compose the kit's plain block, not this one


# per row: a server's batch moves them with its row's keys and values
register_row_state("rwkv_states")
register_row_state("rwkv_channel_states")
