"""Views: reshape, permute, expand and slicing. They move no data; backward undoes the view."""
from __future__ import annotations

import numpy as np

from vkformers.engine.function import Function, constant, reshape_lazy
from vkformers.engine.ops.elementwise import cat, sum_to_shape


class Reshape(Function):
    def forward(self, x, shape):
        self.in_shape = x.shape
        return reshape_lazy(x, shape)

    def backward(self, g):
        return g.reshape(self.in_shape)


class Permute(Function):
    def forward(self, x, order):
        self.order = order
        return x.make_view(x.view.permute(order))

    def backward(self, g):
        inverse = [0] * len(self.order)
        for i, o in enumerate(self.order):
            inverse[o] = i
        return g.permute(*inverse)


class Expand(Function):
    def forward(self, x, shape):
        self.in_shape = x.shape
        return x.make_view(x.view.expand(shape))

    def backward(self, g):
        return sum_to_shape(g, self.in_shape)


class Slice(Function):
    """Basic indexing with slices (step > 0) and integers; the gradient lands in a zero tensor."""

    def forward(self, x, spec):
        self.in_shape, self.spec = x.shape, spec
        view = x.view
        for dim, (start, stop, step) in enumerate(spec):
            view = view.slice(dim, start, stop, step)
        return x.make_view(view)

    def backward(self, g):
        return scatter_into_zeros(g, self.in_shape, self.spec)


class Split(Function):
    """Consecutive pieces of ``dim`` as views; the gradient is the pieces' gradients joined (zeros where a piece
    got none), so no piece's gradient is padded to the whole input."""

    def forward(self, x, sizes, dim):
        self.in_shape, self.sizes, self.dim = x.shape, sizes, dim
        pieces, start = [], 0
        for size in sizes:
            pieces.append(x.make_view(x.view.slice(dim, start, start + size)))
            start += size
        return tuple(pieces)

    def backward(self, *grads):
        ref = next(g for g in grads if g is not None)
        return cat([g if g is not None else _zeros_like(ref, self.dim, size) for g, size in zip(grads, self.sizes)],
                   self.dim)


def split(t, size: int, dim: int = 0) -> tuple:
    """torch.split with one size: pieces of ``size`` along ``dim`` (the last one shorter when it does not divide)."""
    dim %= t.ndim
    length = t.shape[dim]
    sizes = tuple(min(size, length - start) for start in range(0, length, size))
    return Split.apply(t, sizes=sizes, dim=dim) if len(sizes) > 1 else (t,)


def scatter_into_zeros(g, shape, spec):
    """A tensor of ``shape``, zero except the region ``spec`` (per-dim start, stop, step) holding ``g``: g padded
    with zeros along each sliced dim by one concatenation (a step > 1 first interleaves zeros after each entry).
    The zeros are one broadcast element, so no array of ``shape`` is built on the host: a slice's gradient is one
    pass over its input's size per sliced dim."""
    out = g
    for dim, ((start, stop, step), size) in enumerate(zip(spec, shape)):
        count = out.shape[dim]
        if (start, count, step) == (0, size, 1):
            continue
        if step > 1 and count > 1:  # [.., count, ..] -> [.., count, step, ..] with zeros after each entry
            spread = out.unsqueeze(dim + 1)
            out = cat([spread, _zeros_like(spread, dim + 1, step - 1)], dim + 1)
            out = out.reshape(*out.shape[:dim], count * step, *out.shape[dim + 2:])
            out = out[(slice(None),) * dim + (slice(0, (count - 1) * step + 1),)]
        after = size - start - out.shape[dim]
        parts = ([_zeros_like(out, dim, start)] if start else []) + [out] + (
            [_zeros_like(out, dim, after)] if after else [])
        out = cat(parts, dim)
    return out


def _zeros_like(x, dim: int, size: int):
    """Zeros of x's shape but ``size`` along ``dim``, and x's dtype: one element, broadcast."""
    shape = list(x.shape)
    shape[dim] = size
    return constant(np.zeros((1,) * x.ndim, np.float32), dtype=x.dtype, device=x.device).expand(*shape)


def getitem(t, index):
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = t.ndim - (len(index) - 1 - sum(i is None for i in index))
        index = index[:at] + (slice(None),) * fill + index[at + 1:]
    spec, out_shape, dim = [], [], 0
    for i in index:
        if i is None:
            out_shape.append(1)
            continue
        size = t.shape[dim]
        if isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step <= 0:
                raise IndexError("negative slice steps are not supported; use flip")
            spec.append((start, stop, step))
            out_shape.append(max(0, -(-(stop - start) // step)))
        elif isinstance(i, int):
            if not -size <= i < size:
                raise IndexError(f"index {i} out of range for dimension {dim} of size {size}")
            i %= size
            spec.append((i, i + 1, 1))
        else:
            raise TypeError(f"unsupported index {i!r}: use slices, integers, None or ...")
        dim += 1
    for size in t.shape[dim:]:
        spec.append((0, size, 1))
        out_shape.append(size)
    return Slice.apply(t, spec=tuple(spec)).reshape(tuple(out_shape))
