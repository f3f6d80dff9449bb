"""Mamba-2's chunked scan (state-space duality), from engine ops: matrix products within chunks of ``chunk`` steps
and one product across chunks, as transformers' torch path (``mamba2_chunk_scan``) computes it. Its backward is
autograd's, and its products run on the matmul kernels, where the sequential scan (``vkformers_ssm.scan``) walks
every step; generation's one-token steps use that one.

Per head h (scalar A_h < 0) with state S [head_dim, state], dt_t = the step's softplus'ed time step:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t

Within a chunk, with a_t = dt_t A_h and cs its running sum from the chunk's start:
y = ((C B^T) * exp(cs_l - cs_s) [s <= l]) (dt x) + exp(cs_l) C S_start^T, and the chunk's state adds
sum_s exp(cs_last - cs_s) (dt x)_s B_s^T to exp(cs_last) S_start. The states entering the chunks are one product
with the chunks' decays, exp(the sum of the totals of the chunks between), summed exactly as transformers does.

B and C stay per group of heads (C B^T, and the products with the states, are one per group); only the decay
differs per head. The decay matrices come from one small kernel (``segment_decay``, shaders/segment_decay.comp)
rather than a difference, a mask and an exp over [chunk, chunk] per head and chunk. In training the scan keeps
only its inputs for the backward and recomputes its inside there (``vkformers.engine.checkpoint``): every layer's
[chunk, chunk] matrices (0.5 GiB each for 4 x 2048 tokens at 64 heads and chunks of 256) would otherwise stay
alive until the backward reaches the layer.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.checkpoint import checkpoint
from vkformers.engine.function import Function, KernelOp, grad_enabled, node, wrap
from vkformers.engine.kernels.transformer_args import checked, fits_uint32, positive
from vkformers.engine.kernels import grid
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.runtime import dtypes as dt


class ChunkedScanShapeError(VkformersError, ValueError):
    """Inputs of the chunked scan whose shapes do not fit together."""


def _padded(v, extra: int):
    """v [batch, length, ...] with ``extra`` zero steps appended (a chunk's tail: no input, no decay)."""
    if not extra:
        return v
    tail = F.zeros((1,) * v.ndim).expand(v.shape[0], extra, *v.shape[2:])
    return F.cat([v, tail], 1)


class SegmentDecayKernel(KernelOp):
    """out [rows, n, n] from cs [rows, n] (plugins/ssm/shaders/segment_decay.comp)."""

    name = "segment_decay"

    def emit(self, seq, outs, ins):
        (out,), (cs,) = outs, ins
        rows, n = self.rows, self.n
        cs = checked(cs.operand, "float32", rows * n, "segment_decay cs")
        out = checked(out.operand, "float32", rows * n * n, "segment_decay out")
        seq.dispatch(seq.device.kernel("segment_decay", "forward"), [cs.buffer, out.buffer],
                     grid(rows * n * n, 256, seq.device.limits["max_compute_work_group_count_x"]),
                     push=[rows, n, cs.offset, out.offset])


class SegmentDecayFn(Function):
    def forward(self, cs):
        *lead, n = cs.shape
        rows = int(np.prod(lead, dtype=np.int64))
        positive(rows=rows, n=n)
        fits_uint32("segment_decay", rows * n * n)
        out = node(SegmentDecayKernel(rows=rows, n=n), [cs], [((*lead, n, n), dt.float32)])[0]
        self.saved = (out,)
        return out

    def backward(self, g):
        # d out[l, s] / d cs[l] = out[l, s], / d cs[s] = -out[l, s]: row sums less column sums of g * out
        weighted = g * wrap(self.saved[0])
        return weighted.sum(-1) - weighted.sum(-2)


def segment_decay(cs):
    """exp(cs[..., l] - cs[..., s]) for s <= l, 0 above the diagonal: [..., n, n] (float32) from running sums of
    log-decays cs [..., n], the decay from step s to step l of a recurrence within a chunk. One kernel; the
    masked entries are zeros, not exp of a difference that may overflow."""
    return SegmentDecayFn.apply(cs.float())


def _check(x, dt, A, B, C, chunk: int, initial_state) -> None:
    if x.ndim != 4 or B.ndim != 4:
        raise ChunkedScanShapeError(f"chunked_scan: x must be [batch, length, heads, head_dim] and B, C [batch, "
                                    f"length, groups, state], got x {x.shape} and B {B.shape}")
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    expected = {"dt": (batch, length, heads), "A": (heads,), "B": (batch, length, groups, state),
                "C": (batch, length, groups, state)}
    if initial_state is not None:
        expected["initial_state"] = (batch, heads * head_dim, state)
    got = {"dt": dt, "A": A, "B": B, "C": C, "initial_state": initial_state}
    for name, shape in expected.items():
        if tuple(got[name].shape) != shape:
            raise ChunkedScanShapeError(f"chunked_scan: {name} must be {shape}, got {tuple(got[name].shape)}")
    if heads % groups:
        raise ChunkedScanShapeError(f"chunked_scan: {heads} heads do not split in {groups} groups of B and C")
    if chunk < 1:
        raise ChunkedScanShapeError(f"chunked_scan: the chunk size must be at least 1, got {chunk}")


def _chunk_decays(totals):
    """exp(sum of totals[k] for z < k <= c) for z <= c, else 0: [..., chunks + 1, chunks + 1] from totals
    [..., chunks + 1] (totals[0] = 0: the initial state's slot). Summed, not differenced, so that long sequences
    of strong decay keep their precision (transformers' segment_sum)."""
    n = totals.shape[-1]
    later = np.arange(n)[:, None] > np.arange(n)[None, :]                     # [k, z]: k > z
    terms = F.where(later, totals.unsqueeze(-1).expand(*totals.shape, n), 0.0)
    sums = Tensor(np.tril(np.ones((n, n), np.float32))) @ terms                 # [c, z]: the k <= c of them
    return F.where(np.tril(np.ones((n, n), bool)), sums, float("-inf")).exp()


def _scan(x, dt, A, B, C, chunk: int, initial_state):
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    repeat = heads // groups
    extra = (-length) % chunk
    total = length + extra
    chunks = total // chunk
    b, g, r, c, q, p, n = batch, groups, repeat, chunks, chunk, head_dim, state
    x, dt, B, C = (_padded(v.float(), extra) for v in (x, dt, B, C))

    # Layouts: per head [b, g, r, c, q, ...] (r: the head within its group), per group [b, g, c, q, n].
    dt_heads = dt.reshape(b, c, q, g, r).permute(0, 3, 4, 1, 2)                     # a view
    a = dt_heads * A.float().reshape(1, g, r, 1, 1)                                  # [b, g, r, c, q]
    cs = a @ Tensor(np.triu(np.ones((q, q), np.float32)))                            # running sums within chunks
    xs = x.reshape(b, c, q, g, r, p).permute(0, 3, 4, 1, 2, 5) * dt_heads.unsqueeze(-1)  # [b, g, r, c, q, p]
    Bs, Cs = (v.reshape(b, c, q, g, n).permute(0, 3, 1, 2, 4).contiguous() for v in (B, C))  # [b, g, c, q, n]

    # Within chunks: ((C B^T) * decay) (dt x), C B^T once per group.
    scores = (Cs @ Bs.transpose(-1, -2)).unsqueeze(2) * segment_decay(cs)           # [b, g, r, c, q, q]
    y_within = scores @ xs                                                           # [b, g, r, c, q, p]

    # Each chunk's own state (from a zero start), per group: (decayed dt x)^T B -> [b, g, c, r * p, n].
    last = cs[..., q - 1:q]                                                          # [b, g, r, c, 1]
    weighted = xs.permute(0, 1, 3, 4, 2, 5) * (last - cs).exp().permute(0, 1, 3, 4, 2).unsqueeze(-1)
    own = weighted.reshape(b, g, c, q, r * p).transpose(-1, -2) @ Bs
    own = own.reshape(b, g, c, r, p, n).permute(0, 1, 3, 2, 4, 5).reshape(b, heads, c, p * n)

    # Across chunks: the state entering chunk k and the last one, one product over [start | chunks' own states].
    start = (F.zeros((1, 1, 1, 1)).expand(b, heads, 1, p * n) if initial_state is None
             else initial_state.detach().float().reshape(b, heads, 1, p * n))
    totals = F.cat([F.zeros((1, 1, 1)).expand(b, heads, 1), last.reshape(b, heads, c)], 2)
    states = _chunk_decays(totals) @ F.cat([start, own], 2)                          # [b, h, c + 1, p * n]
    entering = states[:, :, :c].reshape(b, g, r, c, p, n).permute(0, 1, 3, 5, 2, 4).reshape(b, g, c, n, r * p)
    y_across = (Cs @ entering).reshape(b, g, c, q, r, p) * cs.exp().permute(0, 1, 3, 4, 2).unsqueeze(-1)

    y = y_within.permute(0, 3, 4, 1, 2, 5) + y_across.permute(0, 2, 3, 1, 4, 5)     # [b, c, q, g, r, p]
    y = y.reshape(b, total, heads * head_dim)
    if extra:
        y = y[:, :length]
    return y, states[:, :, c].reshape(b, heads * head_dim, state)


def chunked_scan(x, dt, A, B, C, chunk: int, initial_state=None):
    """y [batch, length, heads * head_dim] (without the D skip) and the last state [batch, heads * head_dim, state],
    float32: x [batch, length, heads, head_dim]; dt [batch, length, heads] (after softplus); A [heads]; B, C
    [batch, length, groups, state] (each group shared by heads / groups consecutive heads); ``initial_state``
    [batch, heads * head_dim, state] or None (zeros; it gets no gradient: a cache's)."""
    _check(x, dt, A, B, C, chunk, initial_state)
    if not grad_enabled() or not any(v.requires_grad for v in (x, dt, A, B, C)):
        return _scan(x, dt, A, B, C, chunk, initial_state)
    return checkpoint(lambda *inputs: _scan(*inputs, chunk, initial_state), x, dt, A, B, C)
