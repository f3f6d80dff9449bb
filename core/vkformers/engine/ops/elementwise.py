"""Elementwise ops with numpy broadcasting: unary, scalar, binary, compare, where, casts, copies and concatenation.

One kernel (shaders/common/elementwise.comp) runs them all; the op is a
specialization constant. Inputs are read through their strides, so broadcast and
transposed operands cost no copy.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine.function import CopyStrided, Function, KernelOp, constant, is_tensor, node, wrap
from vkformers.engine.kernels import elementwise as K
from vkformers.engine.lazy import LazyBuffer, View
from vkformers.runtime import dtypes as dt


# ---------------------------------------------------------------- kernel ops

class Unary(KernelOp):
    name = "unary"
    contiguous_inputs = False
    inplace = ((0, 0),)

    def emit(self, seq, outs, ins):
        (y,), (x,) = outs, ins
        K.unary(seq, self.op, x.operand, x.strides, y.operand, y.shape, scalars=self.scalars)


class Binary(KernelOp):
    name = "binary"
    contiguous_inputs = False
    inplace = ((0, 0),)

    def emit(self, seq, outs, ins):
        (y,), (a, b) = outs, ins
        K.binary(seq, self.op, a.operand, a.strides, b.operand, b.strides, y.operand, y.shape)


class Where(KernelOp):
    name = "where"
    contiguous_inputs = False

    def emit(self, seq, outs, ins):
        (y,), (m, a, b) = outs, ins
        K.where(seq, m.operand, m.strides, a.operand, a.strides, b.operand, b.strides, y.operand, y.shape)


class Concat(KernelOp):
    """out = the inputs laid end to end along ``dim``: one strided copy per input into its slice of out."""

    name = "concat"
    contiguous_inputs = False

    def emit(self, seq, outs, ins):
        (y,), dim = outs, self.dim
        start, together = 0, object()
        for x in ins:
            if x.numel:
                into = K.Operand(y.operand.buffer, y.operand.offset + start * y.strides[dim])
                K.copy_strided(seq, x.operand, x.strides, into, x.shape, out_strides=y.strides,
                               write_group=together)
            start += x.shape[dim]


def broadcast_shape(*shapes) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"shapes {' and '.join(map(str, shapes))} do not broadcast") from None


def sum_to_shape(g, shape):
    """Sum ``g`` over the dimensions that broadcasting added or stretched, giving ``shape``."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
    return g.sum(axis=axes, keepdim=True).reshape(shape)


def _expand(x: LazyBuffer, shape) -> LazyBuffer:
    return x if x.shape == tuple(shape) else x.make_view(x.view.expand(shape))


def assign(target: LazyBuffer, value: LazyBuffer) -> LazyBuffer:
    """A node writing ``value`` into ``target``'s persistent storage; returns the new version of target."""
    if not target.base.persistent or target.view != View.dense(target.shape):
        raise ValueError("assign() writes whole device tensors created with vkformers.parameter()")
    return node(CopyStrided(), [value], [(target.shape, target.dtype)], into=target)[0]


# ---------------------------------------------------------------- differentiable functions

def _float_result(*dtypes) -> dt.DType:
    """Result dtype of mixing: float32 wins over 16-bit floats, which win over ints (as torch promotes)."""
    for candidate in (dt.float32, dt.bfloat16, dt.float16, dt.int32):
        if candidate in dtypes:
            return candidate
    return dtypes[0]


class UnaryFn(Function):
    def forward(self, x, op, scalars=()):
        self.op, self.scalars = op, scalars
        y = node(Unary(op=op, scalars=tuple(scalars)), [x], [(x.shape, x.dtype)])[0]
        self.saved = (x, y)
        return y

    def backward(self, g):
        x, y = (wrap(v) for v in self.saved)
        return UNARY_GRADIENTS[self.op](x, y, g, *self.scalars)


def _backward_kernel(op, first, g):
    """One of the kernel's fused activation gradients: op(first, dy)."""
    out = node(Binary(op=op), [first.lazy, g.lazy], [(g.shape, g.dtype)])[0]
    return wrap(out)


