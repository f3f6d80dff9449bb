"""Launchers of the strided elementwise kernels: maps, activations (and their
backward), comparisons, ``where``, and the strided copy / dtype conversion.

Every tensor is a view: an :class:`Operand` (buffer + element offset), the
shape of the operation and the view's strides in elements (0 broadcasts; ``None``
means contiguous). The output is always contiguous row-major of ``shape`` from
its Operand's offset. Before dispatching, dims that are contiguous in every
operand are merged (and size-1 dims dropped), so most ops run as 1-D; at most
:data:`MAX_DIMS` dims may remain.

One dispatch has one storage dtype for its float inputs and output (the engine
casts mixed inputs first); comparisons write a ``bool`` mask (1 byte/element).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence as Seq

from vkformers.engine.kernels import Operand, grid, operand, require_elements
from vkformers.runtime import dtypes as dt

MAX_DIMS = 6       # shape/strides live in push constants: 30 words of the 32 every device offers
LOCAL_SIZE = 256   # local_size_x of elementwise.comp and copy_strided.comp


@dataclass(frozen=True)
class ElementwiseOp:
    """One op of elementwise.comp: its specialization-constant ``code`` (elementwise_ops.glsl)."""

    name: str
    code: int
    kind: str           # "unary", "binary" (incl. activation backward), "compare" or "where"
    scalars: int = 0    # scalar arguments of a unary op (push constants)
    int32: bool = False  # also defined on int32 storage


def _ops(*ops: ElementwiseOp) -> dict[str, ElementwiseOp]:
    table = {op.name: op for op in ops}
    assert len(table) == len(ops) and len({op.code for op in ops}) == len(ops), "duplicate op name or code"
    return table


# THE op table: every launcher reads it, and the test suite checks it against
# shaders/common/elementwise_ops.glsl and runs every entry.
OPS: dict[str, ElementwiseOp] = _ops(
    ElementwiseOp("neg", 0, "unary", int32=True),
    ElementwiseOp("exp", 1, "unary"),
    ElementwiseOp("log", 2, "unary"),
    ElementwiseOp("sqrt", 3, "unary"),
    ElementwiseOp("rsqrt", 4, "unary"),
    ElementwiseOp("abs", 5, "unary", int32=True),
    ElementwiseOp("tanh", 6, "unary"),
    ElementwiseOp("sigmoid", 7, "unary"),
    ElementwiseOp("relu", 8, "unary"),
    ElementwiseOp("gelu", 9, "unary"),             # exact (erf) gelu
    ElementwiseOp("gelu_tanh", 10, "unary"),
    ElementwiseOp("silu", 11, "unary"),
    ElementwiseOp("relu2", 12, "unary"),           # relu(x)^2
    ElementwiseOp("quick_gelu", 13, "unary"),      # x * sigmoid(1.702 x)
    ElementwiseOp("sin", 14, "unary"),
    ElementwiseOp("cos", 15, "unary"),
    ElementwiseOp("reciprocal", 16, "unary"),
    ElementwiseOp("square", 17, "unary", int32=True),
    ElementwiseOp("erf", 18, "unary"),
    ElementwiseOp("softplus", 19, "unary"),        # log(1 + e^x), x itself past 20 (torch's threshold)
    ElementwiseOp("add_scalar", 20, "unary", scalars=1, int32=True),   # x + s
    ElementwiseOp("mul_scalar", 21, "unary", scalars=1, int32=True),   # x * s
    ElementwiseOp("pow_scalar", 22, "unary", scalars=1),               # x ** s
    ElementwiseOp("clamp", 23, "unary", scalars=2, int32=True),        # min(max(x, lo), hi); NaN stays
    ElementwiseOp("rsub_scalar", 24, "unary", scalars=1, int32=True),  # s - x
    ElementwiseOp("add", 30, "binary", int32=True),
    ElementwiseOp("sub", 31, "binary", int32=True),
    ElementwiseOp("mul", 32, "binary", int32=True),
    ElementwiseOp("div", 33, "binary"),
    ElementwiseOp("pow", 34, "binary"),
    ElementwiseOp("maximum", 35, "binary", int32=True),  # NaN propagates, as torch.maximum
    ElementwiseOp("minimum", 36, "binary", int32=True),
    # activation backward: (x, dy) -> dx, except sigmoid/tanh: (y, dy) -> dx with y the forward output
    ElementwiseOp("relu_backward", 40, "binary"),
    ElementwiseOp("gelu_backward", 41, "binary"),
    ElementwiseOp("gelu_tanh_backward", 42, "binary"),
    ElementwiseOp("silu_backward", 43, "binary"),
    ElementwiseOp("sigmoid_backward", 44, "binary"),
    ElementwiseOp("tanh_backward", 45, "binary"),
    ElementwiseOp("relu2_backward", 46, "binary"),
    ElementwiseOp("quick_gelu_backward", 47, "binary"),
    ElementwiseOp("softplus_backward", 48, "binary"),
    ElementwiseOp("lt", 50, "compare", int32=True),
    ElementwiseOp("le", 51, "compare", int32=True),
    ElementwiseOp("gt", 52, "compare", int32=True),
    ElementwiseOp("ge", 53, "compare", int32=True),
    ElementwiseOp("eq", 54, "compare", int32=True),
    ElementwiseOp("ne", 55, "compare", int32=True),
    ElementwiseOp("where", 60, "where", int32=True),
)

# Storage dtype -> variant prefix of elementwise.comp.
VARIANT_PREFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32"}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
MASK_DTYPES = ("bool", "uint8")


# ---------------------------------------------------------------- views

def contiguous_strides(shape: Seq[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _check_view(what: str, x: Operand, strides, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The view's strides (contiguous when None), checked to stay inside its buffer."""
    strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise ValueError(f"{what}: {len(strides)} strides for a shape of {len(shape)} dims {shape}")
    if any(s < 0 for s in strides):
        raise ValueError(f"{what}: negative strides {strides} are not supported")
    if math.prod(shape) > 0:
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        require_elements(x, span, what)
    return strides


