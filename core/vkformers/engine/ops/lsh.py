"""YOSO's attention: the expectation of locality-sensitive-hashing collisions between unit queries and keys, with
the gradient YOSO trains with (the paper's, not the derivative of the forward)."""
from __future__ import annotations

import math

from vkformers.engine.function import Function, no_grad, wrap


class LshExpectationFn(Function):
    def forward(self, q, k, v, hash_bits):
        self.hash_bits = hash_bits
        with no_grad():  # composed of tensor ops; the gradient below is YOSO's own
            collision = ((wrap(q) @ wrap(k).transpose(-2, -1)).acos() * (-1.0 / math.pi) + 1.0) ** float(hash_bits)
            out = collision @ wrap(v)
        self.saved = (q, k, v, collision.lazy)
        return out.lazy

    def backward(self, g):
        q, k, v, collision = (wrap(t) for t in self.saved)
        weighted = (g @ v.transpose(-2, -1)) * collision
        half = self.hash_bits / 2.0
        return ((weighted @ k) * half, (weighted.transpose(-2, -1) @ q) * half,
                collision.transpose(-2, -1) @ g)


def lsh_expectation_attention(q, k, v, hash_bits: int):
    """E v with E = (1 - acos(q k^T) / pi) ** hash_bits, the probability that ``hash_bits`` random hyperplanes put
    a unit query and key on the same side (YOSO's expectation mode; q, k [..., Tq, D], [..., Tk, D] of unit rows,
    v [..., Tk, Dv]). The backward is YOSO's: with W = (dY v^T) * E, dq = W k * hash_bits / 2,
    dk = W^T q * hash_bits / 2, dv = E^T dY (a surrogate, not the derivative of E), as transformers trains it."""
    if q.ndim < 2 or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"lsh_expectation_attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                         "([..., Tq, D], [..., Tk, D], [..., Tk, Dv])")
    if int(hash_bits) != hash_bits or hash_bits < 1:
        raise ValueError(f"lsh_expectation_attention: hash_bits must be a positive integer, got {hash_bits!r}")
    return LshExpectationFn.apply(q, k, v, hash_bits=int(hash_bits))
