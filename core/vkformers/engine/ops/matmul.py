"""Batched matrix multiplication with numpy broadcasting over batch dims; transposed operands need no copy."""
from __future__ import annotations

import math

from vkformers.engine.function import Function, KernelOp, contiguous, node
from vkformers.engine.kernels import matmul as KM


class Matmul(KernelOp):
    name = "matmul"
    contiguous_inputs = False  # forward() settled the layouts; emit reads the transposes from the strides

    def emit(self, seq, outs, ins):
        (c,), (a, b, *gate) = outs, ins  # a third input: the gate of a row-limited product
        KM.matmul(seq, a.operand, b.operand, c.operand, m=self.m, n=self.n, k=self.k, batch=self.batch,
                  trans_a=self.trans_a, trans_b=self.trans_b, stride_a=self.stride_a, stride_b=self.stride_b,
                  stride_c=self.m * self.n, gate=gate[0].operand if gate else None, gate_mode=self.gate_mode)


def _check_live_rows(live_rows, batch: int) -> list:
    """[live_rows] as a matmul input (float32, one count per batch product), or []."""
    if live_rows is None:
        return []
    if live_rows.dtype.name != "float32" or math.prod(live_rows.shape) != batch:
        raise ValueError(f"matmul: live_rows must be float32 with one count per product ({batch}), "
                         f"got {live_rows.dtype.name} {live_rows.shape}")
    return [contiguous(live_rows)]  # the kernels read the counts as a dense array


def _matrix_layout(x, batch_shape):
    """(x viewed for the kernel, transposed?, batch stride) for x [..., r, c]; copies only when it must."""
    v = x.view
    r, c = x.shape[-2:]
    sr, sc = v.strides[-2:]
    if sc == 1 and (sr == c or r == 1):
        trans = False
    elif sr == 1 and (sc == r or c == 1):
        trans = True
    else:
        x = contiguous(x)
        return _matrix_layout(x, batch_shape)
    lead = x.shape[:-2]
    if not lead or math.prod(lead) == 1:
        stride = 0 if math.prod(batch_shape) > 1 else r * c
        return x, trans, stride
    if lead == tuple(batch_shape):
        strides = v.strides[:-2]
        expected = r * c
        dense = all(s == expected * math.prod(lead[i + 1:]) for i, s in enumerate(strides) if lead[i] != 1)
        if dense:
            return x, trans, r * c
    x = contiguous(x.make_view(x.view.expand(tuple(batch_shape) + (r, c))))
    return x, False, r * c


class MatmulFn(Function):
    """a @ b; with ``live_rows`` (a count per batch product, no gradient) a row-limited product: the rows of a
    at or past the count are padding, whose results nobody uses (KM.matmul gate_mode "rows"). Its backward
    keeps the limit: the gradient of a on the same rows, and that of b over the live rows only ("depth": the
    gradient flowing into padding rows is zero, since nothing used them)."""

    def forward(self, a, b, live_rows=None, gate_mode="rows"):
        if a.dtype is not b.dtype:
            raise TypeError(f"matmul: operands are {a.dtype.name} and {b.dtype.name}; cast one first")
        self.shapes = (a.shape, b.shape)
        m, k = a.shape[-2:]
        k2, n = b.shape[-2:]
        if k != k2:
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align ({k} != {k2})")
        from vkformers.engine.ops.elementwise import broadcast_shape
        batch_shape = broadcast_shape(a.shape[:-2], b.shape[:-2])
        a_k, trans_a, stride_a = _matrix_layout(a, batch_shape)
        b_k, trans_b, stride_b = _matrix_layout(b, batch_shape)
        self.saved = (a, b, live_rows)
        batch = max(1, math.prod(batch_shape))
        op = Matmul(m=m, n=n, k=k, batch=batch, trans_a=trans_a, trans_b=trans_b, stride_a=stride_a,
                    stride_b=stride_b, gate_mode=gate_mode)
        inputs = [a_k, b_k, *_check_live_rows(live_rows, batch)]
        return node(op, inputs, [(tuple(batch_shape) + (m, n), a.dtype)])[0]

    def backward(self, g):
        from vkformers.engine.ops.movement import sum_to_shape
        from vkformers.engine.tensor import Tensor
        a, b, live = (None if v is None else Tensor._from_lazy(v) for v in self.saved)
        ga = gb = None
        if self.needs_grad[0]:
            ga = sum_to_shape(MatmulFn.apply(g, b.transpose(-1, -2), live), a.shape)
        if self.needs_grad[1]:
            gb = sum_to_shape(MatmulFn.apply(a.transpose(-1, -2), g, live, gate_mode="depth"), b.shape)
        return ga, gb, None


class LinearFn(Function):
    """``x @ weight.T`` for x [..., k] and weight [n, k] (a Linear layer): the leading dims are the rows of one
    product, recorded as one graph node (no reshape or transpose nodes around it: building a model's graph in
    Python costs per node). The backward computes what matmul's would on those views; ``live_rows`` (one
    count) limits the rows as in MatmulFn."""

    def forward(self, x, weight, live_rows=None):
        if x.dtype is not weight.dtype:
            raise TypeError(f"linear: input and weight are {x.dtype.name} and {weight.dtype.name}; cast one first")
        n, k = weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"linear: input {x.shape} does not fit weight {weight.shape} (last dim must be {k})")
        from vkformers.engine.lazy import View
        from vkformers.engine.ops.movement import reshape_lazy
        m = math.prod(x.shape[:-1])
        rows = reshape_lazy(x, (m, k))
        a, trans_a, stride_a = _matrix_layout(rows, ())
        b, trans_b, stride_b = _matrix_layout(weight.make_view(weight.view.permute((1, 0))), ())
        self.saved = (rows, weight, live_rows)
        self.x_shape = x.shape
        op = Matmul(m=m, n=n, k=k, batch=1, trans_a=trans_a, trans_b=trans_b, stride_a=stride_a, stride_b=stride_b,
                    gate_mode="rows")
        y = node(op, [a, b, *_check_live_rows(live_rows, 1)], [((m, n), x.dtype)])[0]
        return y.make_view(View.dense(x.shape[:-1] + (n,)))

    def backward(self, g):
        from vkformers.engine.tensor import Tensor
        rows, weight, live = (None if v is None else Tensor._from_lazy(v) for v in self.saved)
        g_rows = g.reshape(-1, g.shape[-1])
        gx = MatmulFn.apply(g_rows, weight, live).reshape(self.x_shape) if self.needs_grad[0] else None
        gw = None
        if self.needs_grad[1]:
            gw = MatmulFn.apply(rows.transpose(0, 1), g_rows, live, gate_mode="depth").transpose(0, 1)
        return gx, gw, None


def matmul(a, b, live_rows=None):
    """a @ b with numpy broadcasting; ``live_rows`` (float32, one count per batch product, no gradient): rows of
    a at or past the count are padding whose results are not used, and the kernels may skip them (KM.matmul's
    row gate): a mixture-of-experts expert run on the rows of the tokens that chose it."""
    if live_rows is not None:
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError("matmul: live_rows needs matrices on both sides")
        return MatmulFn.apply(a, b, live_rows)
    if a.ndim == 1:
        return matmul(a.reshape(1, -1), b).reshape(b.shape[:-2] + b.shape[-1:])
    if b.ndim == 1:
        return matmul(a, b.reshape(-1, 1)).reshape(a.shape[:-1])
    return MatmulFn.apply(a, b)
