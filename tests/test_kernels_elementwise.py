"""Elementwise kernels (maps, activations and their backward, comparisons, where),
the strided copy / dtype conversion, and dropout, against float64 numpy references.

Tolerances (float64 reference computed from the exact stored inputs, then compared
with the stored output):
- float32: ops whose fp32 result is correctly rounded (neg, abs, relu, add, sub,
  mul, maximum, minimum, square, relu2, clamp, *_scalar but pow, relu(2)_backward,
  compare, where) must be bit-exact; others 1e-6 relative, plus an absolute 1e-6
  where rounding the argument of exp/erf (gelu, silu, ... tails) or a cancellation
  (1 - y^2) is amplified, and 2e-7 for sin/cos near their zeros.
- float16: 1 fp16 ulp of the result (relative 2e-3, absolute 1e-6).
- bfloat16: 1 bf16 ulp of the result (relative 1.6e-2, absolute 1e-6).
- int32: exact.
"""
from __future__ import annotations

import math
import re
import zlib
from pathlib import Path

import numpy as np
import pytest

from vkformers.engine.kernels import Operand
from vkformers.engine.kernels import dropout as dropout_kernels
from vkformers.engine.kernels import elementwise as ew
from vkformers.runtime.dtypes import from_bfloat16, to_bfloat16

SHADERS = Path(__file__).resolve().parent.parent / "shaders" / "common"
FLOATS = ("float32", "float16", "bfloat16")
ERF = np.vectorize(math.erf, otypes=[np.float64])
ERFC = np.vectorize(math.erfc, otypes=[np.float64])
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


# ---------------------------------------------------------------- helpers

def stored(x, dtype: str) -> np.ndarray:
    """The values a buffer of ``dtype`` holds for ``x``, as float64 (int32/bool as int64)."""
    x = np.asarray(x)
    if dtype == "float32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 is inf, as on the device
            return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return from_bfloat16(to_bfloat16(x.astype(np.float32))).astype(np.float64)
    if dtype == "int32":
        return x.astype(np.int32).astype(np.int64)
    if dtype == "bool":
        return (x != 0).astype(np.int64)
    raise ValueError(dtype)


def upload(device, x, dtype: str):
    x = np.asarray(x)
    if dtype == "bfloat16":
        return device.upload(to_bfloat16(x.astype(np.float32)), dtype="bfloat16")
    if dtype == "bool":
        return device.upload((x != 0).astype(np.uint8), dtype="bool")
    return device.upload(x.astype({"float32": np.float32, "float16": np.float16, "int32": np.int32,
                                   "uint32": np.uint32}[dtype]))


def download(buf) -> np.ndarray:
    data = buf.read()
    if buf.dtype.name == "bfloat16":
        return from_bfloat16(data).astype(np.float64)
    return data.astype(np.float64) if buf.dtype.name in FLOATS else data.astype(np.int64)


def storage_tolerance(dtype: str) -> tuple[float, float]:
    return {"float16": (2e-3, 1e-6), "bfloat16": (1.6e-2, 1e-6)}[dtype]


def sigmoid(v):
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-v))


def gelu_tanh_ref(v):
    return v * sigmoid(2 * SQRT_2_OVER_PI * (v + 0.044715 * v**3))


# ---------------------------------------------------------------- references of every op

UNARY = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda v: 1 / np.sqrt(v),
    "abs": np.abs, "tanh": np.tanh, "sigmoid": sigmoid, "relu": lambda v: np.maximum(v, 0),
    "gelu": lambda v: 0.5 * v * ERFC(-v / math.sqrt(2)), "gelu_tanh": gelu_tanh_ref,
    "silu": lambda v: v * sigmoid(v), "relu2": lambda v: np.maximum(v, 0) ** 2,
    "quick_gelu": lambda v: v * sigmoid(1.702 * v), "sin": np.sin, "cos": np.cos,
    "reciprocal": lambda v: 1 / v, "square": np.square, "erf": ERF,
    "softplus": lambda v: np.where(v > 20, v, np.logaddexp(0, v)),
}
SCALAR_ARGS = {"add_scalar": (1.25,), "mul_scalar": (-0.75,), "pow_scalar": (2.5,), "clamp": (-0.5, 0.75),
               "rsub_scalar": (2.5,)}
