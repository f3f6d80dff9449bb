"""Depthwise conv1d over time: causal (the short convolution of state-space and linear-attention layers), and
zero-padded on both sides (the value convolutions of bidirectional encoders), on one kernel."""
from __future__ import annotations

import numpy as np

from vkformers.engine.function import Function, KernelOp, constant, node, reshape_lazy, wrap
from vkformers.engine.ops.elementwise import cat
from vkformers.engine.kernels import conv as KC
from vkformers.runtime import dtypes as dt


def _sizes(x, weight):
    batch, length, channels = x.shape
    return dict(batch=batch, length=length, channels=channels, kernel=weight.shape[-1])


class CausalConv1dKernel(KernelOp):
    name = "causal_conv1d"

    def emit(self, seq, outs, ins):
        (y,), (x, weight, *rest) = outs, ins
        bias = rest.pop(0).operand if self.has_bias else None
        history = rest.pop(0).operand if self.has_history else None
        KC.causal_conv1d(seq, x.operand, weight.operand, bias, history, y.operand, **_sizes(x, weight))


class CausalConv1dBackwardKernel(KernelOp):
    name = "causal_conv1d_backward"

    def emit(self, seq, outs, ins):
        (dx, dw), (dy, x, weight, *rest) = outs, ins
        history = rest[0].operand if rest else None
        KC.causal_conv1d_backward(seq, dy.operand, x.operand, weight.operand, history, dx.operand, dw.operand,
                                  **_sizes(x, weight))


class CausalConv1dFn(Function):
    def forward(self, x, weight, bias, history):
        weight = reshape_lazy(weight, (weight.shape[0], weight.shape[-1]))
        ins = [x, weight] + [v for v in (bias, history) if v is not None]
        self.saved = (x, weight, history)
        self.weight_shape = self.parents[1].shape
        return node(CausalConv1dKernel(has_bias=bias is not None, has_history=history is not None), ins,
                    [(x.shape, x.dtype)])[0]

    def backward(self, g):
        x, weight, history = self.saved
        ins = [g.lazy, x, weight] + ([history] if history is not None else [])
        rows = x.shape[0] * KC.dw_blocks(x.shape[1], weight.shape[-1])  # a partial per batch row and block of steps
        dx, dw = node(CausalConv1dBackwardKernel(), ins,
                      [(x.shape, x.dtype), ((rows,) + tuple(weight.shape), dt.float32)])
        dw = wrap(dw).sum(0).reshape(*self.weight_shape).cast(self.parents[1].dtype)
        bias = self.parents[2]
        db = g.float().sum((0, 1)).cast(bias.dtype) if bias is not None and self.needs_grad[2] else None
        return wrap(dx), dw, db, None  # the history (a cache's state) gets no gradient


def causal_conv1d(x, weight, bias=None, history=None):
    """y[b, t, c] = bias[c] + sum_j weight[c, j] * [history | x][b, t + j, c]: a depthwise Conv1d over time with
    kernel - 1 zeros (or ``history`` [batch, kernel - 1, channels], the inputs before x) on the left, cut to x's
    length, channels last: x [batch, length, channels]; weight [channels, kernel] or torch's [channels, 1, kernel].
    The history gets no gradient."""
    if len(x.shape) != 3:
        raise ValueError(f"causal_conv1d: x must be [batch, length, channels], got {x.shape}")
    channels, kernel = weight.shape[0], weight.shape[-1]
    if weight.numel() != channels * kernel or channels != x.shape[2]:
        raise ValueError(f"causal_conv1d: weight {weight.shape} does not fit x {x.shape} (channels last)")
    if history is not None and kernel > 1 and history.shape != (x.shape[0], kernel - 1, channels):
        raise ValueError(f"causal_conv1d: history must be {(x.shape[0], kernel - 1, channels)}, got {history.shape}")
    if kernel == 1:
        history = None
    return CausalConv1dFn.apply(x, weight, bias, history)


def depthwise_conv1d(x, weight, padding: int):
    """y[b, t, c] = sum_j weight[c, j] * x[b, t - padding + j, c], zeros outside x: torch's depthwise Conv1d
    (groups = channels, no bias) with ``padding`` zeros on each side, channels last: x [batch, length, channels],
    weight [channels, kernel] or [channels, 1, kernel]; the result has length + 2 padding - kernel + 1 rows. It is
    the causal convolution of x followed by ``padding`` zeros, read from row kernel - 1 - padding on."""
    if len(x.shape) != 3:
        raise ValueError(f"depthwise_conv1d: x must be [batch, length, channels], got {x.shape}")
    batch, length, channels = x.shape
    kernel = weight.shape[-1]
    if not 0 <= padding <= kernel - 1:
        raise ValueError(f"depthwise_conv1d: padding {padding} must lie in [0, kernel - 1 = {kernel - 1}]")
    rows = length + 2 * padding - kernel + 1
    if rows < 1:
        raise ValueError(f"depthwise_conv1d: a kernel of {kernel} with padding {padding} leaves no output of "
                         f"{length} positions")
    padded = cat([x, constant(np.zeros((batch, padding, channels), np.float32)).cast(x.dtype)], 1) if padding else x
    start = kernel - 1 - padding
    return causal_conv1d(padded, weight)[:, start:start + rows]
