"""acos composed of elementwise ops (engine/ops/trig.py): its values against numpy's float64 arccos on a dense grid
with the ends and their neighbours, and its gradient against -g / sqrt(1 - x^2), with torch's values at +-1."""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor

MAX_ABS_ERROR = 1.4e-7  # the bound trig.py states (one float32 ulp of pi is 2.4e-7)


def _grid() -> np.ndarray:
    f32 = np.float32
    below_one = np.nextafter(f32(1), f32(0)) - np.arange(4000, dtype=f32) * np.finfo(f32).epsneg
    near_half = f32(0.5) + np.arange(-2000, 2000, dtype=f32) * np.finfo(f32).epsneg
    return np.concatenate([np.linspace(-1, 1, 400_001).astype(f32), below_one, -below_one, near_half, -near_half,
                           [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30]]).astype(f32)


def test_values_within_the_stated_bound():
    x = _grid()
    out = F.acos(Tensor(x)).numpy()
    error = np.abs(out.astype(np.float64) - np.arccos(x.astype(np.float64)))
    assert error.max() <= MAX_ABS_ERROR, f"max error {error.max():.3g} at x = {x[np.argmax(error)]!r}"
    assert out[-4] == 0.0 and out[-3] == np.float32(np.pi)


def test_outside_the_domain_is_nan():
    x = np.array([1.0000001, -1.0000001, 2.0, -3e38, np.inf, np.nan], np.float32)
    assert np.isnan(F.acos(Tensor(x)).numpy()).all()


def test_gradient_is_exact_and_infinite_at_the_ends():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-0.999, 0.999, 300), [0.0, 0.5, -0.5, 1 - 2**-24, -1 + 2**-24]]).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    xs = Tensor(x, requires_grad=True)
    (xs.acos() * Tensor(g)).sum().backward()
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(xs.grad.numpy(), -g / np.sqrt(1 - x64 * x64), rtol=2e-6)

    ends = np.array([1.0, 1.0, 1.0, -1.0, -1.0, 1.5], np.float32)
    g_ends = np.array([2.0, -3.0, 0.0, 1.0, -1.0, 1.0], np.float32)
    xs = Tensor(ends, requires_grad=True)
    (xs.acos() * Tensor(g_ends)).sum().backward()
    np.testing.assert_array_equal(xs.grad.numpy(), [-np.inf, np.inf, np.nan, -np.inf, np.inf, np.nan])
