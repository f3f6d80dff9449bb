"""Transformer ops: embedding, RMSNorm, LayerNorm, rotary embeddings, cross-entropy, attention, dropout.

Each pairs kernel ops (launchers in engine/kernels) with a Function whose
backward uses the matching backward kernel.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np

from vkformers.engine.function import Function, KernelOp, constant, contiguous, node, wrap
from vkformers.engine.lazy import generated_input
from vkformers.engine.ops.quant import quantized_embedding
from vkformers.engine.ops.reduce import Reduce
from vkformers.engine.quantized import QuantizedTensor
from vkformers.engine.row_blocks import RowBlocks
from vkformers.engine.kernels import attention as KA
from vkformers.engine.kernels import cross_entropy as KC
from vkformers.engine.kernels import dropout as KD
from vkformers.engine.kernels import embedding as KE
from vkformers.engine.kernels import norm as KN
from vkformers.engine.kernels import rope as KR
from vkformers.engine.kernels import take_along as KT
from vkformers.errors import VkformersError
from vkformers.runtime import dtypes as dt


def _rows_cols(shape):
    return math.prod(shape[:-1]), shape[-1]


# ---------------------------------------------------------------- embedding

class EmbeddingKernel(KernelOp):
    name = "embedding"

    def emit(self, seq, outs, ins):
        (out,), (table, ids) = outs, ins
        KE.embedding(seq, table.operand, ids.operand, out.operand, count=ids.numel, dim=table.shape[-1],
                     vocab=table.shape[0])


class EmbeddingBackwardKernel(KernelOp):
    name = "embedding_backward"

    def emit(self, seq, outs, ins):
        (d_table,), (d_out, ids) = outs, ins
        seq.fill(d_table.operand.buffer, 0)  # the kernel adds into d_table
        KE.embedding_backward(seq, d_out.operand, ids.operand, d_table.operand, count=ids.numel,
                              dim=self.vocab_shape[1], vocab=self.vocab_shape[0], padding_idx=self.padding_idx)


class EmbeddingFn(Function):
    def forward(self, table, ids, padding_idx=None):
        if ids.dtype is not dt.int32:
            raise TypeError(f"embedding ids must be int32, not {ids.dtype.name}")
        if padding_idx is not None and padding_idx < 0:  # counted from the end, as torch.nn.Embedding does
            padding_idx += table.shape[0]
        self.saved, self.table_shape, self.table_dtype = (ids,), table.shape, table.dtype
        self.padding_idx = padding_idx
        return node(EmbeddingKernel(), [table, ids], [(ids.shape + table.shape[1:], table.dtype)])[0]

    def backward(self, g):
        (ids,) = self.saved
        d_table = node(EmbeddingBackwardKernel(vocab_shape=self.table_shape, padding_idx=self.padding_idx),
                       [g.float().lazy, ids], [(self.table_shape, dt.float32)])[0]
        return wrap(d_table).cast(self.table_dtype), None


def embedding(ids, table, padding_idx: int | None = None):
    """table[ids]; lookups of row ``padding_idx`` (torch.nn.Embedding's; negative counts from the end) pass it
    no gradient. The forward reads that row like any other. A table of packed blocks (frozen) is dequantized row
    by row. A table in row blocks (engine/row_blocks.py) adds up its blocks' lookups, each of the ids shifted
    to its first row (a zero row where an id falls outside it)."""
    if isinstance(table, RowBlocks):
        if padding_idx is not None and padding_idx < 0:
            padding_idx += table.shape[0]
        out = None
        for part, (a, b) in zip(table.parts, table.spans):
            looked = embedding(ids - a if a else ids, part,
                               padding_idx - a if padding_idx is not None and a <= padding_idx < b else None)
            out = looked if out is None else out + looked
        return out
    if isinstance(table, QuantizedTensor):
        return quantized_embedding(ids, table)
    return EmbeddingFn.apply(table, ids, padding_idx=padding_idx)


class GatherRowsFn(Function):
    """out[s] = src[index[s]] for src [rows, width] and int32 ``index`` of any shape (a zero row where an
    index is -1 or out of range): the embedding kernel. ``inverse`` (int32 [..., rows]) says where each row of
    src went, out.flat[inverse[p, r]] for every leading slice p (-1: nowhere), so that the gradient is a
    gather too: d_src[r] = sum over p of d_out.flat[inverse[p, r]], parallel over every element, where the
    embedding's scatter-add walks the rows in order. For an index that picks each row at most once per slice
    (mixture-of-experts token lists)."""

    def forward(self, src, index, inverse):
        for name, ids in (("index", index), ("inverse", inverse)):
            if ids.dtype is not dt.int32:
                raise TypeError(f"gather_rows: {name} must be int32, not {ids.dtype.name}")
        if len(src.shape) != 2 or inverse.shape[-1] != src.shape[0]:
            raise ValueError(f"gather_rows: src must be [rows, width] and inverse [..., rows]; got src "
                             f"{src.shape}, inverse {inverse.shape}")
        self.saved, self.out_rows = (inverse,), math.prod(index.shape)
        return node(EmbeddingKernel(), [src, index], [(index.shape + src.shape[1:], src.dtype)])[0]

    def backward(self, g):
        (inverse,) = self.saved
        width = g.shape[-1]
        d = node(EmbeddingKernel(), [g.reshape(self.out_rows, width).lazy, inverse],
                 [(inverse.shape + (width,), g.dtype)])[0]
        d = wrap(d)
        return (d.reshape(-1, *d.shape[-2:]).sum(0) if len(inverse.shape) > 1 else d), None, None


def gather_rows(src, index, inverse):
    return GatherRowsFn.apply(src, index, inverse)


class TakeAlongKernel(KernelOp):
    name = "take_along"

    def emit(self, seq, outs, ins):
        (out,), (x, index) = outs, ins
        rows, picks = index.shape
        KT.take_along(seq, x.operand, index.operand, out.operand, planes=x.numel // (rows * x.shape[-1]),
                      rows=rows, cols=x.shape[-1], picks=picks)


class TakeAlongBackwardKernel(KernelOp):
    name = "take_along_backward"

    def emit(self, seq, outs, ins):
        (d_x,), (d_out, index) = outs, ins
        rows, picks = index.shape
        KT.take_along_backward(seq, d_out.operand, index.operand, d_x.operand,
                               planes=d_x.numel // (rows * d_x.shape[-1]), rows=rows, cols=d_x.shape[-1],
                               picks=picks)


class TakeAlongFn(Function):
    def forward(self, x, index):
        self.saved, self.x_shape = (index,), x.shape
        return node(TakeAlongKernel(), [x, index], [(x.shape[:-1] + index.shape[-1:], x.dtype)])[0]

    def backward(self, g):
        (index,) = self.saved
        d_x = node(TakeAlongBackwardKernel(), [g.contiguous().lazy, index], [(self.x_shape, g.dtype)])[0]
        return wrap(d_x), None


def take_along_last(x, index):
    """out[..., r, j] = x[..., r, index[r, j]] for x [..., R, C] and one int32 ``index`` [R, J] shared by every
    leading slice: torch.gather(x, -1, index.expand(...)). Several picks of one element sum their gradients;
    an index outside [0, C) reads zero (clamp it first for torch's behaviour)."""
    if index.dtype is not dt.int32:
        raise TypeError(f"take_along_last: index must be int32, not {index.dtype.name}")
    if len(index.shape) != 2 or len(x.shape) < 2 or x.shape[-2] != index.shape[0]:
        raise ValueError(f"take_along_last: x must be [..., R, C] and index [R, J]; got x {x.shape}, "
                         f"index {index.shape}")
    return TakeAlongFn.apply(x.contiguous(), index)


# ---------------------------------------------------------------- norms

class RMSNormKernel(KernelOp):
    name = "rms_norm"

    def emit(self, seq, outs, ins):
        (y, rstd), (x, *w) = outs, ins
        rows, cols = _rows_cols(x.shape)
        KN.rms_norm(seq, x.operand, w[0].operand if w else None, y.operand, rstd.operand, rows=rows, cols=cols,
                    eps=self.eps, unit_offset=self.unit_offset)


class RMSNormBackwardKernel(KernelOp):
    name = "rms_norm_backward"

    def emit(self, seq, outs, ins):
        (dx, *dw), (dy, x, rstd, *w) = outs, ins
        rows, cols = _rows_cols(x.shape)
        KN.rms_norm_backward(seq, dy.operand, x.operand, w[0].operand if w else None, rstd.operand, dx.operand,
                             dw[0].operand if dw else None, rows=rows, cols=cols, unit_offset=self.unit_offset)


class RMSNormFn(Function):
    def forward(self, x, weight, eps, unit_offset):
        self.unit_offset = unit_offset
        ins = [x] + ([weight] if weight is not None else [])
        y, rstd = node(RMSNormKernel(eps=float(eps), unit_offset=unit_offset), ins,
                       [(x.shape, x.dtype), (x.shape[:-1], dt.float32)])
        self.saved = (x, rstd, weight)
        return y

    def backward(self, g):
        x, rstd, weight = self.saved
        ins = [g.lazy, x, rstd] + ([weight] if weight is not None else [])
        need_dw = weight is not None and self.needs_grad[1]  # a frozen weight (LoRA's norms) gets no gradient
        outs = [(x.shape, x.dtype)] + ([(weight.shape, dt.float32)] if need_dw else [])
        grads = node(RMSNormBackwardKernel(unit_offset=self.unit_offset), ins, outs)
        dx = wrap(grads[0])
        dw = wrap(grads[1]).cast(weight.dtype) if need_dw else None
        return dx, dw


def rms_norm(x, weight=None, eps: float = 1e-6, unit_offset: bool = False):
    return RMSNormFn.apply(x, weight, eps=eps, unit_offset=unit_offset)


class LayerNormKernel(KernelOp):
    name = "layer_norm"

    def emit(self, seq, outs, ins):
        (y, mean, rstd), (x, *params) = outs, ins
        w, b = _weight_bias(params, self.has_weight, self.has_bias)
        rows, cols = _rows_cols(x.shape)
        KN.layer_norm(seq, x.operand, w, b, y.operand, mean.operand, rstd.operand, rows=rows, cols=cols, eps=self.eps)


class LayerNormBackwardKernel(KernelOp):
    name = "layer_norm_backward"

    def emit(self, seq, outs, ins):
        (dx, *dparams), (dy, x, mean, rstd, *params) = outs, ins
        w, _ = _weight_bias(params, self.has_weight, False)
        dw, db = _weight_bias(dparams, self.grad_weight, self.grad_bias)
        rows, cols = _rows_cols(x.shape)
        KN.layer_norm_backward(seq, dy.operand, x.operand, w, mean.operand, rstd.operand, dx.operand, dw, db,
                               rows=rows, cols=cols)


def _weight_bias(args, has_weight, has_bias):
    args = list(args)
    w = args.pop(0).operand if has_weight else None
    b = args.pop(0).operand if has_bias and args else None
    return w, b


class LayerNormFn(Function):
    def forward(self, x, weight, bias, eps):
        self.flags = dict(has_weight=weight is not None, has_bias=bias is not None)
        params = [p for p in (weight, bias) if p is not None]
        y, mean, rstd = node(LayerNormKernel(eps=float(eps), **self.flags), [x] + params,
                             [(x.shape, x.dtype), (x.shape[:-1], dt.float32), (x.shape[:-1], dt.float32)])
        self.saved = (x, mean, rstd, weight, bias)
        return y

    def backward(self, g):
        x, mean, rstd, weight, bias = self.saved
        # frozen parameters (a LoRA model's norms) get no gradient
        need_dw, need_db = weight is not None and self.needs_grad[1], bias is not None and self.needs_grad[2]
        outs = [(x.shape, x.dtype)] + [(p.shape, dt.float32) for p, need in ((weight, need_dw), (bias, need_db))
                                       if need]
        kernel = LayerNormBackwardKernel(has_weight=self.flags["has_weight"], grad_weight=need_dw, grad_bias=need_db)
        grads = node(kernel, [g.lazy, x, mean, rstd] + ([weight] if weight is not None else []), outs)
        grads = [wrap(v) for v in grads]
        dx, rest = grads[0], grads[1:]
        dw = rest.pop(0).cast(weight.dtype) if need_dw else None
        db = rest.pop(0).cast(bias.dtype) if need_db else None
        return dx, dw, db


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    return LayerNormFn.apply(x, weight, bias, eps=eps)


# ---------------------------------------------------------------- rotary embeddings

class RopeKernel(KernelOp):
    """The kernel reads x through its strides (a projection's [B, T, H, D] output permuted to [B, H, T, D]: no copy
    node), head dims dense; it writes a dense output."""

    name = "rope"
    contiguous_inputs = False

    def emit(self, seq, outs, ins):
        (y,), (x, positions, inv_freq) = outs, ins
        batch, heads, seq_len, head_dim = x.shape
        KR.rope(seq, x.operand, positions.operand, inv_freq.operand, y.operand, batch=batch, heads=heads,
                seq_len=seq_len, head_dim=head_dim, rot_dim=2 * inv_freq.numel, interleaved=self.interleaved,
                attention_scaling=self.scaling, inverse=self.inverse, x_strides=x.strides[:3])


def _rope_node(x, positions, inv_freq, flags: dict, inverse: bool):
    if x.view.strides[-1] != 1 and x.shape[-1] != 1:
        x = contiguous(x)
    return node(RopeKernel(inverse=inverse, **flags), [x, contiguous(positions), contiguous(inv_freq)],
                [(x.shape, x.dtype)])[0]


class RopeFn(Function):
    def forward(self, x, positions, inv_freq, interleaved, scaling):
        self.saved, self.flags = (positions, inv_freq), dict(interleaved=interleaved, scaling=float(scaling))
        return _rope_node(x, positions, inv_freq, self.flags, inverse=False)

    def backward(self, g):
        positions, inv_freq = self.saved
        # the transpose of a rotation by theta (scaled by s) is the rotation by -theta, scaled by s
        return wrap(_rope_node(g.lazy, positions, inv_freq, self.flags, inverse=True)), None, None


def rope(x, positions, inv_freq, interleaved: bool = False, attention_scaling: float = 1.0):
    """Rotate x [batch, heads, seq, head_dim] by positions [batch, seq] (int32) * inv_freq (float32)."""
    return RopeFn.apply(x, positions, inv_freq, interleaved=interleaved, scaling=attention_scaling)


# ---------------------------------------------------------------- cross-entropy

class CrossEntropyKernel(KernelOp):
    name = "cross_entropy"

    def emit(self, seq, outs, ins):
        (loss, count, lse, *kept), (logits, labels) = outs, ins
        rows, vocab = _rows_cols(logits.shape)
        loss_rows = kept[0].operand if kept else seq.scratch(rows, "float32", name="loss rows")
        KC.cross_entropy(seq, logits.operand, labels.operand, loss_rows, lse.operand, loss.operand, count.operand,
                         rows=rows, vocab=vocab, ignore_index=self.ignore_index)


class CrossEntropyBackwardKernel(KernelOp):
    name = "cross_entropy_backward"
    inplace = ((0, 0),)  # d_logits over logits when nothing reads them after

    def emit(self, seq, outs, ins):
        (d_logits,), (logits, labels, lse, d_loss, count) = outs, ins
        rows, vocab = _rows_cols(logits.shape)
        KC.cross_entropy_backward(seq, logits.operand, labels.operand, lse.operand, d_loss.operand, count.operand,
                                  d_logits.operand, rows=rows, vocab=vocab, ignore_index=self.ignore_index)


class CrossEntropyFn(Function):
    def forward(self, logits, labels, ignore_index, reduction):
        self.ignore_index = ignore_index
        rows = math.prod(logits.shape[:-1])
        outs = [((), dt.float32), ((), dt.float32), ((rows,), dt.float32)]
        if reduction == "sum":  # the per-row losses come out (ignored rows hold 0) and are added up here
            outs.append(((rows,), dt.float32))
        loss, count, lse, *loss_rows = node(CrossEntropyKernel(ignore_index=ignore_index), [logits, labels], outs)
        if reduction == "sum":
            loss = node(Reduce(op="sum", outer=1, axis_len=rows, inner=1), loss_rows, [((), dt.float32)])[0]
            count = constant(np.float32(1.0), device=logits.device).lazy  # the backward divides by it: d_loss as is
        self.saved = (logits, labels, lse, count)
        return loss

    def backward(self, g):
        logits, labels, lse, count = self.saved
        d = node(CrossEntropyBackwardKernel(ignore_index=self.ignore_index),
                 [logits, labels, lse, g.float().lazy, count], [(logits.shape, logits.dtype)])[0]
        return wrap(d), None


def cross_entropy(logits, labels, ignore_index: int = -100, reduction: str = "mean"):
    """Cross-entropy of logits [..., vocab] against int32 labels [...], skipping ignore_index: the mean over the
    rows not ignored (0/0 = NaN when every row is), or with ``reduction="sum"`` their sum (0 when every row is
    ignored), as torch's. float32."""
    if reduction not in ("mean", "sum"):
        raise VkformersError(f"cross_entropy: reduction {reduction!r} is not offered; use 'mean' or 'sum'")
    if labels.dtype is not dt.int32:
        labels = labels.cast(dt.int32)
    vocab = logits.shape[-1]
    return CrossEntropyFn.apply(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=ignore_index,
                                reduction=reduction)


# ---------------------------------------------------------------- attention

def _attention_flags(q, k, attrs):
    batch, heads, q_len, head_dim = q.shape
    return dict(batch=batch, heads=heads, kv_heads=k.shape[1], q_len=q_len, kv_len=k.shape[2], head_dim=head_dim,
                **attrs)


def _optional(ins, attrs):
    """Split the optional (key padding mask, alibi slopes) operands off the input list."""
    ins = list(ins)
    mask = ins.pop(0).operand if attrs["has_mask"] else None
    alibi = ins.pop(0).operand if attrs["has_alibi"] else None
    return mask, alibi


class AttentionKernel(KernelOp):
    name = "attention"

    def emit(self, seq, outs, ins):
        (out, lse), (q, k, v, *extra) = outs, ins
        mask, alibi = _optional(extra, self.attrs)
        KA.attention_forward(seq, q.operand, k.operand, v.operand, out.operand, lse.operand,
                             key_padding_mask=mask, alibi_slopes=alibi, **self.kernel_flags(q, k))

    def kernel_flags(self, q, k):
        flags = {n: self.attrs[n] for n in ("scale", "causal", "window", "softcap", "q_offset")}
        return _attention_flags(q, k, flags)


class AttentionBackwardKernel(AttentionKernel):
    name = "attention_backward"

    def emit(self, seq, outs, ins):
        (dq, dk, dv), (q, k, v, out, d_out, lse, *extra) = outs, ins
        d_lse = extra.pop().operand if self.has_d_lse else None
        mask, alibi = _optional(extra, self.attrs)
        KA.attention_backward(seq, q.operand, k.operand, v.operand, out.operand, d_out.operand, lse.operand,
                              dq.operand, dk.operand, dv.operand, key_padding_mask=mask, alibi_slopes=alibi,
                              d_lse=d_lse, **self.kernel_flags(q, k))


class AttentionFn(Function):
    def forward(self, q, k, v, mask, alibi, return_lse=False, **attrs):
        extra = [x for x in (mask, alibi) if x is not None]
        self.attrs = dict(attrs, has_mask=mask is not None, has_alibi=alibi is not None)
        out, lse = node(AttentionKernel(**self.attrs), [q, k, v] + extra,
                        [(q.shape, q.dtype), (q.shape[:-1], dt.float32)])
        self.saved = (q, k, v, out, lse, extra)
        return (out, lse) if return_lse else out

    def backward(self, g, g_lse=None):
        q, k, v, out, lse, extra = self.saved
        if g is None:  # only the logsumexp was used
            g = wrap(out).detach() * 0.0
        d_lse = [g_lse.float().contiguous().lazy] if g_lse is not None else []
        grads = node(AttentionBackwardKernel(**self.attrs, has_d_lse=bool(d_lse)),
                     [q, k, v, out, g.contiguous().lazy, lse] + extra + d_lse,
                     [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)])
        return tuple(wrap(x) for x in grads) + (None, None)


def scaled_dot_product_attention(q, k, v, *, causal: bool = True, scale: float | None = None,
                                 key_padding_mask=None, window: int = 0, softcap: float = 0.0, alibi_slopes=None,
                                 q_offset: int | None = None, return_lse: bool = False):
    """softmax(scale * q k^T [+ alibi], masked) v for q [B, H, Sq, D], k and v [B, KVH, Skv, D] (GQA when KVH < H).

    key_padding_mask: [B, Skv] bool/uint8, 1 = attend (HF attention_mask). window > 0: sliding window.
    softcap > 0: scores = softcap * tanh(scores / softcap). Fully masked rows give zeros.
    return_lse: also return each query row's logsumexp of the (scaled, masked) scores, float32 [B, H, Sq]
    (-inf for a row that sees no key), differentiable: e.g. attention sinks, out * sigmoid(lse - sink).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return AttentionFn.apply(q.contiguous(), k.contiguous(), v.contiguous(), key_padding_mask, alibi_slopes,
                             return_lse=return_lse, scale=float(scale), causal=causal, window=int(window),
                             softcap=float(softcap), q_offset=q_offset)


def gather_flat(values, index):
    """values[index] for a 1-D ``values`` and an int32 ``index`` of any shape (no gradient)."""
    table = values.reshape(-1, 1)
    out = node(EmbeddingKernel(), [table.lazy, index.lazy], [(index.shape + (1,), values.dtype)])[0]
    return wrap(out).reshape(index.shape)


# ---------------------------------------------------------------- dropout

class DropoutKernel(KernelOp):
    name = "dropout"

    def emit(self, seq, outs, ins):
        (y,), (x, seed) = outs, ins
        KD.dropout(seq, x.operand, y.operand, seed.operand, p=self.p, count=x.numel, stream=self.stream)


class DropoutFn(Function):
    def forward(self, x, seed, p, stream):
        self.saved, self.flags = (seed,), dict(p=float(p), stream=int(stream))
        return node(DropoutKernel(**self.flags), [x, seed], [(x.shape, x.dtype)])[0]

    def backward(self, g):
        (seed,) = self.saved  # the same seed regenerates the same mask
        return wrap(node(DropoutKernel(**self.flags), [g.contiguous().lazy, seed], [(g.shape, g.dtype)])[0]), None


_dropout_rng = np.random.default_rng()


def manual_seed(seed: int) -> None:
    """Seed the generator that draws dropout seeds (one per dropout call, uploaded with the step)."""
    global _dropout_rng
    _dropout_rng = np.random.default_rng(seed)


def dropout_rng_state() -> dict:
    """The state of the generator that draws dropout seeds (saved in training checkpoints)."""
    return _dropout_rng.bit_generator.state


def set_dropout_rng_state(state: dict) -> None:
    global _dropout_rng
    _dropout_rng = np.random.default_rng()
    _dropout_rng.bit_generator.state = state


def _draw_dropout_seed() -> np.ndarray:
    return _dropout_rng.integers(0, 2**32, size=2, dtype=np.uint64).astype(np.uint32)


_seed_tapes: list = []  # innermost last: ("record", list) or ("replay", iterator)


@contextmanager
def recording_dropout_seeds():
    """Inside, the seed tensor of every dropout call is appended to the yielded list (in call order)."""
    seeds: list = []
    _seed_tapes.append(("record", seeds))
    try:
        yield seeds
    finally:
        _seed_tapes.pop()


@contextmanager
def replaying_dropout_seeds(seeds):
    """Inside, dropout calls take their seed tensors from ``seeds`` in order instead of drawing new ones, so a
    recomputed forward (engine/checkpoint.py) applies the masks the first forward applied, and draws nothing."""
    _seed_tapes.append(("replay", iter(seeds)))
    try:
        yield
    finally:
        _seed_tapes.pop()


def _dropout_seed(device):
    if _seed_tapes and _seed_tapes[-1][0] == "replay":
        seed = next(_seed_tapes[-1][1], None)
        if seed is None:
            raise RuntimeError("a recomputed forward called dropout more often than the forward it repeats")
        return seed
    seed = constant(generated_input(_draw_dropout_seed(), _draw_dropout_seed), dtype=dt.uint32, device=device)
    for kind, tape in _seed_tapes:
        if kind == "record":
            tape.append(seed)
    return seed


def dropout(x, p: float = 0.5, training: bool = True, stream: int = 0):
    """Zero each element with probability p and scale the rest by 1/(1-p) (identity when not training)."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return DropoutFn.apply(x.contiguous(), _dropout_seed(x.device), p=p, stream=stream)
