"""Token embedding: out[n, :] = table[ids[n], :], and its scatter-add gradient.

Ids outside [0, vocab) read nothing: the forward writes a zero row for them and the
backward skips them (no flag is raised; validate ids on the host if that matters). The backward also skips
``padding_idx`` (nn.Embedding's: lookups of that row pass it no gradient).
The backward adds into a float32 ``d_table`` (it accumulates: zero it first with ``seq.fill``),
one invocation per column walking the tokens in order: rows sharing an id are summed in token
order, so gradients are bit-reproducible (exact resume) and no float atomics are needed. The tokens go in
dispatches of at most LOOP_ITERATIONS - 1, one after another, which keeps that order.
"""
from __future__ import annotations

from vkformers.engine.kernels import LOOP_ITERATIONS
from vkformers.engine.kernels.transformer_args import (
    checked, element_groups, element_variant, fits_uint32, operand, positive)


def _sizes(table, dim: int, count: int, vocab: int | None):
    positive(count=count, dim=dim)
    table = operand(table)
    vocab = table.available // dim if vocab is None else vocab
    positive(vocab=vocab)
    fits_uint32("embedding", max(count, vocab) * dim)
    return vocab


def embedding(seq, table, ids, out, *, count: int, dim: int, vocab: int | None = None):
    """out [count, dim] = table [vocab, dim] rows picked by ids int32 [count] (vocab defaults to what table holds)."""
    vocab = _sizes(table, dim, count, vocab)
    table = checked(table, ("float32", "float16", "bfloat16"), vocab * dim, "embedding table")
    ids = checked(ids, "int32", count, "embedding ids")
    out = checked(out, table.dtype.name, count * dim, "embedding out")
    kernel = seq.device.kernel("embedding", element_variant(table, "embedding table"))
    seq.dispatch(kernel, [ids.buffer, table.buffer, out.buffer], element_groups(seq, count * dim),
                 push=[count, dim, vocab, ids.offset, table.offset, out.offset, -1])


def embedding_backward(seq, d_out, ids, d_table, *, count: int, dim: int, vocab: int | None = None,
                       padding_idx: int | None = None):
    """d_table [vocab, dim] (float32) += d_out [count, dim] scattered by ids, except ids equal to padding_idx;
    accumulates."""
    vocab = _sizes(d_table, dim, count, vocab)
    d_table = checked(d_table, "float32", vocab * dim, "embedding d_table")
    ids = checked(ids, "int32", count, "embedding ids")
    d_out = checked(d_out, ("float32", "float16", "bfloat16"), count * dim, "embedding d_out")
    kernel = seq.device.kernel("embedding", "backward_" + element_variant(d_out, "embedding d_out"))
    step = LOOP_ITERATIONS - 1  # a loop of n trips costs n + 1 iterations
    for start in range(0, count, step):
        seq.dispatch(kernel, [ids.buffer, d_table.buffer, d_out.buffer], element_groups(seq, dim),
                     push=[min(step, count - start), dim, vocab, ids.offset + start, d_table.offset,
                           d_out.offset + start * dim, -1 if padding_idx is None else padding_idx])
