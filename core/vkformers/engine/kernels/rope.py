"""Rotary position embedding (shaders/common/rope.comp).

x and out are [batch, heads, seq_len, head_dim] of one dtype (float32, float16, bfloat16); out is dense, x
may have any strides over its first three dims (``x_strides``: a projection's [batch, seq_len, heads, head_dim]
output permuted, read without a copy);
positions int32 [batch, seq_len]; inv_freq float32 [rot_dim / 2] (from
vkformers.engine.rope_scaling.rope_parameters). The first rot_dim dims of each head rotate;
the others pass through. cos/sin are computed in float32 from the float32 angle
position * inv_freq (as HF) and multiplied by attention_scaling; the result is rounded to
the storage type once (HF rounds cos/sin to the activation dtype first, then computes in it).
``inverse=True`` rotates by -angle: the backward (dx from dy) is the same call with it.
``out`` may be ``x`` itself (same buffer and offset): in place.
"""
from __future__ import annotations

from vkformers.engine.kernels.transformer_args import (
    checked, element_groups, element_variant, fits_uint32, operand, overlaps, positive)


def rope(seq, x, positions, inv_freq, out, *, batch: int, heads: int, seq_len: int, head_dim: int, rot_dim: int,
         interleaved: bool = False, attention_scaling: float = 1.0, inverse: bool = False,
         x_strides: tuple[int, int, int] | None = None):
    """out = rotate(x) by position * inv_freq; interleaved: pairs (2i, 2i+1) instead of (i, i + rot_dim/2)."""
    positive(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, rot_dim=rot_dim)
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rope: rot_dim must be even and <= head_dim ({head_dim}), got {rot_dim}")
    vectors = batch * heads * seq_len
    count = vectors * head_dim
    dense = (heads * seq_len * head_dim, seq_len * head_dim, head_dim)
    x_strides = dense if x_strides is None else tuple(int(s) for s in x_strides)
    if len(x_strides) != 3 or min(x_strides) < 0:
        raise ValueError(f"rope: x_strides must be three non-negative strides (batch, heads, seq), got {x_strides}")
    span = sum((n - 1) * s for n, s in zip((batch, heads, seq_len), x_strides)) + head_dim
    fits_uint32("rope", max(count, span))
    x = checked(x, ("float32", "float16", "bfloat16"), span, "rope x")
    out = checked(out, x.dtype.name, count, "rope out")
    positions = checked(positions, "int32", batch * seq_len, "rope positions")
    inv_freq = checked(inv_freq, "float32", rot_dim // 2, "rope inv_freq")
    in_place = operand(x) == operand(out)
    if in_place and x_strides != dense:
        raise ValueError("rope: in place needs a dense x")
    if not in_place and overlaps(x, span, out, count):
        raise ValueError("rope: out partially overlaps x; use the same operand (in place) or disjoint memory")
    per_vector = rot_dim // 2 + (0 if in_place else head_dim - rot_dim)
    kernel = seq.device.kernel("rope", element_variant(x, "rope x"))
    seq.dispatch(kernel, [x.buffer, positions.buffer, inv_freq.buffer, out.buffer],
                 element_groups(seq, vectors * per_vector),
                 push=[vectors, heads, seq_len, head_dim, rot_dim, float(attention_scaling),
                       x.offset, positions.offset, inv_freq.offset, out.offset, *x_strides],
                 spec=[int(interleaved), int(inverse), int(in_place)])