def coalesce(shape: Seq[int], strides_list: Seq[Seq[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous in every operand.

    Returns (shape, strides per operand) with at least one dim; the (contiguous)
    output merges wherever the inputs do.
    """
    dims = [(n, [s[d] for s in strides_list]) for d, n in enumerate(shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, strides in dims:
        if merged and all(outer == inner * n for outer, inner in zip(merged[-1][1], strides)):
            merged[-1] = (merged[-1][0] * n, strides)
        else:
            merged.append((n, strides))
    if not merged:
        merged = [(1, [0] * len(strides_list))]
    return [n for n, _ in merged], [[s[k] for _, s in merged] for k in range(len(strides_list))]


def _padded(values: Seq[int], fill: int = 0) -> list[int]:
    return list(values) + [fill] * (MAX_DIMS - len(values))


def _groups(seq, count: int) -> tuple[int, int, int]:
    return grid(count, LOCAL_SIZE, seq.device.limits["max_compute_work_group_count_x"])


# ---------------------------------------------------------------- elementwise

def _op(name: str, kinds: tuple[str, ...], launcher: str) -> ElementwiseOp:
    op = OPS.get(name)
    if op is None:
        raise ValueError(f"{launcher}: unknown elementwise op {name!r}; known: {', '.join(OPS)}")
    if op.kind not in kinds:
        raise ValueError(f"{launcher}: op {name!r} is a {op.kind} op; use "
                         f"{'binary' if op.kind == 'compare' else op.kind}() for it")
    return op


def _storage_dtype(op: ElementwiseOp, dtype: dt.DType, launcher: str) -> str:
    if dtype.name not in VARIANT_PREFIX:
        raise TypeError(f"{launcher} {op.name!r}: storage dtype {dtype.name} is not supported "
                        f"(supported: {', '.join(VARIANT_PREFIX)})")
    if dtype.name == "int32" and not op.int32:
        raise TypeError(f"{launcher} {op.name!r}: not defined on int32; cast to a float dtype first")
    return VARIANT_PREFIX[dtype.name]


def _dispatch(seq, launcher: str, op: ElementwiseOp, variant: str, shape, views, out: Operand,
              scalar_bits=(0, 0)) -> None:
    """Record one elementwise.comp dispatch. ``views``: (what, operand, strides) for a, b, mask."""
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"{launcher} {op.name!r}: negative size in shape {shape}")
    checked = [(x, _check_view(f"{launcher} {op.name!r} {what}", x, strides, shape)) for what, x, strides in views]
    count = math.prod(shape)
    require_elements(out, count, f"{launcher} {op.name!r} output")
    if count == 0:
        return
    dims, strides = coalesce(shape, [s for _, s in checked])
    if len(dims) > MAX_DIMS:
        raise ValueError(f"{launcher} {op.name!r}: shape {shape} with these strides needs {len(dims)} dims "
                         f"after merging contiguous ones; the kernel takes at most {MAX_DIMS}")
    (a, a_strides), (b, b_strides), (mask, mask_strides) = zip((x for x, _ in checked), strides)
    push = [*_padded(dims, 1), *_padded(a_strides), *_padded(b_strides), *_padded(mask_strides),
            a.offset, b.offset, mask.offset, out.offset, *scalar_bits]
    buffers = [a.buffer, b.buffer, mask.buffer, out.buffer]
    reads = (b.buffer if op.kind != "unary" else None, mask.buffer if launcher == "where" else None)
    if out.buffer.root is a.buffer.root and not any(x is not None and x.root is a.buffer.root for x in reads):
        # in place (the memory planner's choice): out over a, bound once; b and mask are other buffers
        row_major = [math.prod(dims[d + 1:]) for d in range(len(dims))]
        contiguous = all(s == c for s, c, n in zip(a_strides, row_major, dims) if n != 1)
        if out.buffer is not a.buffer or out.offset != a.offset or not contiguous:
            raise ValueError(f"{launcher} {op.name!r}: the output overlaps a without being a itself (contiguous)")
        buffers = [a.buffer, *(x or _placeholder(seq.device) for x in reads)]
        variant += "_inplace"
    kernel = seq.device.kernel("elementwise", variant)
    seq.dispatch(kernel, buffers, _groups(seq, count), push=push, spec=[op.code, len(dims)])


_placeholders: dict[int, object] = {}


def _placeholder(device):
    """A tiny buffer bound where the kernel reads nothing (b of a unary op, the mask but in where)."""
    if id(device) not in _placeholders:
        _placeholders[id(device)] = device.buffer(4, "uint32", name="elementwise placeholder")
    return _placeholders[id(device)]


def _scalar_bits(op: ElementwiseOp, dtype_name: str, scalars) -> list:
    scalars = tuple(scalars)
    if len(scalars) != op.scalars:
        raise ValueError(f"unary {op.name!r} takes {op.scalars} scalar(s), got {len(scalars)}: {scalars}")
    values = []
    for s in scalars:
        if dtype_name == "int32":
            if float(s) != int(s):
                raise TypeError(f"unary {op.name!r} on int32: scalar {s!r} is not an integer")
            if not -2**31 <= int(s) < 2**31:
                raise ValueError(f"unary {op.name!r} on int32: scalar {s!r} does not fit in int32")
            values.append(int(s))
        else:
            values.append(float(s))  # float32 bits in the push constants
    return values + [0] * (2 - len(values))


def unary(seq, op: str, x, x_strides, out, shape, *, scalars=()) -> None:
    """out = op(x[, scalars]) over ``shape``; ``x`` read with ``x_strides`` (None: contiguous).

    ``scalars``: (s,) for add_scalar, mul_scalar, pow_scalar, rsub_scalar; (lo, hi) for clamp.
    """
    spec = _op(op, ("unary",), "unary")
    x, out = operand(x), operand(out)
    if out.dtype != x.dtype:
        raise TypeError(f"unary {op!r}: output dtype {out.dtype.name} differs from input {x.dtype.name}")
    prefix = _storage_dtype(spec, x.dtype, "unary")
    bits = _scalar_bits(spec, x.dtype.name, scalars)
    _dispatch(seq, "unary", spec, prefix, shape, [("x", x, x_strides), ("x", x, x_strides), ("x", x, x_strides)],
              out, bits)


def binary(seq, op: str, a, a_strides, b, b_strides, out, shape) -> None:
    """out = op(a, b) over ``shape`` (binary, activation-backward and compare ops).

    Compare ops (lt, le, gt, ge, eq, ne) write ``out`` as a bool mask (1 byte/element).
    Activation backward ops take (x, dy), or (y, dy) for sigmoid_backward/tanh_backward.
    """
    spec = _op(op, ("binary", "compare"), "binary")
    a, b, out = operand(a), operand(b), operand(out)
    if a.dtype != b.dtype:
        raise TypeError(f"binary {op!r}: inputs have dtypes {a.dtype.name} and {b.dtype.name}; cast first")
    prefix = _storage_dtype(spec, a.dtype, "binary")
    if spec.kind == "compare":
        if out.dtype.name not in MASK_DTYPES:
            raise TypeError(f"binary {op!r}: a comparison writes a bool mask, not {out.dtype.name}")
        prefix += "_cmp"
    elif out.dtype != a.dtype:
        raise TypeError(f"binary {op!r}: output dtype {out.dtype.name} differs from inputs {a.dtype.name}")
    _dispatch(seq, "binary", spec, prefix, shape, [("a", a, a_strides), ("b", b, b_strides), ("a", a, a_strides)],
              out)


def where(seq, mask, mask_strides, a, a_strides, b, b_strides, out, shape) -> None:
    """out = mask ? a : b over ``shape``; ``mask`` is a bool (or uint8) buffer, nonzero = take a."""
    spec = OPS["where"]
    mask, a, b, out = operand(mask), operand(a), operand(b), operand(out)
    if mask.dtype.name not in MASK_DTYPES:
        raise TypeError(f"where: the mask must be bool, not {mask.dtype.name}")
    if not a.dtype == b.dtype == out.dtype:
        raise TypeError(f"where: a, b and out must share a dtype, got {a.dtype.name}, {b.dtype.name}, "
                        f"{out.dtype.name}")
    prefix = _storage_dtype(spec, a.dtype, "where")
    _dispatch(seq, "where", spec, prefix, shape,
              [("a", a, a_strides), ("b", b, b_strides), ("mask", mask, mask_strides)], out)


# ---------------------------------------------------------------- strided copy / conversion

# Raw copies of one element size, by dtype.
COPY_BITS_VARIANT = {"float32": "b32", "int32": "b32", "uint32": "b32", "float16": "b16",
                     "bfloat16": "b16", "bool": "b8", "uint8": "b8"}
COPY_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32", "bool": "bool"}
# (source, destination) conversions that copy_strided.comp compiles (its `//! variant` lines).
COPY_CONVERSIONS = frozenset(
    [(s, d) for s in FLOAT_DTYPES for d in FLOAT_DTYPES if s != d]
    + [(s, d) for s in FLOAT_DTYPES for d in ("int32", "bool")]
    + [(s, d) for s in ("int32", "bool") for d in FLOAT_DTYPES]
    + [("int32", "bool"), ("bool", "int32")]
)


def copy_variant(src: str, dst: str) -> str:
    if src == dst or {src, dst} <= {"bool", "uint8"}:
        return COPY_BITS_VARIANT[src]
    if (src, dst) in COPY_CONVERSIONS:
        return f"{COPY_SHORT[src]}_{COPY_SHORT[dst]}"
    raise TypeError(f"copy_strided: no conversion from {src} to {dst}; supported: same dtype, or "
                    + ", ".join(f"{s}->{d}" for s, d in sorted(COPY_CONVERSIONS)))


def copy_strided(seq, x, x_strides, out, shape, out_strides=None, write_group=None) -> None:
    """out (contiguous ``shape``, or written through ``out_strides``) = x read with ``x_strides`` (None:
    contiguous), converting the dtype when ``out``'s differs: between float32/float16/bfloat16, float <-> int32
    (truncation toward zero), and to/from bool (nonzero -> 1). ``write_group``: Sequence.dispatch's (copies
    into disjoint parts of one output, as a concatenation's)."""
    x, out = operand(x), operand(out)
    variant = copy_variant(x.dtype.name, out.dtype.name)
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"copy_strided: negative size in shape {shape}")
    strides = _check_view("copy_strided input", x, x_strides, shape)
    count = math.prod(shape)
    out_view = _check_view("copy_strided output", out, out_strides, shape)
    if count == 0:
        return
    dims, (x_dims_strides, out_dims_strides) = coalesce(shape, [strides, out_view])
    if len(dims) > MAX_DIMS:
        raise ValueError(f"copy_strided: shape {shape} with strides {strides} needs {len(dims)} dims after "
                         f"merging contiguous ones; the kernel takes at most {MAX_DIMS}")
    strided_out = out_dims_strides != list(contiguous_strides(dims))
    push = [*_padded(dims, 1), *_padded(x_dims_strides), x.offset, out.offset, *_padded(out_dims_strides)]
    seq.dispatch(seq.device.kernel("copy_strided", variant), [x.buffer, out.buffer], _groups(seq, count),
                 push=push, spec=[len(dims), int(strided_out)], write_group=write_group)