SCALAR = {
    "add_scalar": lambda v, s: v + s, "mul_scalar": lambda v, s: v * s, "pow_scalar": lambda v, s: v**s,
    "clamp": lambda v, lo, hi: np.clip(v, lo, hi), "rsub_scalar": lambda v, s: s - v,
}


def gelu_grad(x):
    return 0.5 * ERFC(-x / math.sqrt(2)) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def gelu_tanh_grad(x):
    s = sigmoid(2 * SQRT_2_OVER_PI * (x + 0.044715 * x**3))
    return s + 2 * x * s * (1 - s) * SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)


BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "maximum": np.maximum, "minimum": np.minimum,
    "relu_backward": lambda x, dy: dy * (x > 0),
    "gelu_backward": lambda x, dy: dy * gelu_grad(x),
    "gelu_tanh_backward": lambda x, dy: dy * gelu_tanh_grad(x),
    "silu_backward": lambda x, dy: dy * sigmoid(x) * (1 + x * (1 - sigmoid(x))),
    "sigmoid_backward": lambda y, dy: dy * y * (1 - y),
    "tanh_backward": lambda y, dy: dy * (1 - y * y),
    "relu2_backward": lambda x, dy: dy * 2 * np.maximum(x, 0),
    "quick_gelu_backward": lambda x, dy: dy * (sigmoid(1.702 * x) + 1.702 * x * sigmoid(1.702 * x)
                                               * (1 - sigmoid(1.702 * x))),
    "softplus_backward": lambda x, dy: dy * np.where(x > 20, 1.0, sigmoid(x)),
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal,
}
# Forward functions of the backward ops, to check the references above by finite differences.
FORWARD_OF = {"relu_backward": "relu", "gelu_backward": "gelu", "gelu_tanh_backward": "gelu_tanh",
              "silu_backward": "silu", "relu2_backward": "relu2", "quick_gelu_backward": "quick_gelu",
              "softplus_backward": "softplus"}

EXACT_F32 = {"neg", "abs", "relu", "add", "sub", "mul", "maximum", "minimum", "square", "relu2", "clamp",
             "add_scalar", "mul_scalar", "rsub_scalar", "relu_backward", "relu2_backward"}
AMPLIFIED_F32 = {"gelu", "gelu_tanh", "silu", "quick_gelu", "gelu_backward", "gelu_tanh_backward",
                 "silu_backward", "quick_gelu_backward", "sigmoid_backward", "tanh_backward", "softplus_backward"}


def f32_tolerance(op: str) -> tuple[float, float]:
    if op in EXACT_F32:
        return 0.0, 0.0
    if op in AMPLIFIED_F32:
        return 1e-6, 1e-6
    if op in ("sin", "cos"):
        return 1e-6, 2e-7
    if op in ("pow", "pow_scalar"):
        return 2e-6, 1e-30
    return 1e-6, 1e-30


def unary_input(op: str, rng, n: int = 3001) -> np.ndarray:
    if op in ("log", "sqrt", "rsqrt"):
        return np.concatenate([np.exp(rng.uniform(-20, 20, n)), [1.0, 0.5, 2.0, 1 + 2**-20]])
    if op == "pow_scalar":
        return rng.uniform(0.01, 10, n)
    if op == "reciprocal":
        return rng.choice([-1, 1], n) * np.exp(rng.uniform(-8, 8, n))
    if op == "exp":
        return np.concatenate([rng.uniform(-80, 80, n), [0.0, -0.0, 88.0, -100.0]])
    if op in ("sin", "cos"):
        return np.concatenate([rng.uniform(-10, 10, n), rng.uniform(-2e4, 2e4, 200), [0.0, np.pi / 2]])
    # activations: dense around 0 and the tails out to +-10
    return np.concatenate([rng.uniform(-10, 10, n), rng.uniform(-1, 1, 1000), [0.0, -0.0, 1e-30, -1e-30]])


