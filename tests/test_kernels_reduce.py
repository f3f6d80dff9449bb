"""Reductions over one axis and (log-)softmax forward/backward, against float64 numpy.

Tolerances: sums and means accumulate in fp32, so they are compared with an
absolute error of 1e-6 * sum(|x|) along the axis (float32); the 16-bit dtypes add
one ulp of the stored result (float16 2e-3 relative or 6e-8 absolute in its
subnormal range, bfloat16 1.6e-2 relative). max/min
pick an element, so they are exact; argmax/argmin are exact indices, first
occurrence on ties. Softmax: float32 relative 1e-5 for probabilities (a sum of up to
50k exps), absolute 1e-5 * (1 + |log(sum exp)|) for log-probabilities; backward
absolute 1e-5 * the row's scale.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from vkformers.engine.kernels import Operand
from vkformers.engine.kernels import reduce as reduce_kernels
from vkformers.engine.kernels import softmax as softmax_kernels
from vkformers.runtime.dtypes import from_bfloat16, to_bfloat16

SHADERS = Path(__file__).resolve().parent.parent / "shaders" / "common"
FLOATS = ("float32", "float16", "bfloat16")
STORAGE_RTOL = {"float32": 0.0, "float16": 2e-3, "bfloat16": 1.6e-2}
STORAGE_ATOL = {"float32": 1e-30, "float16": 6e-8, "bfloat16": 1e-30}  # float16: one subnormal step


def stored(x, dtype: str) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if dtype == "float32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    return from_bfloat16(to_bfloat16(x.astype(np.float32))).astype(np.float64)


def upload(device, x, dtype: str):
    if dtype == "bfloat16":
        return device.upload(to_bfloat16(np.asarray(x, np.float32)), dtype="bfloat16")
    return device.upload(np.asarray(x).astype({"float32": np.float32, "float16": np.float16}[dtype]))


def download(buf) -> np.ndarray:
    data = buf.read()
    if buf.dtype.name == "bfloat16":
        return from_bfloat16(data).astype(np.float64)
    return data.astype(np.float64) if buf.dtype.name != "int32" else data.astype(np.int64)


def test_op_codes_match_the_shaders():
    text = (SHADERS / "reduce.comp").read_text()
    assert {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define REDUCE_(\w+) (\d+)", text)} \
        == reduce_kernels.REDUCE_OPS
    text = (SHADERS / "softmax.comp").read_text()
    assert {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define MODE_(\w+) (\d+)", text)} \
        == softmax_kernels.MODES


# ---------------------------------------------------------------- reductions

def run_reduce(device, op, x, dtype, x_offset=0, out_offset=0):
    outer, axis_len, inner = x.shape
    flat = np.concatenate([np.zeros(x_offset), x.reshape(-1)])
    xb = upload(device, flat, dtype)
    out = device.buffer(out_offset + outer * inner, "int32" if op in ("argmax", "argmin") else dtype)
    device.run(lambda s: reduce_kernels.reduce(s, op, Operand(xb, x_offset), Operand(out, out_offset),
                                               outer=outer, axis_len=axis_len, inner=inner))
    return download(out)[out_offset:].reshape(outer, inner)


SHAPES = [(1, 1, 1), (7, 1, 1), (3, 7, 1), (5, 1000, 1), (2, 300, 3), (4, 33, 40), (1, 5, 70), (2, 3, 257),
          (3, 20000, 1)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reduce_ops(device, shape, dtype):
    rng = np.random.default_rng(sum(shape))
    x = stored(rng.normal(0.3, 1.0, shape), dtype)
    scale = np.abs(x).sum(axis=1)
    for op in ("sum", "mean", "max", "min", "argmax", "argmin"):
        got = run_reduce(device, op, x, dtype)
        if op in ("sum", "mean"):
            ref = x.sum(axis=1) / (shape[1] if op == "mean" else 1)
            atol = 1e-6 * scale / (shape[1] if op == "mean" else 1)
            assert np.all(np.abs(got - ref) <= atol + STORAGE_RTOL[dtype] * np.abs(ref)), (op, dtype)
        elif op in ("max", "min"):
            np.testing.assert_array_equal(got, getattr(x, op)(axis=1), err_msg=op)
        else:
            np.testing.assert_array_equal(got, getattr(x, op)(axis=1), err_msg=op)


@pytest.mark.parametrize("axis_len,inner", [(3, 1), (300, 1), (7, 9)])
def test_reduce_with_offsets_over_a_2d_grid(device, monkeypatch, axis_len, inner):
    # A small limit on workgroups along x forces a 2-D grid, as a large problem would.
    monkeypatch.setitem(device.limits, "max_compute_work_group_count_x", 5)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (1000, axis_len, inner))
    got = run_reduce(device, "argmax", x, "float32", x_offset=5, out_offset=3)
    np.testing.assert_array_equal(got, x.astype(np.float32).argmax(axis=1))
    got = run_reduce(device, "sum", x, "float32", x_offset=1, out_offset=2)
    np.testing.assert_allclose(got, x.astype(np.float32).astype(np.float64).sum(axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("inner", [1, 5])
def test_arg_ties_first_occurrence_and_special_values(device, inner):
    rows = np.array([
        [1, 3, 3, 0, 3, 2, 3, 3] * 100,  # the max at many places: first is index 1
        [2] * 800,                        # all equal: 0
        [-np.inf] * 800,                  # all -inf: 0
        [0] * 300 + [np.nan] + [5] * 198 + [np.nan] + [0] * 300,  # NaN is the max and min: first NaN
    ], np.float64)
    x = np.repeat(rows[:, :, None], inner, axis=2)
    np.testing.assert_array_equal(run_reduce(device, "argmax", x, "float32")[:, 0], [1, 0, 0, 300])
    np.testing.assert_array_equal(run_reduce(device, "argmin", x, "float32")[:, 0], [3, 0, 0, 300])
    np.testing.assert_array_equal(run_reduce(device, "max", x, "float32")[:, 0], [3, 2, -np.inf, np.nan])
    np.testing.assert_array_equal(run_reduce(device, "min", x, "float32")[:, 0], [0, 2, -np.inf, np.nan])


def test_reduce_errors(device):
    x = device.upload(np.zeros(24, np.float32))
    seq = device.sequence()
    with pytest.raises(ValueError, match="unknown op 'prod'"):
        reduce_kernels.reduce(seq, "prod", x, device.buffer(4), outer=4, axis_len=6)
    with pytest.raises(TypeError, match="output must be int32"):
        reduce_kernels.reduce(seq, "argmax", x, device.buffer(4), outer=4, axis_len=6)
    with pytest.raises(ValueError, match="input: needs 28 elements"):
        reduce_kernels.reduce(seq, "sum", x, device.buffer(4), outer=4, axis_len=7)
    with pytest.raises(ValueError, match="axis is empty"):
        reduce_kernels.reduce(seq, "max", x, device.buffer(4), outer=4, axis_len=0)
    with pytest.raises(TypeError, match="int32 is not supported"):
        reduce_kernels.reduce(seq, "sum", device.buffer(4, "int32"), device.buffer(1, "int32"), outer=1, axis_len=4)
    assert seq._ops == []
    out = device.upload(np.full(2, 7.0, np.float32))  # an empty axis sums to 0
    device.run(lambda s: reduce_kernels.reduce(s, "sum", x, out, outer=2, axis_len=0))
    np.testing.assert_array_equal(out.read(), [0, 0])


# ---------------------------------------------------------------- softmax

def softmax_ref(x):
    with np.errstate(invalid="ignore"):
        m = np.max(x, axis=1, keepdims=True)
        e = np.exp(x - m)
        s = e.sum(axis=1, keepdims=True)
        return e / s, (x - m) - np.log(s)


def run_softmax(device, x, dtype, log, dy=None):
    rows, cols = x.shape
    xb, out = upload(device, x, dtype), device.buffer(x.shape, dtype)
    if dy is None:
        device.run(lambda s: softmax_kernels.softmax(s, xb, out, rows=rows, cols=cols, log=log))
    else:
        dyb = upload(device, dy, dtype)
        device.run(lambda s: softmax_kernels.softmax_backward(s, xb, dyb, out, rows=rows, cols=cols, log=log))
    return download(out)


SOFTMAX_SHAPES = [(1, 1), (3, 1), (4, 7), (5, 300), (3, 1000), (2, 50000)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_softmax_forward(device, shape, dtype):
    rng = np.random.default_rng(shape[1])
    x = stored(rng.normal(0, 4, shape), dtype)
    if shape[1] > 2:
        x[0, ::3] = -np.inf  # masked entries
    prob, logp = softmax_ref(x)
    got_prob = run_softmax(device, x, dtype, log=False)
    got_logp = run_softmax(device, x, dtype, log=True)
    rtol = max(1e-5, STORAGE_RTOL[dtype])
    np.testing.assert_allclose(got_prob, prob, rtol=rtol, atol=STORAGE_ATOL[dtype])
    finite = np.isfinite(logp)
    np.testing.assert_array_equal(got_logp[~finite], logp[~finite])
    lse_scale = 1 + np.abs(np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)))
    atol = np.broadcast_to(1e-5 * lse_scale, x.shape)[finite]
    assert np.all(np.abs(got_logp[finite] - logp[finite]) <= atol + STORAGE_RTOL[dtype] * np.abs(logp[finite]))


def test_softmax_rows_all_minus_inf_and_extremes(device):
    x = np.array([[-np.inf] * 4, [0, 0, 0, 0], [1e30, -1e30, 0, 1e30], [88, 89, -103, -np.inf]], np.float32)
    prob, logp = softmax_ref(x.astype(np.float64))
    got = run_softmax(device, x, "float32", log=False)
    assert np.all(np.isnan(got[0]))  # like torch: an all-masked row is NaN
    np.testing.assert_allclose(got[1:], prob[1:], rtol=1e-6, atol=1e-30)
    got = run_softmax(device, x, "float32", log=True)
    assert np.all(np.isnan(got[0]))
    np.testing.assert_allclose(got[1:], logp[1:], rtol=1e-6)


@pytest.mark.parametrize("cols", [3, 300])
def test_softmax_over_a_2d_grid(device, monkeypatch, cols):
    monkeypatch.setitem(device.limits, "max_compute_work_group_count_x", 5)
    x = np.random.default_rng(2).normal(0, 1, (1000, cols))
    np.testing.assert_allclose(run_softmax(device, x, "float32", log=False), softmax_ref(x)[0], rtol=1e-5)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1), (4, 7), (3, 1000), (2, 50000)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward(device, shape, dtype, log):
    rng = np.random.default_rng(7)
    prob, logp = softmax_ref(rng.normal(0, 2, shape))
    y = stored(logp if log else prob, dtype)
    dy = stored(rng.normal(0, 1, shape), dtype)
    if log:
        ref = dy - np.exp(y) * dy.sum(axis=1, keepdims=True)
        scale = np.abs(dy).sum(axis=1, keepdims=True) * np.exp(y) + np.abs(dy)
    else:
        ref = y * (dy - (dy * y).sum(axis=1, keepdims=True))
        scale = y * (np.abs(dy) + np.abs(dy * y).sum(axis=1, keepdims=True))
    got = run_softmax(device, y, dtype, log, dy=dy)
    assert np.all(np.abs(got - ref) <= 1e-5 * scale + STORAGE_RTOL[dtype] * np.abs(ref) + STORAGE_ATOL[dtype])


def test_softmax_errors(device):
    x = device.upload(np.zeros(12, np.float32))
    seq = device.sequence()
    with pytest.raises(ValueError, match="output: needs 12 elements"):
        softmax_kernels.softmax(seq, x, device.buffer(11), rows=3, cols=4)
    with pytest.raises(TypeError, match="share a dtype"):
        softmax_kernels.softmax_backward(seq, x, device.buffer(12, "float16"), device.buffer(12), rows=3, cols=4)
    with pytest.raises(TypeError, match="int32 is not supported"):
        softmax_kernels.softmax(seq, device.buffer(12, "int32"), device.buffer(12, "int32"), rows=3, cols=4)
    assert seq._ops == []
