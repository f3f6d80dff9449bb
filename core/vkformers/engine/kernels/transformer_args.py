"""Argument checks shared by the transformer launchers (embedding, norm, rope, cross_entropy, adamw)."""
from __future__ import annotations

from vkformers.engine.kernels import Operand, grid, operand, require_elements

# Variant suffix of each activation storage type (the shaders' -DELEM_* variants).
ELEMENT_VARIANTS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
LOCAL_SIZE = 256  # every transformer kernel uses 256 invocations per workgroup


def element_variant(x: Operand, what: str) -> str:
    try:
        return ELEMENT_VARIANTS[x.dtype.name]
    except KeyError:
        raise TypeError(f"{what}: dtype {x.dtype.name} is not supported; use one of "
                        f"{', '.join(ELEMENT_VARIANTS)}") from None


def checked(x, dtype_names, count: int, what: str) -> Operand:
    """``x`` as an Operand, checked for dtype (a name or tuple of names) and for ``count`` elements."""
    x = operand(x)
    allowed = (dtype_names,) if isinstance(dtype_names, str) else tuple(dtype_names)
    if x.dtype.name not in allowed:
        raise TypeError(f"{what}: dtype must be {' or '.join(allowed)}, got {x.dtype.name}")
    if x.offset < 0:
        raise ValueError(f"{what}: negative offset {x.offset}")
    require_elements(x, count, what)
    return x


def same_dtype(first: Operand, others: dict, what: str) -> None:
    for name, x in others.items():
        if x is not None and x.dtype != first.dtype:
            raise TypeError(f"{what}: {name} is {x.dtype.name}, expected {first.dtype.name} like the input")


def positive(**sizes) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def fits_uint32(what: str, count: int) -> None:
    if count >= 1 << 32:
        raise ValueError(f"{what}: {count} elements do not fit the kernels' 32-bit indices")


def row_groups(seq, rows: int) -> tuple[int, int, int]:
    """One workgroup per row (transformer_common.glsl's workgroup_row())."""
    return grid(rows, 1, seq.device.limits["max_compute_work_group_count_x"])


def element_groups(seq, count: int) -> tuple[int, int, int]:
    """One invocation per element (common.glsl's global_index())."""
    return grid(count, LOCAL_SIZE, seq.device.limits["max_compute_work_group_count_x"])


def overlaps(a: Operand, a_count: int, b: Operand, b_count: int) -> bool:
    return a.buffer is b.buffer and a.offset < b.offset + b_count and b.offset < a.offset + a_count
