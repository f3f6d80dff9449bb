"""F.causal_conv1d (shaders/common/causal_conv1d.comp) against numpy: forward in float32, float16 and bfloat16,
with and without bias and history; gradients of x, weight and bias against float64 central differences, and the
weight's over a long sequence against numpy. Also the sequence ops composed on it or on views: F.depthwise_conv1d
(zeros on both sides) and F.avg_pool1d."""
from __future__ import annotations

import numpy as np
import pytest

from vkformers.engine import functional as F
from vkformers.engine.kernels import conv as KC
from vkformers.engine.tensor import Tensor


def reference(x, weight, bias=None, history=None):
    batch, length, channels = x.shape
    kernel = weight.shape[-1]
    past = np.zeros((batch, kernel - 1, channels)) if history is None else history
    full = np.concatenate([past, x], axis=1)
    out = sum(full[:, j:j + length] * weight.reshape(channels, kernel)[:, j] for j in range(kernel))
    return out + (0 if bias is None else bias)


def _inputs(rng, batch, length, channels, kernel):
    return (rng.standard_normal((batch, length, channels)), rng.standard_normal((channels, 1, kernel)),
            rng.standard_normal(channels), rng.standard_normal((batch, kernel - 1, channels)))


@pytest.mark.parametrize("batch,length,channels,kernel", [(2, 5, 3, 4), (1, 1, 7, 4), (3, 9, 300, 2), (2, 4, 5, 1)])
@pytest.mark.parametrize("with_bias,with_history", [(True, True), (False, False), (True, False)])
def test_forward_matches_numpy(batch, length, channels, kernel, with_bias, with_history):
    x, w, b, h = _inputs(np.random.default_rng(0), batch, length, channels, kernel)
    b, h = (b if with_bias else None), (h if with_history else None)
    got = F.causal_conv1d(Tensor(x.astype(np.float32)), Tensor(w.astype(np.float32)),
                          None if b is None else Tensor(b.astype(np.float32)),
                          None if h is None else Tensor(h.astype(np.float32))).numpy()
    np.testing.assert_allclose(got, reference(x, w, b, h), atol=2e-5)


@pytest.mark.parametrize("dtype,atol", [("float16", 2e-2), ("bfloat16", 1e-1)])
def test_forward_in_16_bit(dtype, atol):
    x, w, b, h = _inputs(np.random.default_rng(1), 2, 6, 9, 4)
    got = F.causal_conv1d(*(Tensor(v.astype(np.float32), dtype=dtype) for v in (x, w, b, h)))
    assert got.dtype.name == dtype
    np.testing.assert_allclose(got.float().numpy(), reference(x, w, b, h), atol=atol)


def _central_differences(f, value, eps=1e-6):
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        step = np.zeros_like(value)
        step[index] = eps
        grad[index] = (f(value + step) - f(value - step)) / (2 * eps)
    return grad


@pytest.mark.parametrize("with_history", [True, False])
def test_gradients_match_finite_differences(with_history):
    rng = np.random.default_rng(2)
    x, w, b, h = _inputs(rng, 2, 6, 3, 4)
    h = h if with_history else None
    g = rng.standard_normal(x.shape)
    xs, ws, bs = (Tensor(v.astype(np.float32), requires_grad=True) for v in (x, w, b))
    out = F.causal_conv1d(xs, ws, bs, None if h is None else Tensor(h.astype(np.float32)))
    (out * Tensor(g.astype(np.float32))).sum().backward()
    expected = {
        "x": _central_differences(lambda v: (reference(v, w, b, h) * g).sum(), x),
        "weight": _central_differences(lambda v: (reference(x, v, b, h) * g).sum(), w),
        "bias": _central_differences(lambda v: (reference(x, w, v, h) * g).sum(), b),
    }
    for name, tensor in (("x", xs), ("weight", ws), ("bias", bs)):
        np.testing.assert_allclose(tensor.grad.numpy(), expected[name], atol=2e-5, err_msg=name)


