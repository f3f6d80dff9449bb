"""Mamba-2's chunked scan (state-space duality), from engine ops: matrix products within chunks of ``chunk`` steps
and a short recurrence across chunks, as transformers' torch path (``mamba2_chunk_scan``) computes it. Its backward
is autograd's, and its products run on the matmul kernels (cooperative matrices on a GPU that has them), where the
sequential scan (``vkformers_ssm.scan``) walks every step; generation's one-token steps use that one.

Per head h (scalar A_h < 0) with state S [head_dim, state], dt_t = the step's softplus'ed time step:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t

Within a chunk, with a_t = dt_t A_h and cs its running sum from the chunk's start:
y = ((C B^T) * exp(cs_l - cs_s) [s <= l]) (dt x) + exp(cs_l) C S_start^T, and the chunk's state adds
sum_s exp(cs_last - cs_s) (dt x)_s B_s^T to exp(cs_last) S_start.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor


def _padded(v, extra: int):
    """v [batch, length, ...] with ``extra`` zero steps appended (a chunk's tail: no input, no decay)."""
    if not extra:
        return v
    return F.cat([v, Tensor(np.zeros((v.shape[0], extra, *v.shape[2:]), np.float32), dtype=v.dtype)], 1)


def chunked_scan(x, dt, A, B, C, chunk: int, initial_state=None):
    """y [batch, length, heads * head_dim] (without the D skip) and the last state [batch, heads * head_dim, state],
    float32: x [batch, length, heads, head_dim]; dt [batch, length, heads] (after softplus); A [heads]; B, C
    [batch, length, groups, state] (each group shared by heads / groups consecutive heads); ``initial_state``
    [batch, heads * head_dim, state] or None (zeros)."""
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    extra = (-length) % chunk
    total = length + extra
    chunks, repeat = total // chunk, heads // groups
    x, dt, B, C = (_padded(v.float(), extra) for v in (x, dt, B, C))
    if repeat > 1:  # each head its group's B and C
        B, C = (v.reshape(batch, total, groups, 1, state).expand(batch, total, groups, repeat, state)
                .contiguous().reshape(batch, total, heads, state) for v in (B, C))

    def by_chunk(v):  # [batch, total, heads, *tail] -> [batch, heads, chunks, chunk, *tail]
        tail = tuple(v.shape[3:])
        order = (0, 3, 1, 2) + tuple(range(4, 4 + len(tail)))
        return v.reshape(batch, chunks, chunk, heads, *tail).permute(*order).contiguous()

    xs = by_chunk(x * dt.reshape(batch, total, heads, 1))                      # [b, h, c, l, p]
    Bs, Cs = by_chunk(B), by_chunk(C)                                          # [b, h, c, l, n]
    a = by_chunk((dt * A.float()).reshape(batch, total, heads, 1)).reshape(batch, heads, chunks, chunk)
    upper = Tensor(np.triu(np.ones((chunk, chunk), np.float32)))
    cs = a @ upper                                                             # running sums within each chunk
    causal = np.tril(np.ones((chunk, chunk), bool))
    decay = F.where(causal, cs.reshape(batch, heads, chunks, chunk, 1) - cs.reshape(batch, heads, chunks, 1, chunk),
                    float("-inf")).exp()                                       # [b, h, c, l, s]
    y_within = ((Cs @ Bs.transpose(-1, -2)) * decay) @ xs                     # [b, h, c, l, p]

    last = cs[..., chunk - 1:chunk]                                            # [b, h, c, 1]
    contributions = (xs * (last - cs).exp().reshape(batch, heads, chunks, chunk, 1)).transpose(-1, -2) @ Bs
    chunk_decay = last.exp()                                                   # [b, h, c, 1]
    current = (Tensor(np.zeros((batch, heads, head_dim, state), np.float32)) if initial_state is None
               else initial_state.detach().float().reshape(batch, heads, head_dim, state))
    starts = []
    for k in range(chunks):  # the state entering each chunk
        starts.append(current)
        current = current * chunk_decay[:, :, k].reshape(batch, heads, 1, 1) + contributions[:, :, k]
    start = F.stack(starts, 2)                                                 # [b, h, c, p, n]
    y_across = (Cs @ start.transpose(-1, -2)) * cs.exp().reshape(batch, heads, chunks, chunk, 1)
    y = (y_within + y_across).permute(0, 2, 3, 1, 4).reshape(batch, total, heads * head_dim)
    if extra:
        y = y[:, :length]
    return y, current.reshape(batch, heads * head_dim, state)