def binary_inputs(op: str, rng, n: int = 3001) -> tuple[np.ndarray, np.ndarray]:
    a, b = rng.uniform(-6, 6, n), rng.uniform(-6, 6, n)
    if op == "div":
        b = rng.choice([-1, 1], n) * rng.uniform(0.1, 4, n)
    elif op == "pow":
        a, b = rng.uniform(0.05, 8, n), rng.uniform(-3, 3, n)
        a[:20], b[:20] = -rng.uniform(0.5, 3, 20), np.arange(-10, 10)  # negative bases, integer exponents
    elif op in ("sigmoid_backward",):
        a = rng.uniform(0, 1, n)
    elif op == "tanh_backward":
        a = rng.uniform(-1, 1, n)
    elif op in ("lt", "le", "gt", "ge", "eq", "ne", "maximum", "minimum"):
        a, b = rng.integers(-3, 4, n) * 0.5, rng.integers(-3, 4, n) * 0.5  # many ties
    return a, b


def check_close(got, ref, dtype: str, op: str):
    ref = np.asarray(ref, np.float64)
    if dtype == "float32":
        rtol, atol = f32_tolerance(op)
        expected = ref.astype(np.float32).astype(np.float64)
        if rtol == 0:
            np.testing.assert_array_equal(got, expected, err_msg=f"{op} float32 (exact)")
            return
    else:
        rtol, atol = storage_tolerance(dtype)
        expected = ref
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"{op} {dtype}")


def run(device, build):
    device.run(build)


# ---------------------------------------------------------------- the op table

def test_op_table_matches_the_shader_defines():
    text = (SHADERS / "elementwise_ops.glsl").read_text()
    defines = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define OP_(\w+) (\d+)", text)
               if not m.group(1).startswith("FIRST_")}
    assert defines == {name: op.code for name, op in ew.OPS.items()}
    # The shader's kind boundaries agree with the table's kinds.
    first_scalar = int(re.search(r"#define OP_FIRST_SCALAR (\d+)", text).group(1))
    first_binary = int(re.search(r"#define OP_FIRST_BINARY (\d+)", text).group(1))
    for op in ew.OPS.values():
        assert (op.code >= first_binary) == (op.kind != "unary"), op.name
        assert (first_scalar <= op.code < first_binary) == (op.scalars > 0), op.name


def test_every_table_op_has_a_reference_here():
    assert set(ew.OPS) == set(UNARY) | set(SCALAR) | set(BINARY) | {"where"}


@pytest.mark.parametrize("op", sorted(FORWARD_OF))
def test_backward_references_are_derivatives(op):
    x = np.linspace(-6, 6, 241) + 0.013
    h = 1e-6
    forward = UNARY[FORWARD_OF[op]]
    numeric = (forward(x + h) - forward(x - h)) / (2 * h)
    np.testing.assert_allclose(BINARY[op](x, np.ones_like(x)), numeric, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- every op, every dtype

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(UNARY) + sorted(SCALAR))
def test_unary_op(device, op, dtype):
    rng = np.random.default_rng(zlib.crc32(op.encode()))
    x = unary_input(op, rng)
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
        if op in ("log", "sqrt", "rsqrt"):
            x = np.clip(x, 1e-4, 6e4)
        if op == "exp":
            x = np.clip(x, -11, 11)
        if op == "reciprocal":
            x = np.where(np.abs(x) < 1e-4, 1.0, x)
    x = stored(x, dtype)
    scalars = SCALAR_ARGS.get(op, ())
    xb, out = upload(device, x, dtype), device.buffer(x.shape, dtype)
    run(device, lambda s: ew.unary(s, op, xb, None, out, x.shape, scalars=scalars))
    with np.errstate(all="ignore"):
        ref = SCALAR[op](x, *scalars) if op in SCALAR else UNARY[op](x)
    check_close(download(out), ref, dtype, op)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_op(device, op, dtype):
    rng = np.random.default_rng(zlib.crc32(op.encode()))
    a, b = (stored(v, dtype) for v in binary_inputs(op, rng))
    compare = ew.OPS[op].kind == "compare"
    ab, bb = upload(device, a, dtype), upload(device, b, dtype)
    out = device.buffer(a.shape, "bool" if compare else dtype)
    run(device, lambda s: ew.binary(s, op, ab, None, bb, None, out, a.shape))
    with np.errstate(all="ignore"):
        ref = BINARY[op](a, b)
    if compare:
        np.testing.assert_array_equal(download(out), ref.astype(np.int64), err_msg=f"{op} {dtype}")
    else:
        check_close(download(out), ref, dtype, op)


