"""Pooling along the sequence: windows of positions averaged, composed of views and means."""
from __future__ import annotations

from vkformers.engine.ops.elementwise import cat


def avg_pool1d(x, stride: int):
    """Means of consecutive windows of ``stride`` positions of x [batch, length, channels]; a last window past the end
    averages the positions it holds (torch's avg_pool with kernel = stride and ceil_mode=True, no padding)."""
    if len(x.shape) != 3:
        raise ValueError(f"avg_pool1d: x must be [batch, length, channels], got {x.shape}")
    if int(stride) != stride or stride < 1:
        raise ValueError(f"avg_pool1d: stride must be a positive integer, got {stride!r}")
    batch, length, channels = x.shape
    full = length // stride
    parts = []
    if full:
        parts.append(x[:, :full * stride].contiguous().reshape(batch, full, stride, channels).mean(2))
    if length % stride:
        parts.append(x[:, full * stride:].mean(1, keepdim=True))
    return parts[0] if len(parts) == 1 else cat(parts, 1)
