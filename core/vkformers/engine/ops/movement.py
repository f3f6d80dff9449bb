"""Views: reshape, permute, expand and slicing. They move no data; backward undoes the view."""
from __future__ import annotations

from vkformers.engine.function import Function, contiguous


def reshape_lazy(x, shape):
    """The lazy buffer ``x`` under a new shape: a view, or a view of a contiguous copy when x is strided."""
    new_view = x.view.reshape(shape)
    if new_view is None:
        x = contiguous(x)
        new_view = x.view.reshape(shape)
    return x.make_view(new_view)


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


def sum_to_shape(g, shape):
    """Sum ``g`` over the dimensions that broadcasting added or stretched, giving ``shape``."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
    return g.sum(axis=axes, keepdim=True).reshape(shape)


class Slice(Function):
    """Basic indexing with slices (step > 0) and integers; the gradient lands in a zero tensor."""

    def forward(self, x, spec):
        self.in_shape, self.spec = x.shape, spec
        view = x.view
        for dim, (start, stop, step) in enumerate(spec):
            view = view.slice(dim, start, stop, step)
        return x.make_view(view)

    def backward(self, g):
        from vkformers.engine.ops.elementwise import scatter_into_zeros
        return scatter_into_zeros(g, self.in_shape, self.spec)


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