INT_REFS = {**{k: v for k, v in UNARY.items() if k in ("neg", "abs", "square")},
            "add_scalar": lambda v: v + 7, "mul_scalar": lambda v: v * -3, "clamp": lambda v: np.clip(v, -5, 9),
            "rsub_scalar": lambda v: 4 - v}
INT_SCALARS = {"add_scalar": (7,), "mul_scalar": (-3,), "clamp": (-5, 9), "rsub_scalar": (4,)}


@pytest.mark.parametrize("op", [name for name, op in ew.OPS.items() if op.int32 and op.kind != "where"])
def test_int32_op(device, op):
    rng = np.random.default_rng(1)
    a, b = rng.integers(-40000, 40000, 999), rng.integers(-6, 7, 999)
    ab, bb = upload(device, a, "int32"), upload(device, b, "int32")
    kind = ew.OPS[op].kind
    out = device.buffer(a.shape, "bool" if kind == "compare" else "int32")
    if kind == "unary":
        run(device, lambda s: ew.unary(s, op, ab, None, out, a.shape, scalars=INT_SCALARS.get(op, ())))
        ref = INT_REFS[op](a)
    else:
        run(device, lambda s: ew.binary(s, op, ab, None, bb, None, out, a.shape))
        ref = BINARY[op](a, b)
    np.testing.assert_array_equal(download(out), np.asarray(ref).astype(np.int64))


@pytest.mark.parametrize("dtype", [*FLOATS, "int32"])
def test_where(device, dtype):
    rng = np.random.default_rng(2)
    mask, a, b = rng.integers(0, 2, (4, 5)), rng.integers(-50, 50, (4, 5)), rng.integers(-50, 50, (1, 5))
    mb, ab, bb = upload(device, mask, "bool"), upload(device, a, dtype), upload(device, b, dtype)
    out = device.buffer((4, 5), dtype)
    run(device, lambda s: ew.where(s, mb, None, ab, None, bb, (0, 1), out, (4, 5)))
    np.testing.assert_array_equal(download(out), np.where(mask != 0, a, b))


def test_gelu_matches_exact_gelu_within_1e_6_absolute(device):
    x = np.linspace(-10, 10, 200001).astype(np.float32)
    xb, out = device.upload(x), device.buffer(x.shape)
    run(device, lambda s: ew.unary(s, "gelu", xb, None, out, x.shape))
    x64 = x.astype(np.float64)
    ref = 0.5 * x64 * ERFC(-x64 / math.sqrt(2))
    assert np.max(np.abs(out.read() - ref)) < 1e-6
    erf_out = device.buffer(x.shape)
    run(device, lambda s: ew.unary(s, "erf", xb, None, erf_out, x.shape))
    y, r = erf_out.read().astype(np.float64), ERF(x64)
    assert np.max(np.abs(y - r) / np.maximum(np.abs(r), 1e-30)) < 3e-7