UNARY_GRADIENTS = {
    "neg": lambda x, y, g: -g,
    "exp": lambda x, y, g: g * y,
    "log": lambda x, y, g: g / x,
    "sqrt": lambda x, y, g: g * 0.5 / y,
    "rsqrt": lambda x, y, g: g * (y * y * y) * -0.5,
    "reciprocal": lambda x, y, g: -(g * y * y),
    "square": lambda x, y, g: g * x * 2.0,
    "abs": lambda x, y, g: where(x < 0.0, -g, g),
    "sin": lambda x, y, g: g * x.cos(),
    "cos": lambda x, y, g: -(g * x.sin()),
    "tanh": lambda x, y, g: _backward_kernel("tanh_backward", y, g),
    "sigmoid": lambda x, y, g: _backward_kernel("sigmoid_backward", y, g),
    "relu": lambda x, y, g: _backward_kernel("relu_backward", x, g),
    "relu2": lambda x, y, g: _backward_kernel("relu2_backward", x, g),
    "gelu": lambda x, y, g: _backward_kernel("gelu_backward", x, g),
    "gelu_tanh": lambda x, y, g: _backward_kernel("gelu_tanh_backward", x, g),
    "silu": lambda x, y, g: _backward_kernel("silu_backward", x, g),
    "softplus": lambda x, y, g: _backward_kernel("softplus_backward", x, g),
    "quick_gelu": lambda x, y, g: _backward_kernel("quick_gelu_backward", x, g),
    "add_scalar": lambda x, y, g, s: g,
    "mul_scalar": lambda x, y, g, s: g * s,
    "rsub_scalar": lambda x, y, g, s: -g,
    "pow_scalar": lambda x, y, g, s: g * x.pow(s - 1.0) * s,
    "clamp": lambda x, y, g, lo, hi: where(x >= lo, where(x <= hi, g, 0.0), 0.0),
}


class BinaryFn(Function):
    def forward(self, a, b, op):
        self.op = op
        shape = broadcast_shape(a.shape, b.shape)
        dtype = _float_result(a.dtype, b.dtype)
        if a.dtype is not dtype or b.dtype is not dtype:
            raise TypeError(f"{op}: operands are {a.dtype.name} and {b.dtype.name}; cast one first")
        y = node(Binary(op=op), [_expand(a, shape), _expand(b, shape)], [(shape, dtype)])[0]
        self.shapes = (a.shape, b.shape)
        # only what the wanted gradients read stays alive for the backward (a sum keeps nothing)
        reads = set().union(*(BINARY_READS[op][i] for i in (0, 1) if self.needs_grad[i]))
        self.saved = tuple(v if name in reads else None for v, name in ((a, "a"), (b, "b"), (y, "y")))
        return y

    def backward(self, g):
        a, b, y = (None if v is None else wrap(v) for v in self.saved)
        grads = []
        for i, (rule, shape) in enumerate(zip(BINARY_GRADIENTS[self.op], self.shapes)):
            grads.append(sum_to_shape(rule(a, b, y, g), shape) if self.needs_grad[i] else None)
        return tuple(grads)


# Per op: the gradient of a and of b from (a, b, y, g), and which of a, b, y each reads.
BINARY_GRADIENTS = {
    "add": (lambda a, b, y, g: g, lambda a, b, y, g: g),
    "sub": (lambda a, b, y, g: g, lambda a, b, y, g: -g),
    "mul": (lambda a, b, y, g: g * b, lambda a, b, y, g: g * a),
    "div": (lambda a, b, y, g: g / b, lambda a, b, y, g: -(g * y) / b),
    "pow": (lambda a, b, y, g: g * b * a.pow(b - 1.0), lambda a, b, y, g: g * y * a.log()),
    "maximum": (lambda a, b, y, g: where(a >= b, g, 0.0), lambda a, b, y, g: where(a >= b, 0.0, g)),
    "minimum": (lambda a, b, y, g: where(a <= b, g, 0.0), lambda a, b, y, g: where(a <= b, 0.0, g)),
}
BINARY_READS = {"add": ("", ""), "sub": ("", ""), "mul": ("b", "a"), "div": ("b", "by"), "pow": ("ab", "ay"),
                "maximum": ("ab", "ab"), "minimum": ("ab", "ab")}

COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")


def compare(a, b, op):
    """A boolean mask tensor (no gradient)."""
    a, b = _pair(a, b)
    shape = broadcast_shape(a.shape, b.shape)
    out = node(Binary(op=op), [_expand(a.lazy, shape), _expand(b.lazy, shape)], [(shape, dt.bool_)])[0]
    return wrap(out)


class WhereFn(Function):
    def forward(self, mask, a, b):
        shape = broadcast_shape(mask.shape, a.shape, b.shape)
        self.mask, self.shapes = mask, (a.shape, b.shape)
        return node(Where(), [_expand(mask, shape), _expand(a, shape), _expand(b, shape)],
                    [(shape, _float_result(a.dtype, b.dtype))])[0]

    def backward(self, g):
        mask = wrap(self.mask)
        return (None, sum_to_shape(where(mask, g, 0.0), self.shapes[0]),
                sum_to_shape(where(mask, 0.0, g), self.shapes[1]))


