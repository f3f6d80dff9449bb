"""F.iterative_pinv (engine/ops/linalg.py): the Newton-Schulz iteration against numpy in float64 (forward and its
limit, the inverse), its gradient against float64 central differences, and its argument checks."""
from __future__ import annotations

import numpy as np
import pytest

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor


def reference(a, iterations, scaling):
    sums = a.sum(-2)
    largest = sums.max() if scaling == "global" else sums.max(-1)[..., None, None]
    z = np.swapaxes(a, -1, -2) / largest
    eye = np.eye(a.shape[-1])
    for _ in range(iterations):
        az = a @ z
        z = (0.25 * z) @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def _stochastic(rng, *shape):
    logits = rng.standard_normal(shape)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("scaling", ["global", "per_matrix"])
@pytest.mark.parametrize("shape,iterations", [((2, 3, 4, 4), 6), ((1, 1, 1, 1), 6), ((5, 5), 2), ((2, 7, 7), 0)])
def test_forward_matches_numpy(shape, iterations, scaling):
    a = _stochastic(np.random.default_rng(0), *shape)
    got = F.iterative_pinv(Tensor(a.astype(np.float32)), iterations, scaling).numpy()
    np.testing.assert_allclose(got, reference(a, iterations, scaling), rtol=1e-4, atol=1e-5)


def test_converges_to_the_inverse():
    a = _stochastic(np.random.default_rng(1), 3, 4, 4) + 2 * np.eye(4)  # well conditioned
    got = F.iterative_pinv(Tensor(a.astype(np.float32)), 12, "per_matrix").numpy()
    np.testing.assert_allclose(got, np.linalg.inv(a), atol=1e-4)


def _central_differences(f, value, eps=1e-6):
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        step = np.zeros_like(value)
        step[index] = eps
        grad[index] = (f(value + step) - f(value - step)) / (2 * eps)
    return grad


@pytest.mark.parametrize("scaling", ["global", "per_matrix"])
def test_gradient_matches_finite_differences(scaling):
    rng = np.random.default_rng(2)
    a = _stochastic(rng, 2, 3, 3)
    g = rng.standard_normal(a.shape)
    at = Tensor(a.astype(np.float32), requires_grad=True)
    (F.iterative_pinv(at, 3, scaling) * Tensor(g.astype(np.float32))).sum().backward()
    expected = _central_differences(lambda v: (reference(v, 3, scaling) * g).sum(), a)
    np.testing.assert_allclose(at.grad.numpy(), expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="must be"):
        F.iterative_pinv(Tensor(np.ones((2, 3), np.float32)))
    with pytest.raises(ValueError, match="scaling must be"):
        F.iterative_pinv(Tensor(np.ones((2, 2), np.float32)), scaling="frobenius")