def test_special_values(device):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 100.0, -100.0], np.float32)
    xb = device.upload(x)
    results = {}
    for op in ("exp", "tanh", "sigmoid", "relu", "gelu", "silu", "erf", "log"):
        out = device.buffer(x.shape)
        run(device, lambda s: ew.unary(s, op, xb, None, out, x.shape))
        results[op] = out.read()
    nan = np.nan
    np.testing.assert_allclose(results["exp"], [np.inf, 0, nan, 1, 1, np.inf, 3.78e-44], atol=1e-38)
    np.testing.assert_array_equal(results["tanh"], [1, -1, nan, 0, 0, 1, -1])
    np.testing.assert_array_equal(results["sigmoid"], [1, 0, nan, 0.5, 0.5, 1, 0])
    np.testing.assert_array_equal(results["relu"], [np.inf, 0, nan, 0, 0, 100, 0])
    np.testing.assert_array_equal(results["erf"], [1, -1, nan, 0, 0, 1, -1])
    np.testing.assert_array_equal(results["log"][[0, 2, 3]], [np.inf, nan, -np.inf])
    assert np.isnan(results["log"][1])
    np.testing.assert_array_equal(results["gelu"][[2, 3, 5, 6]], [nan, 0, 100, 0])
    np.testing.assert_array_equal(results["silu"][[2, 3, 5]], [nan, 0, 100])


# ---------------------------------------------------------------- views: broadcasting, strides, offsets

def _binary_view(device, op, a_base, a_offset, a_strides, b_base, b_offset, b_strides, shape, dtype="float32"):
    ab, bb = upload(device, a_base, dtype), upload(device, b_base, dtype)
    compare = ew.OPS[op].kind == "compare"
    out = device.buffer((max(1, math.prod(shape)),), "bool" if compare else dtype)
    run(device, lambda s: ew.binary(s, op, Operand(ab, a_offset), a_strides, Operand(bb, b_offset), b_strides,
                                    out, shape))
    return download(out)[: math.prod(shape)].reshape(shape)


def _view(base, offset, strides, shape):
    base = np.asarray(base, np.float64).reshape(-1)
    return np.lib.stride_tricks.as_strided(base[offset:], shape=shape, strides=[s * 8 for s in strides])


@pytest.mark.parametrize("case", [
    # (a shape, a strides, b shape, b strides, out shape) with stride 0 = broadcast
    ("3x1x5 with 1x4x5", (3, 1, 5), (5, 0, 1), (1, 4, 5), (0, 5, 1), (3, 4, 5)),
    ("row and column vectors", (1, 5), (0, 1), (4, 1), (1, 0), (4, 5)),
    ("tensor and 0-d scalar", (6, 7), (7, 1), (), (0, 0), (6, 7)),
    ("size-1 dims and odd sizes", (1, 7, 1, 3), (21, 3, 3, 1), (1, 7, 1, 3), (21, 3, 3, 1), (1, 7, 1, 3)),
])
@pytest.mark.parametrize("op", ["add", "mul", "gelu_backward", "lt"])
def test_broadcasting(device, case, op):
    _, a_shape, a_strides, b_shape, b_strides, shape = case
    rng = np.random.default_rng(3)
    a, b = rng.integers(-8, 8, a_shape) * 0.25, rng.integers(-8, 8, b_shape) * 0.25
    got = _binary_view(device, op, a, 0, a_strides, b, 0, b_strides, shape)
    ref = BINARY[op](np.broadcast_to(a, shape), np.broadcast_to(b, shape))
    if ew.OPS[op].kind == "compare":
        np.testing.assert_array_equal(got, ref)
    else:
        check_close(got, ref, "float32", op)


@pytest.mark.parametrize("dtype", [*FLOATS, "int32"])
def test_transposed_and_sliced_inputs_with_offsets(device, dtype):
    rng = np.random.default_rng(4)
    a_base, b_base = rng.integers(-100, 100, 5 * 4 + 3), rng.integers(-100, 100, 6 * 7)
    # a: a [5, 4] matrix at offset 3, transposed -> [4, 5]; b: rows 1:5, columns 2:7:2 of [6, 7] -> [4, 3]
    a_view = _view(a_base, 3, (1, 4), (4, 5))
    got = _binary_view(device, "sub", a_base, 3, (1, 4), a_base, 3, (5, 1), (4, 5), dtype)
    np.testing.assert_array_equal(got, stored(a_view - _view(a_base, 3, (5, 1), (4, 5)), dtype))
    got = _binary_view(device, "mul", b_base, 9, (7, 2), a_base, 3, (1, 4), (4, 3), dtype)
    np.testing.assert_array_equal(got, stored(_view(b_base, 9, (7, 2), (4, 3)) * _view(a_base, 3, (1, 4), (4, 3)),
                                              dtype))


