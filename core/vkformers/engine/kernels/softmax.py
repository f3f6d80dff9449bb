"""Launchers of softmax.comp: (log-)softmax over the last axis of contiguous
[rows, cols], forward and backward, numerically stable, computed in fp32.

Inputs and outputs are contiguous from their Operands' offsets, all of one dtype
(float32, float16 or bfloat16). A row gets as many threads as it has columns
(a power of two, up to a whole workgroup of 256), so short rows share a workgroup.
"""
from __future__ import annotations

from vkformers.engine.kernels import grid, operand, require_elements

WORKGROUP = 256  # local_size_x of softmax.comp
MODES = {"softmax": 0, "log_softmax": 1, "softmax_backward": 2, "log_softmax_backward": 3}
VARIANT_PREFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _launch(seq, mode: str, x, dy, out, rows: int, cols: int) -> None:
    x, dy, out = operand(x), operand(dy), operand(out)
    rows, cols = int(rows), int(cols)
    if rows < 0 or cols < 0:
        raise ValueError(f"{mode}: negative size rows={rows}, cols={cols}")
    if x.dtype.name not in VARIANT_PREFIX:
        raise TypeError(f"{mode}: dtype {x.dtype.name} is not supported (supported: {', '.join(VARIANT_PREFIX)})")
    if not x.dtype == dy.dtype == out.dtype:
        raise TypeError(f"{mode}: inputs and output must share a dtype, got "
                        f"{', '.join(sorted({x.dtype.name, dy.dtype.name, out.dtype.name}))}")
    count = rows * cols
    require_elements(x, count, f"{mode} {'input' if mode in ('softmax', 'log_softmax') else 'y'}")
    require_elements(dy, count, f"{mode} dy")
    require_elements(out, count, f"{mode} output")
    if count == 0:
        return
    parts = min(WORKGROUP, 1 << (cols - 1).bit_length())  # threads per row
    groups = grid(rows, WORKGROUP // parts, seq.device.limits["max_compute_work_group_count_x"])
    seq.dispatch(seq.device.kernel("softmax", VARIANT_PREFIX[x.dtype.name]), [x.buffer, dy.buffer, out.buffer],
                 groups, push=[rows, cols, x.offset, dy.offset, out.offset, parts.bit_length() - 1],
                 spec=[MODES[mode]])


def softmax(seq, x, out, *, rows: int, cols: int, log: bool = False) -> None:
    """out = softmax(x) (or log_softmax when ``log``) over the last axis of [rows, cols]."""
    _launch(seq, "log_softmax" if log else "softmax", x, x, out, rows, cols)


def softmax_backward(seq, y, dy, dx, *, rows: int, cols: int, log: bool = False) -> None:
    """dx from the forward output ``y`` and the gradient ``dy``:
    softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy)."""
    _launch(seq, "log_softmax_backward" if log else "softmax_backward", y, dy, dx, rows, cols)
