"""Batched matrix multiplication with numpy broadcasting over batch dims; transposed operands need no copy."""
from __future__ import annotations

import math

from vkformers.engine.function import Function, KernelOp, contiguous, node, reshape_lazy, wrap
from vkformers.engine.lazy import LazyBuffer, View
from vkformers.engine.ops.elementwise import broadcast_shape, sum_to_shape
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
        a, b, live = (None if v is None else wrap(v) for v in self.saved)
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
        rows, weight, live = (None if v is None else wrap(v) for v in self.saved)
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


# ---------------------------------------------------------------- products over packed rows (mixture of experts)

class SpanProducts(KernelOp):
    """E products over rows packed span by span (KM.matmul's span gates; spans float32 [E, 2] of (start, count)).
    mode "span_rows": outs (c [rows, n]); ins (a [rows, k], spans, *bs): c[span e] = a[span e] @ op(b_e) with
    op(b_e) [k, n] (transposed per ``trans_b``), bs E matrices or one stacked [E, ., .] (batch stride
    ``stride_b``). mode "span_depth": outs E matrices [m, n] (or one stacked [E, m, n]); ins (a [rows, m], spans,
    b [rows, n]): out_e = a[span e]^T @ b[span e]."""

    name = "span_products"
    contiguous_inputs = False  # forward() settled the layouts

    def emit(self, seq, outs, ins):
        a, spans, *bs = ins
        experts, stacked = self.experts, self.stacked
        # Cooperative-matrix tiles sized for a span of average length (the product's m counts every packed row).
        rows_per_span = max(1, -(-self.m // experts)) if self.mode == "span_rows" else self.m
        common = dict(m=self.m, n=self.n, k=self.k, gate_mode=self.mode,
                      coopmat=KM.coopmat_config(seq.device, rows_per_span, self.n, experts))
        if self.mode == "span_rows":
            (c,) = outs
            if stacked:
                KM.matmul(seq, a.operand, bs[0].operand, c.operand, batch=experts, trans_b=self.trans_b[0],
                          stride_a=0, stride_b=self.stride_b, stride_c=0, gate=spans.operand, **common)
                return
            together = object()  # disjoint spans of c: no barrier between the experts' products
            for e, b in enumerate(bs):
                KM.matmul(seq, a.operand, b.operand, c.operand, trans_b=self.trans_b[e],
                          gate=KM.Operand(spans.operand.buffer, spans.operand.offset + 2 * e), write_group=together,
                          **common)
            return
        (b,) = bs
        if stacked:
            KM.matmul(seq, a.operand, b.operand, outs[0].operand, batch=experts, trans_a=True, stride_a=0,
                      stride_b=0, stride_c=self.m * self.n, gate=spans.operand, **common)
            return
        for e, c in enumerate(outs):
            KM.matmul(seq, a.operand, b.operand, c.operand, trans_a=True,
                      gate=KM.Operand(spans.operand.buffer, spans.operand.offset + 2 * e), **common)


def _check_spans(spans, experts: int) -> LazyBuffer:
    if spans.dtype.name != "float32" or spans.shape != (experts, 2):
        raise ValueError(f"grouped_matmul: spans must be float32 [{experts}, 2] (start, count), "
                         f"got {spans.dtype.name} {spans.shape}")
    return contiguous(spans)


def _span_rows(a, spans, weights, stacked: bool, n: int):
    """a [rows, k] @ op(w_e) over each span: one node, and whether the first weight is stored transposed.
    ``weights``: [k, n] views (or one [E, k, n] view)."""
    rows, k = a.shape
    experts = weights[0].shape[0] if stacked else len(weights)
    layouts = [_matrix_layout(w, (experts,) if stacked else ()) for w in weights]
    op = SpanProducts(mode="span_rows", m=rows, n=n, k=k, experts=experts, stacked=stacked,
                      trans_b=tuple(t for _, t, _ in layouts), stride_b=layouts[0][2] if stacked else 0)
    out = node(op, [contiguous(a), spans, *(w for w, _, _ in layouts)], [((rows, n), a.dtype)])[0]
    return out, layouts[0][1]


def _span_depth(a, b, spans, experts: int, stacked: bool):
    """a[span e]^T @ b[span e] for a [rows, m], b [rows, n]: E outputs [m, n] (one [E, m, n] when stacked)."""
    (rows, m), n = a.shape, b.shape[1]
    op = SpanProducts(mode="span_depth", m=m, n=n, k=rows, experts=experts, stacked=stacked, trans_b=(),
                      stride_b=0)
    shapes = [((experts, m, n), a.dtype)] if stacked else [((m, n), a.dtype)] * experts
    return node(op, [contiguous(a), spans, contiguous(b)], shapes)


def _transposed(w, stacked: bool):
    return w.make_view(w.view.permute((0, 2, 1) if stacked else (1, 0)))


class GroupedMatmulFn(Function):
    """x [rows, k] whose rows are packed span by span (spans float32 [E, 2]: start, count; no gradient) times one
    weight per span: y[span e] = x[span e] @ w_e, w_e [k, n] (E tensors, or one [E, k, n] when ``stacked``).
    Spans must not overlap (the experts' products run concurrently). Rows in no span are left unwritten
    (whatever the buffer held): only span rows may be read downstream.
    Backward: the input's gradient over the same spans, each weight's over its span's rows only."""

    def forward(self, x, spans, *weights, stacked=False):
        experts = weights[0].shape[0] if stacked else len(weights)
        if any(w.dtype is not x.dtype for w in weights):
            raise TypeError(f"grouped_matmul: input and weights must share a dtype ({x.dtype.name})")
        shapes = {w.shape[-2:] for w in weights}
        if len(x.shape) != 2 or len(shapes) != 1 or next(iter(shapes))[0] != x.shape[1] or (
                stacked and (len(weights) != 1 or len(weights[0].shape) != 3)):
            raise ValueError(f"grouped_matmul: x must be [rows, k] and every weight [k, n] (or one [E, k, n]), "
                             f"got x {x.shape} and weights {sorted(shapes)}")
        spans = _check_spans(spans, experts)
        self.saved = (x, spans, tuple(weights))
        self.stacked, self.experts = stacked, experts
        y, self.stored_transposed = _span_rows(x, spans, weights, stacked, weights[0].shape[-1])
        return y

    def backward(self, g):
        x, spans, weights = self.saved
        stacked, experts = self.stacked, self.experts
        g = contiguous(g.lazy)
        gx = None
        if self.needs_grad[0]:
            gx = _span_rows(g, spans, [_transposed(w, stacked) for w in weights], stacked, x.shape[1])[0]
        gws = [None] * len(weights)
        if any(self.needs_grad[2:]):
            # each gradient in its weight's stored orientation (a transposed view's as its transpose)
            if self.stored_transposed:
                gws = [_transposed(o, stacked) for o in _span_depth(g, x, spans, experts, stacked)]
            else:
                gws = _span_depth(x, g, spans, experts, stacked)
        return (_wrap_optional(gx), None,
                *(_wrap_optional(w) if need else None for w, need in zip(gws, self.needs_grad[2:])))


def _wrap_optional(lazy):
    return None if lazy is None else wrap(lazy)


def grouped_matmul(x, weights, spans):
    """x [rows, k] @ w_e over span e of its rows (spans float32 [E, 2]: start, count), for ``weights`` a list of E
    tensors [k, n] or one [E, k, n]. A mixture of experts with its tokens' rows packed expert by expert: each
    expert multiplies its own rows, one node (E dispatches, or one batched) for all. Rows outside every span
    are not written."""
    if isinstance(weights, (list, tuple)):
        return GroupedMatmulFn.apply(x, spans, *weights)
    return GroupedMatmulFn.apply(x, spans, weights, stacked=True)
