"""Picks along the last axis with one index table for every leading slice (take_along.comp).

forward: out [P, R, J] = x [P, R, C] at index int32 [R, J], one invocation per output element; backward: d_x
[P, R, C] from d_out [P, R, J], one invocation per row that zeroes it and adds the picks in order (each element sums
the picks that read it). An index outside [0, C) reads zero and passes no gradient.
"""
from __future__ import annotations

from vkformers.engine.kernels.transformer_args import (
    checked, element_groups, element_variant, fits_uint32, positive, same_dtype)


def _dispatch(seq, variant_prefix, src, index, dst, *, planes, rows, cols, picks, src_count, dst_count, what,
              invocations):
    positive(planes=planes, rows=rows, cols=cols, picks=picks)
    fits_uint32(what, planes * rows * max(cols, picks))
    src = checked(src, ("float32", "float16", "bfloat16"), src_count, f"{what} input")
    dst = checked(dst, src.dtype.name, dst_count, f"{what} output")
    same_dtype(src, {f"{what} output": dst}, what)
    index = checked(index, "int32", rows * picks, f"{what} index")
    kernel = seq.device.kernel("take_along", variant_prefix + element_variant(src, f"{what} input"))
    seq.dispatch(kernel, [index.buffer, src.buffer, dst.buffer], element_groups(seq, invocations),
                 push=[planes, rows, cols, picks, index.offset, src.offset, dst.offset])


def take_along(seq, x, index, out, *, planes: int, rows: int, cols: int, picks: int):
    """out [planes, rows, picks] = x [planes, rows, cols][..., index[rows, picks]]."""
    _dispatch(seq, "", x, index, out, planes=planes, rows=rows, cols=cols, picks=picks,
              src_count=planes * rows * cols, dst_count=planes * rows * picks, what="take_along",
              invocations=planes * rows * picks)


def take_along_backward(seq, d_out, index, d_x, *, planes: int, rows: int, cols: int, picks: int):
    """d_x [planes, rows, cols] = the sum of d_out [planes, rows, picks] over the picks that read each element
    (writes every element of d_x)."""
    _dispatch(seq, "backward_", d_out, index, d_x, planes=planes, rows=rows, cols=cols, picks=picks,
              src_count=planes * rows * picks, dst_count=planes * rows * cols, what="take_along backward",
              invocations=planes * rows)
