"""Compositions of engine ops in vkformers.engine.functional against their plain forms, forward and gradients:
F.banded_attention (keys within a radius, in blocks of radius + 1: memory linear in the length) against the same
attention over the whole T x T score matrix, with padding, a band bias, extra keys and lengths that are and are not
a multiple of the block; F.cumsum_rows against numpy's cumsum."""
from __future__ import annotations

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import functional as F

MASKED = -1e9


def dense(q, k, v, radius, scale, offset_bias, key_mask, extra_k, extra_v, extra_bias):
    """The reference: every query over every key, the band and padding as an additive mask."""
    length = q.shape[2]
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    offsets = np.clip(j - i + radius, 0, 2 * radius)
    bias = offset_bias[:, :, offsets]                                          # [1, H, T, T]
    allowed = (np.abs(j - i) <= radius)[None, None] & key_mask[:, None, None, :]
    bias = vkf.tensor(np.where(allowed, bias, MASKED).astype(np.float32))
    scores = (q @ k.transpose(-1, -2)) * scale + bias
    values = v
    if extra_k is not None:
        scores = F.cat([scores, (q @ extra_k.transpose(-1, -2)) * scale + extra_bias], 3)
        values = F.cat([v, extra_v], 2)
    return scores.softmax(-1) @ values


def band_layout(offset_bias, radius):
    """[1, H, 2r + 1] by offset -> [1, H, L, 3L] by (query's place in its block, key's place in three blocks)."""
    block = radius + 1
    o, m = np.arange(block)[:, None], np.arange(3 * block)[None, :]
    offsets = np.clip(m - block - o + radius, 0, 2 * radius)
    return offset_bias[:, :, offsets]


@pytest.mark.parametrize("length,radius,extra", [(7, 2, False), (9, 2, True), (5, 1, True), (1, 3, False)])
def test_banded_attention_matches_the_dense_band(length, radius, extra):
    rng = np.random.default_rng(length * 10 + radius)
    batch, heads, dim, count = 2, 2, 4, 2
    arrays = {n: rng.standard_normal((batch, heads, length, dim)).astype(np.float32) for n in "qkv"}
    offset_bias = rng.standard_normal((1, heads, 2 * radius + 1)).astype(np.float32)
    key_mask = np.ones((batch, length), bool)
    key_mask[1, length - min(2, length - 1):] = False if length > 1 else True
    extra_arrays = {}
    if extra:
        extra_arrays = {n: rng.standard_normal((batch, heads, count, dim)).astype(np.float32) for n in ("ek", "ev")}
        extra_arrays["eb"] = rng.standard_normal((batch, heads, length, count)).astype(np.float32)

    def run(banded):
        t = {n: vkf.tensor(a, requires_grad=True) for n, a in {**arrays, **extra_arrays}.items()}
        if banded:
            out = F.banded_attention(t["q"], t["k"], t["v"], radius, scale=0.5,
                                     band_bias=vkf.tensor(band_layout(offset_bias, radius)), key_mask=key_mask,
                                     extra_keys=t.get("ek"), extra_values=t.get("ev"), extra_bias=t.get("eb"))
        else:
            out = dense(t["q"], t["k"], t["v"], radius, 0.5, offset_bias, key_mask, t.get("ek"), t.get("ev"),
                        t.get("eb"))
        weights = vkf.tensor(np.linspace(-1, 1, out.numel(), dtype=np.float32).reshape(out.shape))
        (out * weights).sum().backward()
        return out.numpy(), {n: x.grad.numpy() for n, x in t.items()}

    want, want_grads = run(False)
    got, got_grads = run(True)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for name in want_grads:
        np.testing.assert_allclose(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 30])
def test_cumsum_rows_matches_numpy(rows):
    x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
    t = vkf.tensor(x, requires_grad=True)
    out = F.cumsum_rows(t)
    np.testing.assert_allclose(out.numpy(), np.cumsum(x, axis=0), atol=1e-5, rtol=1e-5)
    weights = np.linspace(-1, 1, x.size, dtype=np.float32).reshape(x.shape)
    (out * vkf.tensor(weights)).sum().backward()
    # d/dx_i of sum_j w_j cumsum_j = sum over j >= i of w_j
    np.testing.assert_allclose(t.grad.numpy(), np.cumsum(weights[::-1], axis=0)[::-1], atol=1e-5, rtol=1e-5)