def test_six_dims_that_do_not_merge(device):
    shape = (2, 3, 2, 3, 2, 3)
    rng = np.random.default_rng(5)
    base = rng.uniform(-1, 1, shape)
    permuted = base.transpose(5, 4, 3, 2, 1, 0)  # its strides merge nowhere
    strides = [s // 8 for s in permuted.strides]
    x = device.upload(base.astype(np.float32))
    out = device.buffer(permuted.shape)
    run(device, lambda s: ew.unary(s, "neg", x, strides, out, permuted.shape))
    np.testing.assert_array_equal(out.read(), -permuted.astype(np.float32))
    with pytest.raises(ValueError, match="at most 6"):
        seven = (2, 2, 2, 2, 2, 2, 2)
        y = device.buffer(128)
        device.run(lambda s: ew.unary(s, "neg", y, [1, 2, 4, 8, 16, 32, 64], device.buffer(128), seven))


def test_coalesce_merges_contiguous_dims():
    assert ew.coalesce((2, 3, 4), [(12, 4, 1), (0, 0, 0)]) == ([24], [[1], [0]])
    assert ew.coalesce((2, 3, 4), [(12, 4, 1), (4, 0, 1)]) == ([2, 3, 4], [[12, 4, 1], [4, 0, 1]])
    assert ew.coalesce((1, 5, 1), [(5, 1, 1)]) == ([5], [[1]])
    assert ew.coalesce((), [()]) == ([1], [[0]])


def test_zero_d_one_element_and_empty(device):
    x = device.upload(np.array([3.0], np.float32))
    out = device.buffer(1)
    run(device, lambda s: ew.unary(s, "square", x, (), out, ()))
    assert out.read()[0] == 9.0
    seq = device.sequence()
    ew.unary(seq, "exp", x, None, out, (0, 5))  # nothing to do: no dispatch recorded
    assert seq._ops == []


def test_in_place(device):
    x0 = np.arange(10, dtype=np.float32)
    x = device.upload(x0)
    run(device, lambda s: ew.binary(s, "add", x, None, x, None, x, (10,)))
    np.testing.assert_array_equal(x.read(), 2 * x0)


def test_large_1d_uses_the_2d_grid(device):
    n = 65535 * 256 + 4097  # more invocations than one row of workgroups holds
    x = device.upload(np.full(n, 1.5, np.float16))
    out = device.buffer(n, "float16")
    run(device, lambda s: ew.unary(s, "add_scalar", x, None, out, (n,), scalars=(0.25,)))
    assert np.all(out.read() == 1.75)


# ---------------------------------------------------------------- argument checks

def test_launcher_errors(device):
    x = device.upload(np.zeros(12, np.float32))
    out = device.buffer(12)
    seq = device.sequence()
    with pytest.raises(ValueError, match="unknown elementwise op 'softsign'"):
        ew.unary(seq, "softsign", x, None, out, (12,))
    with pytest.raises(ValueError, match="binary op"):
        ew.unary(seq, "add", x, None, out, (12,))
    with pytest.raises(ValueError, match="takes 2 scalar"):
        ew.unary(seq, "clamp", x, None, out, (12,), scalars=(1.0,))
    with pytest.raises(ValueError, match="needs 13 elements"):
        ew.unary(seq, "exp", x, (5, 1), out, (3, 3))
    with pytest.raises(ValueError, match="output: needs 12 elements"):
        ew.unary(seq, "exp", x, None, Operand(out, 1), (12,))
    with pytest.raises(ValueError, match="2 strides for a shape of 1"):
        ew.unary(seq, "exp", x, (1, 1), out, (12,))
    with pytest.raises(TypeError, match="not defined on int32"):
        xi = device.upload(np.zeros(12, np.int32))
        ew.unary(seq, "exp", xi, None, device.buffer(12, "int32"), (12,))
    with pytest.raises(TypeError, match="bool mask"):
        ew.binary(seq, "lt", x, None, x, None, out, (12,))
    with pytest.raises(TypeError, match="cast first"):
        ew.binary(seq, "add", x, None, device.buffer(12, "float16"), None, out, (12,))
    with pytest.raises(TypeError, match="no conversion from float32 to uint32"):
        ew.copy_strided(seq, x, None, device.buffer(12, "uint32"), (12,))
    assert seq._ops == []


# ---------------------------------------------------------------- strided copy and conversion

@pytest.mark.parametrize("dtype", [*FLOATS, "int32", "bool", "uint32"])
def test_copy_strided_makes_views_contiguous(device, dtype):
    rng = np.random.default_rng(6)
    base = rng.integers(0, 3, 3 * 5 * 7 + 2)
    view = _view(base, 2, (1, 21, 3), (3, 5, 7))  # a permuted view at offset 2
    x, out = upload(device, base, dtype), device.buffer((3, 5, 7), dtype)
    run(device, lambda s: ew.copy_strided(s, Operand(x, 2), (1, 21, 3), out, (3, 5, 7)))
    np.testing.assert_array_equal(download(out), stored(view, dtype) if dtype != "uint32" else view)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copy_strided_writes_through_output_strides(device, dtype):
    # A [3, 5, 7] part written into columns 2..8 of a [3, 5, 11] result (a concatenation along the last dim),
    # from a permuted view: nothing outside the slice changes.
    rng = np.random.default_rng(9)
    base = rng.integers(-50, 50, 3 * 5 * 7 + 2)
    view = _view(base, 2, (1, 21, 3), (3, 5, 7))
    x = upload(device, base, dtype)
    out = upload(device, np.full((3, 5, 11), 99), dtype)
    run(device, lambda s: ew.copy_strided(s, Operand(x, 2), (1, 21, 3), Operand(out, 2), (3, 5, 7),
                                          out_strides=(55, 11, 1)))
    expected = np.full((3, 5, 11), 99)
    expected[:, :, 2:9] = view
    np.testing.assert_array_equal(download(out), stored(expected, dtype))


@pytest.mark.parametrize("src,dst", sorted(ew.COPY_CONVERSIONS))
def test_copy_strided_converts(device, src, dst):
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.normal(0, 300, 200), [0.0, -0.0, 0.5, -0.5, 1.0, -2.75, 1 + 2**-9, 65504.0]])
    if src == "bool":
        values = rng.integers(0, 2, 200)
    elif src == "int32":
        values = rng.integers(-3000, 3000, 200)
    x = stored(values, src)
    xb, out = upload(device, x, src), device.buffer(x.shape, dst)
    run(device, lambda s: ew.copy_strided(s, xb, None, out, x.shape))
    if dst == "int32":
        expected = np.trunc(x).astype(np.int64)
    else:
        expected = stored(x, dst)
    np.testing.assert_array_equal(download(out), expected)