class Cast(Function):
    def forward(self, x, dtype):
        self.in_dtype = x.dtype
        return node(CopyStrided(), [x], [(x.shape, dtype)])[0]

    def backward(self, g):
        return g.cast(self.in_dtype)


class Contiguous(Function):
    def forward(self, x):
        return node(CopyStrided(), [x], [(x.shape, x.dtype)])[0]

    def backward(self, g):
        return g


class ConcatFn(Function):
    def forward(self, *parts, dim):
        self.dim, self.sizes = dim, [p.shape[dim] for p in parts]
        shape = list(parts[0].shape)
        shape[dim] = sum(self.sizes)
        return node(Concat(dim=dim), list(parts), [(tuple(shape), parts[0].dtype)])[0]

    def backward(self, g):
        grads, start = [], 0
        for size, needed in zip(self.sizes, self.needs_grad):
            index = (slice(None),) * self.dim + (slice(start, start + size),)
            grads.append(g[index] if needed else None)
            start += size
        return tuple(grads)


def cat(tensors, dim: int = 0):
    """torch.cat: the tensors joined along ``dim``; all other sizes and the dtype must agree."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("cat() needs at least one tensor")
    first = tensors[0]
    ndim = first.ndim
    if not -ndim <= dim < ndim:
        raise IndexError(f"cat(): dim {dim} is out of range for tensors of {ndim} dims")
    dim %= ndim
    for t in tensors[1:]:
        if t.ndim != ndim or any(a != b for d, (a, b) in enumerate(zip(t.shape, first.shape)) if d != dim):
            raise ValueError(f"cat(): shapes {first.shape} and {t.shape} differ outside dim {dim}")
        if t.dtype is not first.dtype:
            raise TypeError(f"cat(): dtypes {first.dtype.name} and {t.dtype.name} differ; cast one first")
    if len(tensors) == 1:
        return first
    return ConcatFn.apply(*tensors, dim=dim)


def stack(tensors, dim: int = 0):
    """torch.stack: the tensors (all of one shape) joined along a new dimension ``dim``."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack() needs at least one tensor")
    ndim = tensors[0].ndim + 1
    if not -ndim <= dim < ndim:
        raise IndexError(f"stack(): dim {dim} is out of range for a result of {ndim} dims")
    dim %= ndim
    shapes = {t.shape for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"stack(): every tensor must have one shape, got {sorted(shapes)}")
    return cat([t.unsqueeze(dim) for t in tensors], dim)


# ---------------------------------------------------------------- tensor-facing helpers

def _scalar_ok(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _pair(a, b):
    if not is_tensor(a):
        a = constant(np.asarray(a, dtype=np.float32 if b.dtype is not dt.int32 else np.int32), dtype=b.dtype,
                     device=b.device)
    if not is_tensor(b):
        b = constant(np.asarray(b, dtype=np.float32 if a.dtype is not dt.int32 else np.int32), dtype=a.dtype,
                     device=a.device)
    return a, b


def unary(x, op, *scalars):
    return UnaryFn.apply(x, op=op, scalars=tuple(float(s) for s in scalars))


def binary(a, b, op):
    if is_tensor(b) or not _scalar_ok(b) or a.dtype is dt.int32:
        a, b = _pair(a, b)
        if a.dtype is not b.dtype:
            target = _float_result(a.dtype, b.dtype)
            a, b = a.cast(target), b.cast(target)
        return BinaryFn.apply(a, b, op=op)
    if op in ("add", "sub", "mul", "pow"):
        name = {"add": "add_scalar", "sub": "add_scalar", "mul": "mul_scalar", "pow": "pow_scalar"}[op]
        return unary(a, name, -b if op == "sub" else b)
    if op == "div":  # x / 0 is inf or nan, as in numpy and torch
        with np.errstate(divide="ignore"):
            return unary(a, "mul_scalar", float(np.float64(1.0) / np.float64(b)))
    return binary(a, constant(np.float32(b), dtype=a.dtype, device=a.device), op)


def where(mask, a, b):
    """Elementwise ``a if mask else b``; a and b may be tensors or Python numbers."""
    ref = a if is_tensor(a) else b if is_tensor(b) else constant(np.float32(0), device=mask.device)
    a, b = _pair(a, ref)[0], _pair(b, ref)[0]
    if a.dtype is not b.dtype:
        target = _float_result(a.dtype, b.dtype)
        a, b = a.cast(target), b.cast(target)
    if not is_tensor(mask):
        mask = constant(np.asarray(mask, dtype=bool), device=a.device)
    return WhereFn.apply(mask, a, b)
