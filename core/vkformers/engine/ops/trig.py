"""acos composed of elementwise ops (no kernel of its own), accurate to 1.4e-7 absolute in float32 (within one ulp of
the correctly rounded value) wherever add and mul round to nearest, and its exact gradient."""
from __future__ import annotations

import math

from vkformers.engine.function import Function, no_grad, wrap
from vkformers.engine.ops.elementwise import where
from vkformers.runtime import dtypes as dt

# asin(u) = u + u w P(w), w = u^2 <= 1/4 (Cephes' asinf coefficients, relative error 6e-9 in exact arithmetic)
ASIN_COEFFICIENTS = (4.2163199048e-2, 2.4181311049e-2, 4.5470025998e-2, 7.4953002686e-2, 1.6666752422e-1)
# pi/2 and pi as hi + lo with hi a multiple of 2^-22, so hi - k u_hi below is exact for results up to 4
HALF_PI_HI = round(math.pi / 2 * 2 ** 22) / 2 ** 22
HALF_PI_LO = math.pi / 2 - HALF_PI_HI
PI_HI = round(math.pi * 2 ** 22) / 2 ** 22
PI_LO = math.pi - PI_HI


def _split(u):
    """Veltkamp's split: u_hi keeps the upper 12 bits of u's significand, so u_hi * u_hi is exact."""
    scaled = u * 4097.0
    return scaled - (scaled - u)


def _acos_float32(x):
    a = x.abs()
    near_zero = a <= 0.5
    # |x| <= 1/2: acos x = pi/2 - asin x; past it, acos |x| = 2 asin(sqrt(t)), t = (1 - |x|) / 2 (exact there),
    # and acos x = pi - acos |x| for x < 0
    t = (1.0 - a) * 0.5
    s = t.sqrt()
    u = where(near_zero, x, s)
    w = where(near_zero, x * x, t)
    u_hi = _split(u)
    # u = u_hi + u_lo: exact for x; for sqrt(t) the residual t - u_hi^2 is exact, so sqrt's rounding drops out
    u_lo = where(near_zero, u - u_hi, (t - u_hi * u_hi) / (u + u_hi + 1e-30))
    p = w * ASIN_COEFFICIENTS[0]
    for c in ASIN_COEFFICIENTS[1:-1]:
        p = (p + c) * w
    p = p + ASIN_COEFFICIENTS[-1]
    tail = u_lo + u * w * p
    positive = x > 0.0
    k = where(near_zero, -1.0, where(positive, 2.0, -2.0))
    hi = where(near_zero, HALF_PI_HI, where(positive, 0.0, PI_HI))
    lo = where(near_zero, HALF_PI_LO, where(positive, 0.0, PI_LO))
    # result = (hi + k u_hi) + (lo + k tail): the first sum is exact, so only the last addition rounds much
    result = (hi + k * u_hi) + (lo + k * tail)
    return where(a <= 1.0, result, math.nan)  # NaN outside [-1, 1] (and for NaN), as torch


class AcosFn(Function):
    def forward(self, x):
        self.saved = (x,)
        with no_grad():  # composed of tensor ops; the gradient below is the exact one
            xt = wrap(x)
            out = _acos_float32(xt if xt.dtype is dt.float32 else xt.cast(dt.float32))
            return (out if out.dtype is xt.dtype else out.cast(xt.dtype)).lazy

    def backward(self, g):
        x = wrap(self.saved[0])
        a = x.abs()
        one_minus_square = (1.0 - a) * (1.0 + a)  # 1 - x^2 without the cancellation of x * x near |x| = 1
        inside = one_minus_square > 0.0
        grad = -(g / where(inside, one_minus_square, 1.0).sqrt())
        # at x = +-1 torch gives g * -inf (-inf, +inf, or NaN for g = 0); past them NaN
        return where(inside, grad, where(one_minus_square == 0.0, g * -math.inf, math.nan))


def acos(x):
    """Elementwise arccos in radians, NaN outside [-1, 1] (as torch.acos); the gradient is -g / sqrt(1 - x^2)."""
    return AcosFn.apply(x)
