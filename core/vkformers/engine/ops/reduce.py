"""Reductions over axes (sum, mean, max, argmax) and softmax / log-softmax over the last axis."""
from __future__ import annotations

import math

from vkformers.engine.function import Function, KernelOp, node, wrap
from vkformers.engine.ops.elementwise import where
from vkformers.engine.kernels import reduce as KR
from vkformers.engine.kernels import softmax as KS
from vkformers.runtime import dtypes as dt


class Reduce(KernelOp):
    """out[outer, inner] = op over axis of x viewed as [outer, axis_len, inner]."""

    name = "reduce"

    def emit(self, seq, outs, ins):
        (y,), (x,) = outs, ins
        KR.reduce(seq, self.op, x.operand, y.operand, outer=self.outer, axis_len=self.axis_len, inner=self.inner)


def _reduce_one(x, op, axis, out_dtype=None):
    """Reduce lazy ``x`` over one axis (dropping it)."""
    shape = x.shape
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    out_shape = shape[:axis] + shape[axis + 1:]
    return node(Reduce(op=op, outer=outer, axis_len=shape[axis], inner=inner), [x],
                [(out_shape, out_dtype or x.dtype)])[0]


def normalize_axes(axis, ndim) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted({a % ndim for a in axes}))


def _kept_shape(shape, axes):
    return tuple(1 if i in axes else s for i, s in enumerate(shape))


class SumFn(Function):
    def forward(self, x, axes, keepdim, op="sum"):
        self.in_shape, self.axes, self.keepdim = x.shape, axes, keepdim
        y = x
        for a in reversed(axes):  # highest axis first keeps the lower axis numbers valid
            y = _reduce_one(y, op, a)
        if keepdim:
            y = y.make_view(y.view.reshape(_kept_shape(self.in_shape, axes)))
        return y

    def backward(self, g):
        return g.reshape(_kept_shape(self.in_shape, self.axes)).expand(self.in_shape)


class MaxFn(Function):
    def forward(self, x, axis, keepdim):
        self.axis, self.keepdim = axis, keepdim
        y = _reduce_one(x, "max", axis)
        self.saved = (x, y)
        return y if not keepdim else y.make_view(y.view.reshape(_kept_shape(x.shape, (axis,))))

    def backward(self, g):
        x, y = (wrap(v) for v in self.saved)
        kept = _kept_shape(x.shape, (self.axis,))
        # Ties share the gradient of one maximum each (like torch.amax's backward splits it).
        hit = where(x == y.reshape(kept), 1.0, 0.0)
        share = hit / hit.sum(axis=self.axis, keepdim=True)
        return share * g.reshape(kept)


def argmax(x, axis: int = -1, keepdim: bool = False):
    axis %= x.ndim
    y = _reduce_one(x.lazy, "argmax", axis, dt.int32)
    out = wrap(y)
    return out.reshape(_kept_shape(x.shape, (axis,))) if keepdim else out


class Softmax(KernelOp):
    name = "softmax"

    def emit(self, seq, outs, ins):
        (y,), (x,) = outs, ins
        KS.softmax(seq, x.operand, y.operand, rows=x.numel // x.shape[-1], cols=x.shape[-1], log=self.log)


class SoftmaxBackward(KernelOp):
    name = "softmax_backward"

    def emit(self, seq, outs, ins):
        (dx,), (y, dy) = outs, ins
        KS.softmax_backward(seq, y.operand, dy.operand, dx.operand, rows=y.numel // y.shape[-1], cols=y.shape[-1],
                            log=self.log)


class SoftmaxFn(Function):
    def forward(self, x, log):
        self.log = log
        y = node(Softmax(log=log), [x], [(x.shape, x.dtype)])[0]
        self.saved = (y,)
        return y

    def backward(self, g):
        (y,) = self.saved
        dx = node(SoftmaxBackward(log=self.log), [y, g.lazy], [(y.shape, y.dtype)])[0]
        return wrap(dx)
