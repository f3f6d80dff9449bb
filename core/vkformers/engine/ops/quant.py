"""Ops on quantized weights (engine.quantized.QuantizedTensor): a Linear layer's product and an embedding
lookup, both dequantizing the packed blocks inside the kernel (engine/kernels/matmul_quant.py).

The weights are frozen: gradients flow to the activations only, dX = dY @ W through the same kernel (the
tiled product with W not transposed), which is what LoRA adapters on a quantized base (QLoRA) need.
"""
from __future__ import annotations

import math

from vkformers.engine.function import Function, KernelOp, node, reshape_lazy, wrap
from vkformers.engine.kernels import matmul_quant as KQ
from vkformers.engine.lazy import View
from vkformers.engine.quantized import QuantizedTensor, quant_format
from vkformers.runtime import dtypes as dt


class QuantMatmul(KernelOp):
    """ins: A [m, k], packed W; out: C [m, n]. Attributes: m, n, k, trans_w, format (a name)."""

    name = "matmul_quant"

    def emit(self, seq, outs, ins):
        (c,), (a, w) = outs, ins
        KQ.matmul_quant(seq, a.operand, w.operand, c.operand, quant_format(self.format), m=self.m, n=self.n,
                        k=self.k, trans_w=self.trans_w)


class QuantEmbedding(KernelOp):
    name = "embedding_quant"

    def emit(self, seq, outs, ins):
        (out,), (table, ids) = outs, ins
        KQ.embedding_quant(seq, table.operand, ids.operand, out.operand, quant_format(self.format),
                           count=ids.numel, dim=self.dim, vocab=self.vocab)


def _product(rows, packed, weight: QuantizedTensor, *, m: int, trans_w: bool):
    n, k = weight.shape if trans_w else weight.shape[::-1]
    op = QuantMatmul(m=m, n=n, k=k, trans_w=trans_w, format=weight.format.name)
    return node(op, [rows, packed], [((m, n), rows.dtype)])[0]


class QuantizedLinearFn(Function):
    """``x @ W^T`` for x [..., k] and a quantized W [n, k]; the backward gives x's gradient only."""

    def forward(self, x, packed, weight: QuantizedTensor = None):
        n, k = weight.shape
        if x.shape[-1] != k:
            raise ValueError(f"linear: input {x.shape} does not fit weight {weight.shape} (last dim must be {k})")
        if x.dtype.name not in KQ.ACTIVATION_VARIANTS:
            raise TypeError(f"linear: a quantized weight takes float32, float16 or bfloat16 input, not {x.dtype.name}")
        m = math.prod(x.shape[:-1])
        self.weight, self.x_shape, self.x_dtype = weight, x.shape, x.dtype
        self.saved = (packed,)
        y = _product(reshape_lazy(x, (m, k)), packed, weight, m=m, trans_w=True)
        return y.make_view(View.dense(x.shape[:-1] + (n,)))

    def backward(self, g):
        if not self.needs_grad[0]:
            return None, None
        (packed,) = self.saved
        n, k = self.weight.shape
        m = math.prod(self.x_shape[:-1])
        rows = reshape_lazy(g.cast(self.x_dtype).contiguous().lazy, (m, n))
        gx = _product(rows, packed, self.weight, m=m, trans_w=False)
        return wrap(gx.make_view(View.dense(self.x_shape))), None


def quantized_linear(x, weight: QuantizedTensor, bias=None):
    """x @ weight.T (+ bias) with ``weight`` a QuantizedTensor [out_features, in_features]; x keeps its dtype."""
    y = QuantizedLinearFn.apply(x, weight.packed, weight=weight)
    return y + bias if bias is not None else y


def quantized_embedding(ids, table: QuantizedTensor, dtype=None):
    """Rows of a quantized table [vocab, dim] picked by int32 ``ids``, dequantized to ``dtype`` (default: the
    table's compute dtype). No gradient: the table is frozen."""
    if ids.dtype is not dt.int32:
        raise TypeError(f"embedding ids must be int32, not {ids.dtype.name}")
    vocab, dim = table.shape
    out_dtype = dt.as_dtype(dtype) if dtype is not None else table.dtype
    op = QuantEmbedding(dim=dim, vocab=vocab, format=table.format.name)
    out = node(op, [table.lazy, ids.lazy], [(ids.shape + (dim,), out_dtype)])[0]
    return wrap(out)


__all__ = ["QuantEmbedding", "QuantMatmul", "QuantizedLinearFn", "quantized_embedding", "quantized_linear"]
