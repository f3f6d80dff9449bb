"""``vkformers.Tensor``: a lazy, differentiable n-d array on a Vulkan device.

Operations build a graph (see lazy.py) and run when data is needed. Views
(reshape, transpose, permute, slices, expand) cost no copy. Broadcasting follows
numpy. ``backward()`` builds the gradient graph; it runs with whatever is
realized next, so a whole training step becomes one recorded submission.
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from vkformers.engine import function as fn
from vkformers.engine.lazy import (LazyBuffer, backward_deferred, building_graph, persistent_buffer, persistent_zeros,
                                   realize)
from vkformers.engine.ops import elementwise as E
from vkformers.engine.ops import reduce as R
from vkformers.engine.ops.matmul import matmul as batched_matmul
from vkformers.engine.ops.movement import Expand, Permute, Reshape, getitem
from vkformers.engine.ops.trig import acos as composed_acos
from vkformers.engine.row_blocks import RowBlocks, row_spans, split_rows
from vkformers.errors import ArgumentError
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import Device, get_device

no_grad = fn.no_grad
UNSET = object()  # an argument not given (None is a value: "all axes")


class Tensor:
    # _grad_if: None, or a float32 [1] device value: the gradient counts as present only where it is nonzero
    # (see GradientUse); decided on the host when .grad is next read
    __slots__ = ("lazy", "requires_grad", "_grad", "_grad_if", "_ctx", "_index", "__weakref__")
    __array_priority__ = 1000  # numpy scalars defer to Tensor's operators

    def __init__(self, data, dtype=None, requires_grad: bool = False, device: Device | None = None):
        device = device or get_device()
        if isinstance(data, Tensor):
            data = data.numpy()
        array = np.asarray(data)
        target = dt.as_dtype(dtype) if dtype is not None else _default_dtype(array)
        self.lazy = LazyBuffer(array.shape, target, device, host=_to_host(array, target))
        self.lazy.base.refs += 1
        self.requires_grad, self._grad, self._grad_if, self._ctx, self._index = requires_grad, None, None, None, 0

    @classmethod
    def _from_lazy(cls, lazy: LazyBuffer, requires_grad=False, ctx=None, index=0) -> "Tensor":
        t = cls.__new__(cls)
        t.lazy, t.requires_grad, t._grad, t._grad_if, t._ctx, t._index = lazy, requires_grad, None, None, ctx, index
        lazy.base.refs += 1  # the storage is what a later realization must keep
        return t

    def __del__(self):
        try:
            self.lazy.base.refs -= 1
        except AttributeError:
            pass

    # -- basic properties

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lazy.shape

    @property
    def dtype(self) -> dt.DType:
        return self.lazy.dtype

    @property
    def device(self) -> Device:
        return self.lazy.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"tensor({self.numpy()!r}, dtype={self.dtype.name}{grad})"

    # -- data

    def realize(self, wait: bool = True) -> "Tensor":
        """Compute the value on the device now (see lazy.realize: ``wait=False`` returns once it is submitted)."""
        realize([self.lazy], wait=wait)
        return self

    def numpy(self) -> np.ndarray:
        """The values as a numpy array (float16 for float16; bfloat16 is widened to float32)."""
        self.realize()
        base, v = self.lazy.base, self.lazy.view
        if v.numel == 0:
            return np.zeros(v.shape, np.float32 if self.dtype is dt.bfloat16 else self.dtype.host)
        if base.host is not None:
            flat = base.host.reshape(-1)[v.offset:]
        else:  # only the span the view covers travels (the last token's logits, not all of them)
            flat = base.buffer.read(v.offset, v.span)
        out = np.lib.stride_tricks.as_strided(flat, shape=v.shape,
                                              strides=tuple(s * flat.itemsize for s in v.strides)).copy()
        return dt.from_bfloat16(out) if self.dtype is dt.bfloat16 else out

    def peek(self) -> np.ndarray | None:
        """The values when the host holds them (an input not yet uploaded), without running anything; else None."""
        base, v = self.lazy.base, self.lazy.view
        if base.host is None or base.node is not None:
            return None
        flat = base.host.reshape(-1)[v.offset:]
        return np.lib.stride_tricks.as_strided(flat, shape=v.shape,
                                               strides=tuple(s * flat.itemsize for s in v.strides))

    def item(self):
        if self.numel() != 1:
            raise ValueError(f"item() needs a tensor of one element, this one has shape {self.shape}")
        return self.numpy().reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def detach(self) -> "Tensor":
        return Tensor._from_lazy(self.lazy)

    def assign(self, value: "Tensor") -> "Tensor":
        """Overwrite this tensor's device storage with ``value`` (in place, e.g. an optimizer update)."""
        if value.shape != self.shape:
            raise ValueError(f"assign: shape {value.shape} does not match {self.shape}")
        self._set_lazy(E.assign(self.lazy, value.cast(self.dtype).lazy))
        return self

    def _set_lazy(self, lazy: LazyBuffer) -> None:
        self.lazy.base.refs -= 1
        self.lazy = lazy
        lazy.base.refs += 1

    # -- autograd

    @property
    def grad(self) -> "Tensor | None":
        """The accumulated gradient, or None where no backward reached this tensor (or reached it only through
        a part of the graph that did not run: see GradientUse)."""
        if self._grad_if is not None:
            resolve_gradient_presence()
        return self._grad

    @grad.setter
    def grad(self, value: "Tensor | None") -> None:
        self._grad, self._grad_if = value, None
        _undecided.pop(id(self), None)

    def backward(self, gradient: "Tensor | None" = None) -> None:
        """Accumulate d(self)/d(leaf) into ``leaf.grad`` for every leaf that requires grad, and compute those
        gradients (with the pending forward, one submission) before returning, as PyTorch does. Inside
        ``lazy.deferred_backward()`` or a capture they stay lazy, to be realized with the step that uses them."""
        with building_graph():
            leaves = self._backward(gradient)
        if leaves and not backward_deferred():  # self too: a loop reads its loss next
            realize([self.lazy, *(leaf._grad.lazy for leaf in leaves),
                     *(leaf._grad_if.lazy for leaf in leaves if leaf._grad_if is not None)])
            resolve_gradient_presence()

    def _backward(self, gradient: "Tensor | None") -> list[Tensor]:
        """Build the gradient graph; returns the leaves whose ``grad`` it set."""
        if not self.requires_grad:
            raise RuntimeError("backward(): this tensor does not require grad and has no grad graph")
        if gradient is None:
            if self.numel() != 1:
                raise RuntimeError(f"backward() without a gradient needs a one-element tensor, not {self.shape}")
            gradient = full(self.shape, 1.0, dtype=self.dtype, device=self.device)
        return backpropagate([(self, gradient)])

    # -- views
    # -- views

    def reshape(self, *shape) -> "Tensor":
        shape = _shape_arg(shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.numel() // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel():
            raise ValueError(f"cannot reshape {self.shape} ({self.numel()} elements) to {shape}")
        return Reshape.apply(self, shape=shape)

    view = reshape

    def permute(self, *order) -> "Tensor":
        order = tuple(d % self.ndim for d in _shape_arg(order))
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(f"permute: {order} is not a permutation of {self.ndim} dims")
        return Permute.apply(self, order=order)

    def transpose(self, dim0: int = -2, dim1: int = -1) -> "Tensor":
        order = list(range(self.ndim))
        order[dim0], order[dim1] = order[dim1], order[dim0]
        return self.permute(*order)

    @property
    def T(self) -> "Tensor":
        return self.permute(*reversed(range(self.ndim)))

    def expand(self, *shape) -> "Tensor":
        shape = _shape_arg(shape)
        shape = tuple(o if s == -1 else s for s, o in zip(shape, (1,) * (len(shape) - self.ndim) + self.shape))
        if shape == self.shape:
            return self
        return Expand.apply(self, shape=shape)

    def __getitem__(self, index) -> "Tensor":
        return getitem(self, index)

    def contiguous(self) -> "Tensor":
        if self.lazy.view.is_contiguous:
            return self
        return E.Contiguous.apply(self)

    def unsqueeze(self, dim: int) -> "Tensor":
        dim = dim % (self.ndim + 1)
        return self.reshape(self.shape[:dim] + (1,) + self.shape[dim:])

    def squeeze(self, dim: int | None = None) -> "Tensor":
        if dim is None:
            return self.reshape(tuple(s for s in self.shape if s != 1))
        dim = dim % self.ndim
        return self.reshape(self.shape[:dim] + self.shape[dim + 1:]) if self.shape[dim] == 1 else self

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> "Tensor":
        start, end = start_dim % self.ndim, end_dim % self.ndim
        return self.reshape(self.shape[:start] + (-1,) + self.shape[end + 1:])

    # -- dtype

    def cast(self, dtype) -> "Tensor":
        dtype = dt.as_dtype(dtype)
        if dtype is self.dtype:
            return self
        return E.Cast.apply(self, dtype=dtype)

    to = cast

    def float(self) -> "Tensor":
        return self.cast(dt.float32)

    def half(self) -> "Tensor":
        return self.cast(dt.float16)

    def bfloat16(self) -> "Tensor":
        return self.cast(dt.bfloat16)

    # -- operators and math (engine/ops/*)

    def __add__(self, other): return E.binary(self, other, "add")
    def __radd__(self, other): return E.binary(self, other, "add")
    def __sub__(self, other): return E.binary(self, other, "sub")
    def __rsub__(self, other): return E.binary(_as_tensor(other, self), self, "sub")
    def __mul__(self, other): return E.binary(self, other, "mul")
    def __rmul__(self, other): return E.binary(self, other, "mul")
    def __truediv__(self, other): return E.binary(self, other, "div")
    def __rtruediv__(self, other): return E.binary(_as_tensor(other, self), self, "div")
    def __pow__(self, other): return E.binary(self, other, "pow")
    def __rpow__(self, other): return E.binary(_as_tensor(other, self), self, "pow")
    def __neg__(self): return E.unary(self, "neg")
    def __matmul__(self, other): return batched_matmul(self, other)
    def __rmatmul__(self, other): return batched_matmul(other, self)
    def __lt__(self, other): return E.compare(self, other, "lt")
    def __le__(self, other): return E.compare(self, other, "le")
    def __gt__(self, other): return E.compare(self, other, "gt")
    def __ge__(self, other): return E.compare(self, other, "ge")
    def __eq__(self, other): return E.compare(self, other, "eq")  # elementwise, as in torch
    def __ne__(self, other): return E.compare(self, other, "ne")
    __hash__ = object.__hash__  # == is elementwise; hash by identity

    def eq(self, other): return E.compare(self, other, "eq")
    def ne(self, other): return E.compare(self, other, "ne")
    def pow(self, other): return E.binary(self, other, "pow")
    def maximum(self, other): return E.binary(self, other, "maximum")
    def minimum(self, other): return E.binary(self, other, "minimum")
    def clamp(self, min=-3.0e38, max=3.0e38): return E.unary(self, "clamp", min, max)
    def matmul(self, other): return batched_matmul(self, other)

    def exp(self): return E.unary(self, "exp")
    def log(self): return E.unary(self, "log")
    def sqrt(self): return E.unary(self, "sqrt")
    def acos(self): return composed_acos(self)
    def rsqrt(self): return E.unary(self, "rsqrt")
    def abs(self): return E.unary(self, "abs")
    def tanh(self): return E.unary(self, "tanh")
    def sigmoid(self): return E.unary(self, "sigmoid")
    def relu(self): return E.unary(self, "relu")
    def gelu(self): return E.unary(self, "gelu")
    def silu(self): return E.unary(self, "silu")
    def sin(self): return E.unary(self, "sin")
    def cos(self): return E.unary(self, "cos")
    def reciprocal(self): return E.unary(self, "reciprocal")
    def square(self): return E.unary(self, "square")

    def sum(self, axis=UNSET, keepdim=UNSET, *, dim=UNSET, keepdims=UNSET):
        axis, keep = reduction_args("sum", axis, dim, keepdim, keepdims, None)
        return R.SumFn.apply(self, axes=R.normalize_axes(axis, self.ndim), keepdim=keep)

    def mean(self, axis=UNSET, keepdim=UNSET, *, dim=UNSET, keepdims=UNSET):
        axis, keep = reduction_args("mean", axis, dim, keepdim, keepdims, None)
        return self.sum(axis, keep) * (1.0 / math.prod(self.shape[a] for a in R.normalize_axes(axis, self.ndim)))

    def max(self, axis=UNSET, keepdim=UNSET, *, dim=UNSET, keepdims=UNSET):
        axis, keep = reduction_args("max", axis, dim, keepdim, keepdims, -1)
        return R.MaxFn.apply(self, axis=axis % self.ndim, keepdim=keep)

    def argmax(self, axis=UNSET, keepdim=UNSET, *, dim=UNSET, keepdims=UNSET):
        axis, keep = reduction_args("argmax", axis, dim, keepdim, keepdims, -1)
        return R.argmax(self, axis, keep)

    def softmax(self, axis=UNSET, *, dim=UNSET):
        axis, _ = reduction_args("softmax", axis, dim, UNSET, UNSET, -1)
        return _last_axis(self, axis, lambda t: R.SoftmaxFn.apply(t, log=False))

    def log_softmax(self, axis=UNSET, *, dim=UNSET):
        axis, _ = reduction_args("log_softmax", axis, dim, UNSET, UNSET, -1)
        return _last_axis(self, axis, lambda t: R.SoftmaxFn.apply(t, log=True))


fn.register_tensor_type(Tensor)  # ops and Functions build tensors through it (engine/function.py)


def backpropagate(roots, sink: dict | None = None, boundary=(), conditions: dict | None = None) -> list[Tensor]:
    """Reverse mode from ``roots``, (tensor, its gradient) pairs; returns the leaves reached.

    Without ``sink`` each leaf's gradient is accumulated into ``leaf.grad``; with it, into ``sink[id(leaf)]``
    (``.grad`` untouched: a recomputed layer's backward hands its gradients to the graph around it).
    ``boundary``: tensors treated as leaves though computed (a recomputed layer's reads of results from
    outside it; the graph beyond them is the outer backward's). ``conditions`` (a dict, filled): id(leaf) ->
    (leaf, condition) for the leaves whose gradients of this pass count only under a condition (GradientUse)."""
    stop = {id(t) for t in boundary}
    functions, seen = [], set()

    def visit(f):  # depth-first post-order over Functions, iteratively (deep graphs)
        stack = [(f, False)]
        while stack:
            g, done = stack.pop()
            if done:
                functions.append(g)
                continue
            if id(g) in seen:
                continue
            seen.add(id(g))
            stack.append((g, True))
            for p in g.parents:
                if p is not None and p._ctx is not None and id(p._ctx) not in seen and id(p) not in stop:
                    stack.append((p._ctx, False))

    leaves: dict[int, Tensor] = {}
    conditions = {} if conditions is None else conditions

    def to_leaf(leaf: Tensor, g: Tensor) -> None:
        if sink is None:
            _accumulate(leaf, g, conditions.get(id(leaf), (None, None))[1])
        else:
            sink[id(leaf)] = g if id(leaf) not in sink else sink[id(leaf)] + g
        leaves[id(leaf)] = leaf

    grads: dict[tuple, Tensor] = {}
    for root, gradient in roots:
        if root._ctx is None or id(root) in stop:
            to_leaf(root, gradient)
            continue
        visit(root._ctx)
        key = (id(root._ctx), root._index)
        grads[key] = gradient if key not in grads else grads[key] + gradient
    with no_grad():
        for f in reversed(functions):
            outs = [grads.pop((id(f), i), None) for i in range(getattr(f, "outputs_count", 1))]
            if all(g is None for g in outs):
                continue
            in_grads = f.backward(*outs)
            in_grads = in_grads if isinstance(in_grads, tuple) else (in_grads,)
            for leaf, condition in getattr(f, "gradient_conditions", ()):  # set by the backward just run
                known = conditions.get(id(leaf))
                conditions[id(leaf)] = (leaf, condition if known is None else known[1] + condition)
            for parent, needs, g in zip(f.parents, f.needs_grad, in_grads):
                if not needs or g is None:
                    continue
                if g.shape != parent.shape:
                    raise RuntimeError(f"{type(f).__name__}.backward gave shape {g.shape} for {parent.shape}")
                if parent._ctx is None or id(parent) in stop:
                    to_leaf(parent, g)
                else:
                    key = (id(parent._ctx), parent._index)
                    grads[key] = g if key not in grads else grads[key] + g
            f.release()  # free the graph, as torch does without retain_graph
    return list(leaves.values())


def _accumulate(leaf: Tensor, g: Tensor, condition: Tensor | None = None) -> None:
    """leaf.grad += g; with ``condition``, this contribution counts as a gradient only where it is nonzero
    (a gradient already present stays present; two conditional ones are present where either is)."""
    g = g.cast(leaf.dtype)
    undecided, present = leaf._grad_if, leaf._grad is not None and leaf._grad_if is None
    leaf._grad = g.detach() if leaf._grad is None else (leaf._grad + g).detach()
    if condition is None or present:
        leaf._grad_if = None
        _undecided.pop(id(leaf), None)
        return
    leaf._grad_if = (condition if undecided is None else undecided + condition).detach()
    _undecided[id(leaf)] = weakref.ref(leaf)


_undecided: dict[int, weakref.ref] = {}  # leaves whose gradient's presence waits on a device value


def resolve_gradient_presence() -> None:
    """Decide every pending conditional gradient (see GradientUse): realize the conditions (one submission, and
    only the graph they need) and drop the gradients whose condition is zero, as torch leaves ``.grad`` None
    for a parameter whose module did not run."""
    leaves = [t for t in (ref() for ref in _undecided.values()) if t is not None and t._grad_if is not None]
    _undecided.clear()
    if not leaves:
        return
    with no_grad():
        flags = E.cat([t._grad_if.float().reshape(1) for t in leaves], 0) if len(leaves) > 1 else \
            leaves[0]._grad_if.float().reshape(1)
    values = flags.numpy()
    for t, value in zip(leaves, values):
        t._grad_if = None
        if value == 0.0:
            t._grad = None


class GradientUse(fn.Function):
    """x unchanged (a view); its backward passes x's gradient through and counts gradients as torch would:

    - ``used``: tensors requiring grad that x's graph does not read (weights a checkpoint stores beside the ones
      that run, which torch keeps in one parameter with them) get a zero gradient;
    - ``present_if``: (condition, tensors) pairs, condition a float32 device value of one element: the gradients
      this backward pass gives those tensors count as present only where it is nonzero, decided on the host
      when ``.grad`` is next read. torch runs a module only when a data-dependent test on the host says so
      (an expert no token chose), and a module that did not run leaves its parameters' ``.grad`` None, which
      AdamW then skips; here the module runs on no rows and the gradient it gives is zero."""

    def forward(self, x, *used, present_if=()):
        self.used_shapes = [u.shape for u in used]
        self.gradient_conditions = [(t, condition) for condition, tensors in present_if
                                    for t in tensors if t.requires_grad]
        return fn.view(x, x.view)

    def backward(self, g):
        zeros = []
        for shape, needs in zip(self.used_shapes, self.needs_grad[1:]):
            zero = full((1,) * len(shape), 0.0, dtype=g.dtype, device=g.device) if needs else None
            zeros.append(zero.expand(*shape) if zero is not None and shape else zero)
        return (g, *zeros)


def gradient_use(x: Tensor, used=(), present_if=()) -> Tensor:
    """x, with gradients counted as :class:`GradientUse` says; x itself where no gradient is recorded."""
    if not fn.grad_enabled():
        return x
    present_if = tuple((condition.detach().float().reshape(1), tuple(tensors)) for condition, tensors in present_if)
    return GradientUse.apply(x, *used, present_if=present_if)


def _shape_arg(shape) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    return tuple(int(s) for s in shape)


def _default_dtype(array: np.ndarray) -> dt.DType:
    if array.dtype == np.bool_:
        return dt.bool_
    if np.issubdtype(array.dtype, np.integer):
        return dt.int32
    if array.dtype == np.float16:
        return dt.float16
    return dt.float32


def _to_host(array: np.ndarray, dtype: dt.DType) -> np.ndarray:
    if dtype is dt.bfloat16:
        return dt.to_bfloat16(np.asarray(array, dtype=np.float32)) if array.dtype != np.uint16 else array.copy()
    return np.ascontiguousarray(array, dtype=dtype.host)


# ---------------------------------------------------------------- creation

def tensor(data, dtype=None, requires_grad: bool = False, device: Device | None = None) -> Tensor:
    """A tensor from numpy data (uploaded when first used)."""
    return Tensor(data, dtype=dtype, requires_grad=requires_grad, device=device)


def parameter(data, dtype=None, requires_grad: bool = True, device: Device | None = None, name="parameter") -> Tensor:
    """A tensor that lives on the device for good (weights, optimizer state), updated with ``assign``."""
    device = device or get_device()
    array = np.asarray(data)
    dtype = dt.as_dtype(dtype) if dtype is not None else _default_dtype(array)
    return Tensor._from_lazy(persistent_buffer(_to_host(array, dtype), dtype, device, name),
                             requires_grad=requires_grad)


def weight_parameter(data, dtype=None, requires_grad: bool = True, device: Device | None = None,
                     name="parameter") -> "Tensor | RowBlocks":
    """A model's weight: :func:`parameter`, or a RowBlocks of parameters where a float32 copy of a matrix (its
    gradient, optimizer state) would pass one device buffer (engine/row_blocks.py)."""
    device = device or get_device()
    array = np.asarray(data)
    if array.ndim == 2:
        spans = row_spans(array.shape[0], array.shape[1] * 4, device)
        if len(spans) > 1:
            return RowBlocks([parameter(part, dtype, requires_grad, device, f"{name}[{a}:{b}]")
                              for part, (a, b) in zip(split_rows(array, spans), spans)])
    return parameter(array, dtype, requires_grad, device, name)


def zero_parameter(shape, dtype="float32", device: Device | None = None, name="parameter") -> Tensor:
    """A parameter of zeros (no gradient), zeroed on the device: no host array of its size."""
    return Tensor._from_lazy(persistent_zeros(tuple(int(n) for n in shape), dt.as_dtype(dtype), device or get_device(),
                                              name), requires_grad=False)


def full(shape, value, dtype="float32", device: Device | None = None) -> Tensor:
    dtype = dt.as_dtype(dtype)
    return Tensor(np.full(_shape_arg((shape,)) if not isinstance(shape, int) else (shape,), value,
                          dtype=np.float32 if dtype in (dt.bfloat16,) else dtype.host), dtype=dtype, device=device)


def zeros(shape, dtype="float32", device: Device | None = None) -> Tensor:
    return full(shape, 0, dtype, device)


def ones(shape, dtype="float32", device: Device | None = None) -> Tensor:
    return full(shape, 1, dtype, device)


def reduction_args(op: str, axis, dim, keepdim, keepdims, default_axis):
    """(axis, keepdim) of a reduction called with PyTorch's ``dim``/``keepdim`` or numpy's ``axis``/``keepdims``
    (either spelling, not both)."""
    if axis is not UNSET and dim is not UNSET:
        raise ArgumentError(f"{op}: the axis was given twice (axis={axis!r}, dim={dim!r}); pass one of them")
    if keepdim is not UNSET and keepdims is not UNSET:
        raise ArgumentError(f"{op}: keepdim={keepdim!r} and keepdims={keepdims!r} both given; pass one of them")
    axis = dim if dim is not UNSET else axis if axis is not UNSET else default_axis
    keep = keepdims if keepdims is not UNSET else keepdim if keepdim is not UNSET else False
    return axis, bool(keep)


def _as_tensor(value, like: Tensor) -> Tensor:
    return value if isinstance(value, Tensor) else Tensor(np.asarray(value, dtype=np.float32), dtype=like.dtype,
                                                         device=like.device)


def _last_axis(t: Tensor, axis: int, fn_):
    axis %= t.ndim
    if axis == t.ndim - 1:
        return fn_(t)
    return fn_(t.transpose(axis, -1)).transpose(axis, -1)

