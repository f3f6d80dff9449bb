"""Matrix functions composed of batched products: their gradients follow from those of the products."""
from __future__ import annotations

import numpy as np

from vkformers.engine.function import constant

PINV_SCALINGS = ("global", "per_matrix")


def iterative_pinv(a, iterations: int = 6, scaling: str = "global"):
    """An approximate Moore-Penrose inverse of the square matrices a [..., n, n] by the cubic Newton-Schulz
    iteration Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4 (Razavi et al., the Nyströmformer's), from
    Z0 = A^T / c, c the largest column sum of A (A is row-stochastic there: nonnegative) over every matrix of the
    batch (``"global"``, as the Nyströmformer's original code) or over each matrix (``"per_matrix"``)."""
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"iterative_pinv: a must be [..., n, n], got {a.shape}")
    if scaling not in PINV_SCALINGS:
        raise ValueError(f"iterative_pinv: scaling must be one of {PINV_SCALINGS}, got {scaling!r}")
    n = a.shape[-1]
    column_sums = a.sum(-2)                                       # [..., n]
    if scaling == "global":
        largest = column_sums.reshape(-1).max(0)
    else:
        largest = column_sums.max(-1, keepdim=True).reshape(*a.shape[:-2], 1, 1)
    z = a.transpose(-2, -1) * largest.reciprocal()
    eye = constant(np.eye(n, dtype=np.float32)).cast(a.dtype)
    for _ in range(iterations):
        az = a @ z
        z = (z * 0.25) @ (eye * 13.0 - az @ (eye * 15.0 - az @ (eye * 7.0 - az)))
    return z
