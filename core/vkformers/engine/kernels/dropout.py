"""Launcher of dropout.comp: out = x * keep / (1 - p), keep drawn by a counter-based RNG.

The seed is not a push constant but two uint32 words in a small buffer, read at
run time: ``seed_buffer[seed_slot]`` = seed, ``seed_buffer[seed_slot + 1]`` =
counter base (an offset into the random stream). A recorded training step thus
gets a new mask each replay by rewriting that buffer. The backward pass is the
same call on dy (same seed buffer, slot, stream, p and count): it regenerates the
forward mask instead of storing it. ``stream`` (a push constant) separates
dropout sites that share one seed.
"""
from __future__ import annotations

from vkformers.engine.kernels import grid, operand, require_elements

LOCAL_SIZE = 256
VARIANT_PREFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
SEED_DTYPES = ("uint32", "int32")


def keep_threshold(p: float) -> int:
    """An element is kept when its 32 random bits are >= this (so P(keep) = 1 - p)."""
    return min(round(p * 2**32), 2**32 - 1)


def dropout(seq, x, out, seed_buffer, *, p: float, count: int, seed_slot: int = 0, stream: int = 0) -> None:
    """out[i] = x[i] / (1 - p) where kept, else 0, over ``count`` contiguous elements."""
    x, out, seeds = operand(x), operand(out), operand(seed_buffer)
    p, count = float(p), int(count)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if count < 0:
        raise ValueError(f"dropout: negative count {count}")
    if x.dtype.name not in VARIANT_PREFIX:
        raise TypeError(f"dropout: dtype {x.dtype.name} is not supported (supported: {', '.join(VARIANT_PREFIX)})")
    if out.dtype != x.dtype:
        raise TypeError(f"dropout: output dtype {out.dtype.name} differs from input {x.dtype.name}")
    if seeds.dtype.name not in SEED_DTYPES:
        raise TypeError(f"dropout: the seed buffer must be uint32 or int32, not {seeds.dtype.name}")
    if seed_slot < 0 or not 0 <= stream < 2**32:
        raise ValueError(f"dropout: seed_slot must be >= 0 and stream a uint32, got {seed_slot}, {stream}")
    require_elements(seeds, seed_slot + 2, "dropout seed buffer (seed, counter base)")
    require_elements(x, count, "dropout input")
    require_elements(out, count, "dropout output")
    if count == 0:
        return
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    groups = grid(count, LOCAL_SIZE, seq.device.limits["max_compute_work_group_count_x"])
    seq.dispatch(seq.device.kernel("dropout", VARIANT_PREFIX[x.dtype.name]), [seeds.buffer, x.buffer, out.buffer],
                 groups, push=[count, x.offset, out.offset, seeds.offset + seed_slot, keep_threshold(p), scale,
                               stream])