def test_copy_strided_bool_beyond_one_row_of_workgroups(device):
    n = 65535 * 256 + 300
    mask = np.zeros(n, np.uint8)
    mask[::7] = 1
    x, out = device.upload(mask, dtype="bool"), device.buffer(n, "bool")
    run(device, lambda s: ew.copy_strided(s, x, None, out, (n,)))
    np.testing.assert_array_equal(out.read(), mask)


# ---------------------------------------------------------------- dropout

def _dropout(device, x, seeds, p, dtype="float32", slot=0, stream=0):
    xb, out = upload(device, x, dtype), device.buffer(x.shape, dtype)
    run(device, lambda s: dropout_kernels.dropout(s, xb, out, seeds, p=p, count=x.size, seed_slot=slot,
                                                  stream=stream))
    return download(out)


def test_dropout_keep_fraction_scale_and_backward_mask(device):
    n, p = 1 << 20, 0.3
    rng = np.random.default_rng(8)
    x = rng.uniform(0.5, 2, n).astype(np.float32)
    seeds = device.upload(np.array([1234, 0], np.uint32))
    y = _dropout(device, x, seeds, p)
    kept = y != 0
    assert abs(kept.mean() - (1 - p)) < 3e-3
    np.testing.assert_array_equal(y[kept], (x[kept] * np.float32(1 / (1 - p))).astype(np.float64))
    dy = rng.uniform(0.5, 2, n).astype(np.float32)  # backward: the same call on dy keeps the same elements
    dx = _dropout(device, dy, seeds, p)
    np.testing.assert_array_equal(dx != 0, kept)


