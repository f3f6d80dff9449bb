"""Ops as the engine sees them: a kernel op (emits dispatches) and a differentiable Function.

- :class:`KernelOp` records one node's dispatches through a launcher
  (``engine/kernels``). It knows buffers and shapes, not autograd.
- :class:`Function` is what tensors call: ``forward`` builds kernel nodes on lazy
  buffers, ``backward`` builds the gradient from other tensor operations.

Each op family (engine/ops/*.py) defines both, side by side: forward, backward
and kernel in one place.
"""
from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from vkformers.engine.kernels import elementwise as K
from vkformers.engine.lazy import Arg, LazyBuffer, View, create_node
from vkformers.runtime import dtypes as dt

if TYPE_CHECKING:  # annotations only: engine/tensor.py sits above this module
    from vkformers.engine.tensor import Tensor


class KernelOp:
    """A node's work. Subclasses set ``name`` and implement ``emit``; attributes are keyword arguments."""

    name = "op"
    contiguous_inputs = True  # False: emit() honours arbitrary input strides
    # (output, input) index pairs: the memory planner may give that output the input's storage when nothing reads
    # the input after this node; emit() must then read every element before writing it over
    inplace: tuple[tuple[int, int], ...] = ()

    def __init__(self, **attrs):
        self.attrs = attrs

    def key(self) -> tuple:
        # in the order the attributes were given: one call site gives them in one order, and a key that differs
        # by order alone only misses a cached plan
        return (type(self).__name__, tuple([(k, _hashable(v)) for k, v in self.attrs.items()]))

    def emit(self, seq, outs: list[Arg], ins: list[Arg]) -> None:
        raise NotImplementedError

    def __getattr__(self, item):
        try:
            return self.__dict__["attrs"][item]
        except KeyError:
            raise AttributeError(item) from None


_PLAIN_TYPES = frozenset((int, float, bool, str, type(None)))


def _hashable(value):
    if type(value) in _PLAIN_TYPES:  # most attributes: signatures ask for thousands a realization
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dt.DType):
        return value.name
    return value


class CopyStrided(KernelOp):
    """out (contiguous, any dtype) = x (any strides and dtype): layout changes and casts. Defined here, beside
    :func:`node`, because every op whose kernel needs contiguous inputs copies strided ones with it."""

    name = "copy"
    contiguous_inputs = False

    def emit(self, seq, outs, ins):
        (y,), (x,) = outs, ins
        K.copy_strided(seq, x.operand, x.strides, y.operand, y.shape)


def node(op: KernelOp, inputs, out_specs, *, into=None) -> list[LazyBuffer]:
    """Add ``op`` to the graph; inputs that are not contiguous are copied first when the op needs it.

    ``into``: persistent storage the outputs overwrite in place (see lazy.create_node).
    """
    inputs = [x if not op.contiguous_inputs else contiguous(x) for x in inputs]
    device = inputs[0].device
    return create_node(op, inputs, out_specs, device, into=into)


def contiguous(x: LazyBuffer) -> LazyBuffer:
    if x.view.is_contiguous:
        return x
    return node(CopyStrided(), [x], [(x.shape, x.dtype)])[0]


def view(x: LazyBuffer, new_view: View) -> LazyBuffer:
    return x.make_view(new_view)


def reshape_lazy(x: LazyBuffer, shape) -> LazyBuffer:
    """The lazy buffer ``x`` under a new shape: a view, or a view of a contiguous copy when x is strided."""
    new_view = x.view.reshape(shape)
    if new_view is None:
        x = contiguous(x)
        new_view = x.view.reshape(shape)
    return x.make_view(new_view)


# ---------------------------------------------------------------- tensors, built from below

# Tensor (engine/tensor.py) sits above Function and the ops, and registers itself here when it loads; ops and
# Functions make tensors only through these factories, so no module below tensor.py imports it.
_tensor_type = None


def register_tensor_type(cls) -> None:
    global _tensor_type
    _tensor_type = cls


def wrap(lazy: LazyBuffer, requires_grad: bool = False, ctx=None, index: int = 0) -> "Tensor":
    """A tensor over the lazy buffer ``lazy`` (a Function's output, or a buffer a backward reads)."""
    return _tensor_type._from_lazy(lazy, requires_grad, ctx, index)


def constant(data, dtype=None, device=None) -> "Tensor":
    """A tensor from numpy data or a Python number (uploaded when first used), as ``vkformers.tensor``."""
    return _tensor_type(data, dtype=dtype, device=device)


def is_tensor(value) -> bool:
    return isinstance(value, _tensor_type)


# ---------------------------------------------------------------- autograd

_grad_state = threading.local()
_serials = itertools.count()


def function_serial() -> int:
    """A number above the serial of every Function created so far (each gets the next one)."""
    return next(_serials)


def grad_enabled() -> bool:
    return getattr(_grad_state, "enabled", True)


class no_grad:
    """Context manager (and decorator) under which operations record no gradient graph."""

    def __enter__(self):
        self.previous = grad_enabled()
        _grad_state.enabled = False

    def __exit__(self, *exc):
        _grad_state.enabled = self.previous

    def __call__(self, fn):
        def wrapper(*args, **kwargs):
            with no_grad():
                return fn(*args, **kwargs)
        return wrapper


class enable_grad(no_grad):
    """Context manager under which operations record a gradient graph again (inside a backward pass, which runs
    under no_grad: a checkpointed layer's recomputation)."""

    def __enter__(self):
        self.previous = grad_enabled()
        _grad_state.enabled = True


class Function:
    """A differentiable operation: ``forward`` on lazy buffers, ``backward`` on tensors."""

    def __init__(self, *parents: "Tensor"):
        self.serial = next(_serials)  # creation order (engine/checkpoint.py tells a block's own functions by it)
        self.parents = parents
        self.needs_grad = tuple(p is not None and p.requires_grad for p in parents)
        self.saved: tuple = ()

    def forward(self, *inputs: LazyBuffer, **kwargs):
        raise NotImplementedError

    def backward(self, *grad_outputs: "Tensor"):
        raise NotImplementedError(f"{type(self).__name__} has no backward")

    @classmethod
    def apply(cls, *tensors: "Tensor", **kwargs):
        fn = cls(*tensors)
        out = fn.forward(*[t.lazy if t is not None else None for t in tensors], **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        track = grad_enabled() and any(fn.needs_grad)
        from_lazy = _tensor_type._from_lazy
        results = tuple(from_lazy(o, track, fn if track else None, i) for i, o in enumerate(outs))
        if track:
            fn.outputs_count = len(results)
            fn.hold(True)
        else:
            fn.saved = ()
        return results if isinstance(out, (tuple, list)) else results[0]

    def hold(self, on: bool) -> None:
        """Count the lazy buffers saved for backward as live, so realization keeps their data."""
        for lb in _lazy_buffers(self.saved):
            lb.base.refs += 1 if on else -1
        self._holding = on

    def release(self) -> None:
        if getattr(self, "_holding", False):
            self.hold(False)
        self.saved, self.parents = (), ()

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass


def _lazy_buffers(saved):
    for item in saved:
        if isinstance(item, LazyBuffer):
            yield item
        elif isinstance(item, (list, tuple)):
            yield from _lazy_buffers(item)
