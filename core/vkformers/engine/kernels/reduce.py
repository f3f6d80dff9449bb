"""Launcher of reduce.comp: sum, mean, max, min, argmax, argmin over one axis.

The input is contiguous from its Operand's offset, viewed as [outer, axis_len,
inner] (reduce over a middle axis: outer = prod(dims before), inner = prod(dims
after)); the output is contiguous [outer, inner] from its offset. Values
accumulate in fp32 and are stored in the input's dtype; argmax/argmin write int32
indices along the axis (first occurrence on ties; NaN counts as the extreme).
"""
from __future__ import annotations

from vkformers.engine.kernels import grid, operand, require_elements

WORKGROUP = 256        # local_size_x of reduce.comp
MIN_LANES_STRIDED = 32  # inner > 1: at least this many neighbouring outputs per workgroup (contiguous reads)

# op name -> specialization-constant code (REDUCE_* in reduce.comp)
REDUCE_OPS = {"sum": 0, "mean": 1, "max": 2, "min": 3, "argmax": 4, "argmin": 5}
INDEX_OPS = ("argmax", "argmin")
VARIANT_PREFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def reduce(seq, op: str, x, out, *, outer: int, axis_len: int, inner: int = 1) -> None:
    """out[o, c] = op over j of x[o, j, c]; ``out`` has the input's dtype, or int32 for arg ops."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce: unknown op {op!r}; known: {', '.join(REDUCE_OPS)}")
    x, out = operand(x), operand(out)
    outer, axis_len, inner = int(outer), int(axis_len), int(inner)
    if outer < 0 or axis_len < 0 or inner < 0:
        raise ValueError(f"reduce {op!r}: negative size in outer={outer}, axis_len={axis_len}, inner={inner}")
    if x.dtype.name not in VARIANT_PREFIX:
        raise TypeError(f"reduce {op!r}: input dtype {x.dtype.name} is not supported "
                        f"(supported: {', '.join(VARIANT_PREFIX)})")
    expected_out = "int32" if op in INDEX_OPS else x.dtype.name
    if out.dtype.name != expected_out:
        raise TypeError(f"reduce {op!r}: output must be {expected_out}, not {out.dtype.name}")
    if axis_len == 0 and op not in ("sum", "mean") and outer * inner > 0:
        raise ValueError(f"reduce {op!r}: the reduced axis is empty")
    require_elements(x, outer * axis_len * inner, f"reduce {op!r} input")
    require_elements(out, outer * inner, f"reduce {op!r} output")
    if outer * inner == 0:
        return

    lanes, parts_fastest = _layout(axis_len, inner)
    variant = VARIANT_PREFIX[x.dtype.name] + ("_index" if op in INDEX_OPS else "")
    groups = grid(outer * inner, lanes, seq.device.limits["max_compute_work_group_count_x"])
    seq.dispatch(seq.device.kernel("reduce", variant), [x.buffer, out.buffer], groups,
                 push=[outer, axis_len, inner, x.offset, out.offset, lanes.bit_length() - 1, int(parts_fastest)],
                 spec=[REDUCE_OPS[op]])


def _layout(axis_len: int, inner: int) -> tuple[int, bool]:
    """(outputs per workgroup, whether a lane's threads sit side by side) for reduce.comp.

    Each output gets about as many threads as its axis has elements (a power of two,
    up to the whole workgroup); with inner > 1 at least 32 outputs share a workgroup so
    that its threads read neighbouring elements along the inner axis.
    """
    parts = min(WORKGROUP, 1 << max(0, axis_len - 1).bit_length())
    if inner > 1:
        parts = min(parts, WORKGROUP // MIN_LANES_STRIDED)
    return WORKGROUP // parts, inner == 1
