"""The Mamba mixers (``mixer`` of a Mamba block; ``mamba`` of a hybrid decoder's state-space layer).

A Mamba-1 mixer (Mamba-2's: :class:`Mamba2Mixer`): in_proj -> [x | z]; x through the causal depthwise conv1d
(F.causal_conv1d) and silu; x_proj -> dt, B, C (Falcon-Mamba: each RMS-normalised without weight); delta =
softplus(dt_proj(dt)); the selective scan (vkformers_ssm.scan) with A = -exp(A_log) and the skip D; times silu(z);
out_proj. Padded positions are zeroed before in_proj and after the conv, as transformers does.

In a hybrid decoder (``vkformers_ssm/model.py``'s :class:`HybridForCausalLM`) a state-space layer is the decoder
kit's linear-attention slot (``LinearAttentionSpec.module``) filled with :class:`HybridMambaMixer` or
:class:`HybridMamba2Mixer`: the same mixer called as the kit calls a linear-attention module, ``(normed hidden states, Context, layer index)``, its
states on the kit's KV cache (:class:`CacheStates`), restarted at position 0 as the kit's Gated DeltaNet does.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.cache import register_row_state
from vkformers.models.layers import Linear, RMSNorm
from vkformers.models.module import Module

from vkformers_ssm.scan import selective_scan
from vkformers_ssm.ssd import chunked_scan


@dataclass(frozen=True)
class MambaSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    state_size: int
    conv_kernel: int
    time_step_rank: int
    norm_eps: float
    hidden_act: str = "silu"
    use_bias: bool = False            # in_proj, out_proj
    use_conv_bias: bool = True
    tie_embeddings: bool = True
    residual_in_fp32: bool = True
    bcdt_norm_eps: float | None = None  # Falcon-Mamba: weightless RMSNorm of dt, B and C before use
    bcdt_norm_weights: bool = False     # Jamba: those norms have weights (dt_layernorm, b_layernorm, c_layernorm)
    # Mamba-2: heads of head_dim channels, each with one scalar A, D and dt (dt_bias); B and C in n_groups groups
    # of heads, from the conv like x; out = gated group RMSNorm(y * silu(z)) (eps norm_eps)
    mamba2: bool = False
    num_heads: int = 0
    head_dim: int = 0
    n_groups: int = 1
    chunk_size: int = 256  # Mamba-2: steps per chunk of the chunked scan (prefill, training)
    # Mamba-2 in hybrids: the gated norm's place ("after_gate": norm(y * silu(z)), Mamba-2's; "before_gate":
    # norm(y) * silu(z); None: y * silu(z), no norm), Falcon-H1's muP scalings of the mixer's input and of the
    # in_proj sections [z, x, B, C, dt]
    gated_norm: str | None = "after_gate"
    in_multiplier: float = 1.0
    proj_multipliers: tuple[float, ...] | None = None
    dt_min: float = 0.0  # Nemotron-H: dt clamped below where transformers runs the chunked scan (not the recurrent step)
    # Zamba: a Mamba-1 mixer in ``mamba1_heads`` heads of channels, each with its own x_proj and dt_proj (B and C
    # per head: the scan's groups), in_proj interleaving x and z per channel
    mamba1_heads: int = 0


class MambaMixer(Module):
    def __init__(self, spec: MambaSpec):
        super().__init__()
        self.spec = spec
        d, inner, n, rank = spec.hidden_size, spec.intermediate_size, spec.state_size, spec.time_step_rank
        self.in_proj = Linear(d, 2 * inner, bias=spec.use_bias)
        conv = Module()
        conv.param("weight", (inner, 1, spec.conv_kernel))
        if spec.use_conv_bias:
            conv.param("bias", (inner,))
        self.conv1d = conv
        self.x_proj = Linear(inner, rank + 2 * n, bias=False)
        self.dt_proj = Linear(rank, inner, bias=True)
        self.param("A_log", (inner, n))
        self.param("D", (inner,))
        self.out_proj = Linear(inner, d, bias=spec.use_bias)
        if spec.bcdt_norm_weights:
            self.dt_layernorm = RMSNorm(rank, eps=spec.bcdt_norm_eps)
            self.b_layernorm = RMSNorm(n, eps=spec.bcdt_norm_eps)
            self.c_layernorm = RMSNorm(n, eps=spec.bcdt_norm_eps)

    def forward(self, h, keep, cache, index: int):
        s = self.spec
        inner, n, rank, past = s.intermediate_size, s.state_size, s.time_step_rank, s.conv_kernel - 1
        batch = h.shape[0]
        if keep is not None:
            h = h * keep
        xz = self.in_proj(h)
        x, z = xz[..., :inner], xz[..., inner:]
        history, state = (None, None) if cache is None else cache.read(index, batch, past, inner, x.dtype)
        x_in = x.contiguous()
        x = F.silu(F.causal_conv1d(x_in, self.conv1d.weight, self.conv1d.bias if s.use_conv_bias else None, history))
        if keep is not None:
            x = x * keep
        projected = self.x_proj(x)
        dt_in, B, C = projected[..., :rank], projected[..., rank:rank + n], projected[..., rank + n:]
        if s.bcdt_norm_weights:
            dt_in, B, C = (norm(v.contiguous()) for norm, v in
                           ((self.dt_layernorm, dt_in), (self.b_layernorm, B), (self.c_layernorm, C)))
        elif s.bcdt_norm_eps is not None:
            dt_in, B, C = (F.rms_norm(v.contiguous(), None, eps=s.bcdt_norm_eps) for v in (dt_in, B, C))
        elif projected.shape[0] * projected.shape[1] == 1:  # one token of one row: B and C cast as one stay dense
            BC = projected[..., rank:].float()
            B, C = BC[..., :n], BC[..., n:]
        delta = F.softplus(self.dt_proj(dt_in).float())
        A = self.A_log.float().exp() * -1.0
        y, last = selective_scan(x, delta, A, B, C, self.D, state)
        if cache is not None:
            cache.write(index, F.cat([history, x_in], 1)[:, -past:], last)
        y = y * F.silu(z.float())
        return self.out_proj(y.cast(h.dtype))


class Mamba2Mixer(Module):
    """Mamba-2's mixer: in_proj -> [z | x B C | dt]; the conv + silu over [x B C]; per head scalar A = -exp(A_log),
    D and dt = softplus(dt + dt_bias); B and C per group of heads; the chunked scan (vkformers_ssm.ssd) over a
    sequence, the selective-scan kernel (each head's A, D, dt given to its channels) for a one-token step; then
    RMSNorm over each group of channels of y * silu(z), times norm.weight; out_proj."""

    def __init__(self, spec: MambaSpec):
        super().__init__()
        self.spec = spec
        d, inner, n, groups = spec.hidden_size, spec.intermediate_size, spec.state_size, spec.n_groups
        self.conv_channels = inner + 2 * groups * n
        self.in_proj = Linear(d, inner + self.conv_channels + spec.num_heads, bias=spec.use_bias)
        conv = Module()
        conv.param("weight", (self.conv_channels, 1, spec.conv_kernel))
        if spec.use_conv_bias:
            conv.param("bias", (self.conv_channels,))
        self.conv1d = conv
        self.param("dt_bias", (spec.num_heads,))
        self.param("A_log", (spec.num_heads,))
        self.param("D", (spec.num_heads,))
        if spec.gated_norm is not None:
            self.norm = RMSNorm(inner, eps=spec.norm_eps)
        self.out_proj = Linear(inner, d, bias=spec.use_bias)
        scale = None
        if spec.proj_multipliers is not None:  # one factor per in_proj section [z, x, B, C, dt]
            widths = (inner, inner, groups * n, groups * n, spec.num_heads)
            scale = np.repeat(np.asarray(spec.proj_multipliers, np.float32), widths)
        object.__setattr__(self, "proj_scale", scale)

    def _heads_to_channels(self, x, *shape):
        """A per-head tensor [..., heads] as a broadcast view [..., heads, head_dim, *shape]: an elementwise op
        reading it writes the per-channel values with no copy first."""
        s = self.spec
        lead = tuple(x.shape[:-1])
        expanded = x.reshape(*lead, s.num_heads, 1, *([1] * len(shape)))
        return expanded.expand(*lead, s.num_heads, s.head_dim, *shape)

    def _per_channel(self, x, *shape):
        """A per-head tensor [..., heads] given to each of the head's head_dim channels: [..., heads * head_dim]
        (then ``shape`` trailing sizes of 1 broadcast to them)."""
        lead = tuple(x.shape[:-1])
        return self._heads_to_channels(x, *shape).contiguous().reshape(*lead, self.spec.intermediate_size, *shape)

    def _decode_scan(self, xbc, dt_in, state):
        """The one-token step's recurrent update, y [batch, 1, inner] and the next state. Each op that computes a
        per-head value (dt, A, D) reads the heads broadcast to their channels, and x, B and C are views of xbc cast
        once: a decode step is short of GPU work, so every copy saved is a dispatch saved."""
        s = self.spec
        inner, n, groups = s.intermediate_size, s.state_size, s.n_groups
        batch = xbc.shape[0]
        xbc = xbc.float()
        x = xbc[..., :inner]
        B = xbc[..., inner:inner + groups * n].reshape(batch, 1, groups, n)
        C = xbc[..., inner + groups * n:].reshape(batch, 1, groups, n)
        lead = (batch, 1, inner)
        dt = F.softplus((self._heads_to_channels(dt_in) + self._heads_to_channels(self.dt_bias)).float())
        if s.dt_min > 0.0 and state is None:
            dt = dt.maximum(s.dt_min)
        A = self._heads_to_channels(self.A_log, n).float().exp() * -1.0
        D = self._heads_to_channels(self.D).float()
        return selective_scan(x, dt.reshape(lead), A.reshape(inner, n), B, C, D.reshape(inner), state)

    def forward(self, h, keep, cache, index: int):
        s = self.spec
        inner, n, groups, past = s.intermediate_size, s.state_size, s.n_groups, s.conv_kernel - 1
        batch, length = h.shape[:2]
        if keep is not None:
            h = h * keep
        if s.in_multiplier != 1.0:
            h = h * s.in_multiplier
        projected = self.in_proj(h)
        if self.proj_scale is not None:
            projected = projected * Tensor(self.proj_scale, dtype=projected.dtype)
        z = projected[..., :inner]
        xbc_in = projected[..., inner:inner + self.conv_channels].contiguous()
        dt_in = projected[..., inner + self.conv_channels:]
        history, state = (None, None) if cache is None else cache.read(index, batch, past, self.conv_channels,
                                                                        xbc_in.dtype)
        xbc = F.silu(F.causal_conv1d(xbc_in, self.conv1d.weight, self.conv1d.bias if s.use_conv_bias else None,
                                     history))
        if keep is not None:
            xbc = xbc * keep
        if length > 1:  # prefill and training: the chunked scan's matrix products
            x = xbc[..., :inner].contiguous()
            B = xbc[..., inner:inner + groups * n].contiguous().reshape(batch, length, groups, n)
            C = xbc[..., inner + groups * n:].contiguous().reshape(batch, length, groups, n)
            dt_heads = F.softplus((dt_in + self.dt_bias).float())
            if s.dt_min > 0.0:
                dt_heads = dt_heads.maximum(s.dt_min)
            A_heads = self.A_log.float().exp() * -1.0
            y, last = chunked_scan(x.reshape(batch, length, s.num_heads, s.head_dim), dt_heads, A_heads, B, C,
                                   s.chunk_size, state)
            y = y + x.float() * self._per_channel(self.D.float())
        else:  # a decode step: the recurrent update
            y, last = self._decode_scan(xbc, dt_in, state)
        if cache is not None:
            cache.write(index, F.cat([history, xbc_in], 1)[:, -past:], last)
        if s.gated_norm is None:
            return self.out_proj((y * F.silu(z.float())).cast(h.dtype))
        gated = y * F.silu(z.float()) if s.gated_norm == "after_gate" else y
        normed = F.rms_norm(gated.reshape(batch, length, groups, inner // groups), None, eps=s.norm_eps)
        out = self.norm.weight.float() * normed.reshape(batch, length, inner)
        if s.gated_norm == "before_gate":
            out = out * F.silu(z.float())
        return self.out_proj(out.cast(h.dtype))


class ZambaMambaMixer(Module):
    """Zamba's multi-head Mamba-1 mixer: in_proj rows alternate x and z per channel; x through the conv and silu,
    then split in heads of intermediate_size / heads channels, each with x_proj_weight[h] -> (dt, B, C) and
    delta = softplus(dt_proj_weight[h] dt + dt_proj_bias[h]); the selective scan with one group of channels per
    head (A_log, D stored [heads, head channels, ...]), times silu(z); out_proj."""

    def __init__(self, spec: MambaSpec):
        super().__init__()
        self.spec = spec
        d, inner, n, rank, heads = (spec.hidden_size, spec.intermediate_size, spec.state_size, spec.time_step_rank,
                                    spec.mamba1_heads)
        head = inner // heads
        self.in_proj = Linear(d, 2 * inner, bias=spec.use_bias)
        conv = Module()
        conv.param("weight", (inner, 1, spec.conv_kernel))
        if spec.use_conv_bias:
            conv.param("bias", (inner,))
        self.conv1d = conv
        self.param("x_proj_weight", (heads, rank + 2 * n, head))
        self.param("dt_proj_weight", (heads, head, rank))
        self.param("dt_proj_bias", (heads, head))
        self.param("A_log", (heads, head, n))
        self.param("D", (heads, head))
        self.out_proj = Linear(inner, d, bias=spec.use_bias)

    def forward(self, h, ctx, index: int):
        keep, cache = _kit_inputs(h, ctx)
        s = self.spec
        inner, n, rank, heads, past = (s.intermediate_size, s.state_size, s.time_step_rank, s.mamba1_heads,
                                       s.conv_kernel - 1)
        head = inner // heads
        batch, length = h.shape[:2]
        if keep is not None:
            h = h * keep
        xz = self.in_proj(h).reshape(batch, length, inner, 2)
        x_in, z = xz[..., 0].contiguous(), xz[..., 1].contiguous()
        history, state = (None, None) if cache is None else cache.read(index, batch, past, inner, x_in.dtype)
        x = F.silu(F.causal_conv1d(x_in, self.conv1d.weight, self.conv1d.bias if s.use_conv_bias else None,
                                   history))
        if keep is not None:
            x = x * keep
        deltas, Bs, Cs = [], [], []
        for k in range(heads):
            projected = F.linear(x[..., k * head:(k + 1) * head].contiguous(), self.x_proj_weight[k])
            dt_in = projected[..., :rank].contiguous()
            Bs.append(projected[..., rank:rank + n].contiguous())
            Cs.append(projected[..., rank + n:].contiguous())
            deltas.append(F.linear(dt_in, self.dt_proj_weight[k], self.dt_proj_bias[k]))
        delta = F.softplus(F.cat(deltas, -1).float())
        A = (self.A_log.float().exp() * -1.0).reshape(inner, n)
        y, last = selective_scan(x, delta, A, F.stack(Bs, 2), F.stack(Cs, 2), self.D.reshape(inner), state)
        if cache is not None:
            cache.write(index, F.cat([history, x_in], 1)[:, -past:], last)
        y = y * F.silu(z.float())
        return self.out_proj(y.cast(h.dtype))


register_row_state("ssm_states")  # per row: a server's batch moves it with its row's keys and values


class CacheStates:
    """A mixer's states on a KV cache: each layer's (conv inputs, scan state) in ``cache.ssm_states``; zeros and no
    state at position 0."""

    def __init__(self, cache):
        self.cache = cache
        self.states = cache.__dict__.setdefault("ssm_states", {})

    def read(self, index: int, batch: int, past: int, channels: int, dtype):
        if self.cache.position == 0 or index not in self.states:
            return Tensor(np.zeros((batch, past, channels), np.float32), dtype=dtype), None
        return self.states[index]

    def write(self, index: int, conv_inputs, state) -> None:
        self.states[index] = (conv_inputs.detach(), state.detach())


def _kit_inputs(h, ctx):
    """What a mixer reads from the kit's Context: the keep mask of padded positions (or None) and its states."""
    length = h.shape[1]
    keep = ctx.padding_keep(length, h.dtype)
    return keep, (CacheStates(ctx.cache) if ctx.cache is not None else None)


class HybridMambaMixer(MambaMixer):
    """A Mamba-1 mixer in a decoder-kit layer (Jamba): padded positions (the context's mask) are zeroed as
    transformers' apply_mask_to_padding_states does, the states live on the context's cache."""

    def forward(self, h, ctx, index: int):
        return super().forward(h, *_kit_inputs(h, ctx), index)


class HybridMamba2Mixer(Mamba2Mixer):
    """A Mamba-2 mixer in a decoder-kit layer, as :class:`HybridMambaMixer`."""

    def forward(self, h, ctx, index: int):
        return super().forward(h, *_kit_inputs(h, ctx), index)


def mixer_module(mamba):
    """The kit's ``LinearAttentionSpec.module`` for a mixer of the given MambaSpec (Mamba-1 or Mamba-2)."""
    return partial(_build_mixer, mamba)


def _build_mixer(mamba, decoder_spec):
    return mixer_class(mamba)(mamba)


def mixer_class(mamba):
    """The hybrid-layer mixer class for a MambaSpec: Mamba-2's, Zamba's multi-head Mamba-1, or Mamba-1's."""
    return HybridMamba2Mixer if mamba.mamba2 else ZambaMambaMixer if mamba.mamba1_heads else HybridMambaMixer