@pytest.mark.parametrize("length", [KC.DW_SPAN - 1, KC.DW_SPAN, 2 * KC.DW_SPAN + 3, 17000])
def test_weight_gradient_of_a_long_sequence_matches_numpy(length):
    """Each invocation of the weight gradient sums a block of steps (KC.DW_SPAN): one block, one exactly, several
    with a tail, and past about 65535 / kernel steps (where one invocation summing a row's steps stopped short on
    lavapipe: llvmpipe ends an invocation's loops after 65535 iterations in all)."""
    rng = np.random.default_rng(5)
    batch, channels, kernel = 2, 2, 4
    x, w, _, h = _inputs(rng, batch, length, channels, kernel)
    g = rng.standard_normal(x.shape)
    ws = Tensor(w.astype(np.float32), requires_grad=True)
    out = F.causal_conv1d(Tensor(x.astype(np.float32)), ws, history=Tensor(h.astype(np.float32)))
    (out * Tensor(g.astype(np.float32))).sum().backward()
    full = np.concatenate([h, x], axis=1)
    want = np.stack([(g * full[:, j:j + length]).sum((0, 1)) for j in range(kernel)], 1)[:, None]
    np.testing.assert_allclose(ws.grad.numpy(), want, atol=1e-5 * np.abs(want).max())


def test_history_gets_no_gradient_and_shapes_are_checked():
    x = Tensor(np.ones((1, 3, 2), np.float32), requires_grad=True)
    history = Tensor(np.ones((1, 3, 2), np.float32), requires_grad=True)
    F.causal_conv1d(x, Tensor(np.ones((2, 4), np.float32)), history=history).sum().backward()
    assert history.grad is None and x.grad is not None
    with pytest.raises(ValueError, match="history must be"):
        F.causal_conv1d(x, Tensor(np.ones((2, 4), np.float32)), history=Tensor(np.ones((1, 2, 2), np.float32)))
    with pytest.raises(ValueError, match="does not fit"):
        F.causal_conv1d(x, Tensor(np.ones((3, 4), np.float32)))


def reference_padded(x, weight, padding):
    """torch's depthwise Conv1d (no bias) with ``padding`` zeros on both sides, channels last."""
    batch, length, channels = x.shape
    kernel = weight.shape[-1]
    full = np.concatenate([np.zeros((batch, padding, channels)), x, np.zeros((batch, padding, channels))], axis=1)
    rows = length + 2 * padding - kernel + 1
    return sum(full[:, j:j + rows] * weight.reshape(channels, kernel)[:, j] for j in range(kernel))


@pytest.mark.parametrize("length,kernel,padding", [(6, 3, 1), (1, 3, 1), (7, 5, 2), (5, 4, 1), (5, 4, 3), (4, 3, 0)])
def test_depthwise_conv1d_matches_numpy_and_differences(length, kernel, padding):
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((2, length, 3)), rng.standard_normal((3, 1, kernel))
    xs, ws = (Tensor(v.astype(np.float32), requires_grad=True) for v in (x, w))
    out = F.depthwise_conv1d(xs, ws, padding)
    expected = reference_padded(x, w, padding)
    np.testing.assert_allclose(out.numpy(), expected, atol=2e-5)
    g = rng.standard_normal(expected.shape)
    (out * Tensor(g.astype(np.float32))).sum().backward()
    np.testing.assert_allclose(xs.grad.numpy(), _central_differences(
        lambda v: (reference_padded(v, w, padding) * g).sum(), x), atol=2e-5)
    np.testing.assert_allclose(ws.grad.numpy(), _central_differences(
        lambda v: (reference_padded(x, v, padding) * g).sum(), w), atol=2e-5)


def test_depthwise_conv1d_refuses_padding_past_the_kernel():
    x = Tensor(np.ones((1, 4, 2), np.float32))
    with pytest.raises(ValueError, match="padding 3 must lie"):
        F.depthwise_conv1d(x, Tensor(np.ones((2, 3), np.float32)), 3)
    with pytest.raises(ValueError, match="leaves no output"):
        F.depthwise_conv1d(Tensor(np.ones((1, 1, 2), np.float32)), Tensor(np.ones((2, 4), np.float32)), 1)


@pytest.mark.parametrize("length,stride", [(8, 2), (7, 2), (1, 2), (9, 4), (5, 1)])
def test_avg_pool1d_matches_numpy_and_differences(length, stride):
    """F.avg_pool1d (engine/ops/pool.py): torch's avg_pool with ceil_mode, the last window partial."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, length, 3))

    def reference(v):
        return np.stack([v[:, s:s + stride].mean(1) for s in range(0, length, stride)], 1)

    xs = Tensor(x.astype(np.float32), requires_grad=True)
    out = F.avg_pool1d(xs, stride)
    np.testing.assert_allclose(out.numpy(), reference(x), atol=1e-6)
    g = rng.standard_normal(reference(x).shape)
    (out * Tensor(g.astype(np.float32))).sum().backward()
    np.testing.assert_allclose(xs.grad.numpy(), _central_differences(lambda v: (reference(v) * g).sum(), x), atol=2e-5)
    with pytest.raises(ValueError, match="stride must be"):
        F.avg_pool1d(xs, 0)
