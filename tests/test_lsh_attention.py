"""F.lsh_expectation_attention (YOSO's expected-collision attention, its surrogate gradient) and F.normalize against
numpy in float64."""
from __future__ import annotations

import numpy as np
import pytest

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("shape,hash_bits", [((2, 3, 5, 4), 9), ((1, 1, 4), 1), ((3, 7, 6), 4)])
def test_forward_and_yoso_gradient_match_numpy(shape, hash_bits):
    rng = np.random.default_rng(0)
    q, k = _unit(rng, *shape), _unit(rng, *shape)
    v, g = rng.standard_normal(shape), rng.standard_normal(shape)
    qs, ks, vs = (Tensor(a.astype(np.float32), requires_grad=True) for a in (q, k, v))
    out = F.lsh_expectation_attention(qs, ks, vs, hash_bits)
    collision = (1 - np.arccos(q @ np.swapaxes(k, -1, -2)) / np.pi) ** hash_bits
    np.testing.assert_allclose(out.numpy(), collision @ v, rtol=1e-5, atol=1e-5)
    (out * Tensor(g.astype(np.float32))).sum().backward()
    weighted = (g @ np.swapaxes(v, -1, -2)) * collision
    np.testing.assert_allclose(qs.grad.numpy(), weighted @ k * hash_bits / 2, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ks.grad.numpy(), np.swapaxes(weighted, -1, -2) @ q * hash_bits / 2, rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(vs.grad.numpy(), np.swapaxes(collision, -1, -2) @ g, rtol=1e-4, atol=1e-5)


def test_arguments_are_checked():
    q = Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        F.lsh_expectation_attention(q, Tensor(np.ones((2, 4), np.float32)), q, 9)
    with pytest.raises(ValueError, match="positive integer"):
        F.lsh_expectation_attention(q, q, q, 0)


def test_normalize_and_its_gradient():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5))
    x[1] = 0.0  # the norm clamps to eps: zeros stay zeros
    g = rng.standard_normal(x.shape)
    xs = Tensor(x.astype(np.float32), requires_grad=True)
    out = F.normalize(xs, dim=-1)
    norm = np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    np.testing.assert_allclose(out.numpy(), x / norm, rtol=1e-6, atol=1e-7)
    (out * Tensor(g.astype(np.float32))).sum().backward()
    expected = g / norm - x * (g * x).sum(-1, keepdims=True) / norm ** 3
    expected[1] = g[1] / 1e-12
    np.testing.assert_allclose(xs.grad.numpy()[[0, 2]], expected[[0, 2]], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="p=2"):
        F.normalize(xs, p=1.0)