def test_dropout_new_seed_replayed_and_counter_base(device):
    n, p = 100_000, 0.5
    x = device.upload(np.ones(n, np.float32))
    out = device.buffer(n)
    seeds = device.buffer(4, "uint32", host_visible=True)
    seeds.host[:] = [7, 0, 0, 0]
    seq = device.sequence()
    seq.upload(seeds)
    dropout_kernels.dropout(seq, x, out, seeds, p=p, count=n)
    seq.replay()
    first = out.read() != 0
    seq.replay()
    np.testing.assert_array_equal(out.read() != 0, first)  # same seed: same mask
    seeds.host[0] = 8
    seq.replay()
    second = out.read() != 0
    assert 0.4 < np.mean(first != second) < 0.6  # a new seed: an independent mask
    seeds.host[:2] = [7, 1000]  # counter base 1000: the stream shifted by 1000 elements
    seq.replay()
    np.testing.assert_array_equal((out.read() != 0)[: n - 1000], first[1000:])
    other_stream = _dropout(device, np.ones(n), device.upload(np.array([7, 0], np.uint32)), p, stream=1) != 0
    assert 0.4 < np.mean(first != other_stream) < 0.6


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dropout_16_bit_and_extremes(device, dtype):
    x = stored(np.linspace(-3, 3, 4099), dtype)
    seeds = device.upload(np.array([0, 0, 99, 5], np.uint32))
    np.testing.assert_array_equal(_dropout(device, x, seeds, 0.0, dtype, slot=2), x)
    np.testing.assert_array_equal(_dropout(device, x, seeds, 1.0, dtype, slot=2), np.zeros_like(x))
    y = _dropout(device, x, seeds, 0.25, dtype, slot=2)
    kept = y != 0
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=storage_tolerance(dtype)[0])
    with pytest.raises(ValueError, match="seed buffer"):
        _dropout(device, x, seeds, 0.5, dtype, slot=3)


def test_strided_ops_and_dropout_over_a_2d_grid(device, monkeypatch):
    """A small limit on workgroups along x forces the 2-D grid (global_index) in every launcher."""
    rng = np.random.default_rng(9)
    a, b = rng.uniform(-2, 2, (40, 1, 50)), rng.uniform(-2, 2, (1, 30, 50))
    n, seeds = 5000, device.upload(np.array([3, 0], np.uint32))
    reference_mask = _dropout(device, np.ones(n), seeds, 0.5) != 0
    monkeypatch.setitem(device.limits, "max_compute_work_group_count_x", 3)
    got = _binary_view(device, "add", a, 0, (50, 0, 1), b, 0, (0, 50, 1), (40, 30, 50))
    np.testing.assert_array_equal(got, stored(stored(a, "float32") + stored(b, "float32"), "float32"))
    np.testing.assert_array_equal(_dropout(device, np.ones(n), seeds, 0.5) != 0, reference_mask)
    x, out = device.upload(a.astype(np.float32)), device.buffer((50, 40))
    run(device, lambda s: ew.copy_strided(s, x, (1, 50), out, (50, 40)))
    np.testing.assert_array_equal(out.read(), a[:, 0, :].T.astype(np.float32))
