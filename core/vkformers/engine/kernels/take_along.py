"""Picks along the last axis with one index table for every leading slice (take_along.comp).

forward: out [P, R, J] = x [P, R, C] at index int32 [R, J], one invocation per output element; backward: d_x
[P, R, C] from d_out [P, R, J]: zeroed one invocation per element, then one invocation per row adds the picks in
order (each element sums the picks that read it), in dispatches of at most LOOP_ITERATIONS - 1 picks run one after
another (llvmpipe's loop bound). An index outside [0, C) reads zero and passes no gradient.
"""
from __future__ import annotations

from vkformers.engine.kernels import LOOP_ITERATIONS
from vkformers.engine.kernels.transformer_args import (
    checked, element_groups, element_variant, fits_uint32, positive, same_dtype)


def _checked(src, index, dst, *, planes, rows, cols, picks, src_count, dst_count, what):
    positive(planes=planes, rows=rows, cols=cols, picks=picks)
    fits_uint32(what, planes * rows * max(cols, picks))
    src = checked(src, ("float32", "float16", "bfloat16"), src_count, f"{what} input")
    dst = checked(dst, src.dtype.name, dst_count, f"{what} output")
    same_dtype(src, {f"{what} output": dst}, what)
    index = checked(index, "int32", rows * picks, f"{what} index")
    return src, index, dst, element_variant(src, f"{what} input")


def take_along(seq, x, index, out, *, planes: int, rows: int, cols: int, picks: int):
    """out [planes, rows, picks] = x [planes, rows, cols][..., index[rows, picks]]."""
    x, index, out, variant = _checked(x, index, out, planes=planes, rows=rows, cols=cols, picks=picks,
                                      src_count=planes * rows * cols, dst_count=planes * rows * picks,
                                      what="take_along")
    seq.dispatch(seq.device.kernel("take_along", variant), [index.buffer, x.buffer, out.buffer],
                 element_groups(seq, planes * rows * picks),
                 push=[planes, rows, cols, picks, index.offset, x.offset, out.offset, 0, 0])


def take_along_backward(seq, d_out, index, d_x, *, planes: int, rows: int, cols: int, picks: int):
    """d_x [planes, rows, cols] = the sum of d_out [planes, rows, picks] over the picks that read each element
    (writes every element of d_x)."""
    d_out, index, d_x, variant = _checked(d_out, index, d_x, planes=planes, rows=rows, cols=cols, picks=picks,
                                          src_count=planes * rows * picks, dst_count=planes * rows * cols,
                                          what="take_along backward")
    buffers = [index.buffer, d_out.buffer, d_x.buffer]
    push = [planes, rows, cols, picks, index.offset, d_out.offset, d_x.offset]
    seq.dispatch(seq.device.kernel("take_along", "zero_" + variant), buffers,
                 element_groups(seq, planes * rows * cols), push=push + [0, 0])
    step = LOOP_ITERATIONS - 1  # a loop of n trips costs n + 1 iterations
    kernel = seq.device.kernel("take_along", "backward_" + variant)
    for begin in range(0, picks, step):
        seq.dispatch(kernel, buffers, element_groups(seq, planes * rows),
                     push=push + [begin, min(begin + step, picks)])
