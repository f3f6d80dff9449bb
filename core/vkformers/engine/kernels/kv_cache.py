"""KV-cache write (shaders/common/kv_cache.comp): new keys and values into a persistent cache.

Layout: ``k_new``, ``v_new`` are [batch, kv_heads, rows, head_dim]; ``k_cache``, ``v_cache``
are [batch, kv_heads, capacity, head_dim]; all four of one dtype (float32, float16 or bfloat16;
the kernel copies raw bits). The first row written, ``start``, is a uint32 element of a
device buffer read by the kernel at every replay, so the same recorded dispatch serves
every decode position. Rows that would fall at or beyond ``capacity`` are dropped on the
GPU; callers that know the position on the host should check it there and raise.

Paged (``page_size`` > 0): the caches are pools of blocks [blocks, kv_heads, page_size, head_dim] and the rows of
sequence b go through its block table, ``table_stride`` uint32 entries at element ``table_offset`` of ``start``'s
buffer (``capacity``: the logical length, table_stride * page_size).
"""
from __future__ import annotations

from vkformers.engine.kernels import grid
from vkformers.engine.kernels.transformer_args import LOCAL_SIZE, checked, fits_uint32, positive

# Raw-copy variant per storage dtype.
VARIANTS = {"float32": "b32", "float16": "b16", "bfloat16": "b16"}


def kv_cache_write(seq, k_new, v_new, start, k_cache, v_cache, *, outer: int, rows: int, inner: int,
                   capacity: int, page_size: int = 0, heads: int = 1, table_offset: int = 0,
                   table_stride: int = 0) -> None:
    """Record ``cache[o, start + r, :] = new[o, r, :]`` for keys and values in one dispatch.

    outer: batch * kv_heads; rows: new tokens; inner: head_dim; capacity: the cache's max_len.
    ``start``: a uint32 (or int32) Operand, read on the GPU. Paged (``page_size`` > 0, see above): ``heads`` the
    kv heads of a sequence, the block tables at element ``table_offset`` of start's buffer.
    """
    positive(outer=outer, rows=rows, inner=inner, capacity=capacity)
    if rows > capacity:
        raise ValueError(f"kv_cache_write: {rows} new rows do not fit a cache of capacity {capacity}")
    count = outer * rows * inner
    k_new = checked(k_new, tuple(VARIANTS), count, "kv_cache_write k_new")
    dtype = k_new.dtype.name
    v_new = checked(v_new, dtype, count, "kv_cache_write v_new")
    if page_size:
        if outer % heads or table_stride * page_size != capacity:
            raise ValueError(f"kv_cache_write: paged capacity {capacity} must be table_stride {table_stride} x "
                             f"page_size {page_size}, outer {outer} a multiple of heads {heads}")
        pool = k_cache.buffer.count - k_cache.offset  # elements: whole blocks of heads * page_size * inner
        fits_uint32("kv_cache_write", pool)
        k_cache = checked(k_cache, dtype, heads * page_size * inner, "kv_cache_write k_cache")
        v_cache = checked(v_cache, dtype, heads * page_size * inner, "kv_cache_write v_cache")
        start = checked(start, ("uint32", "int32"), 1, "kv_cache_write start")
        if start.buffer.count < table_offset + (outer // heads) * table_stride:
            raise ValueError("kv_cache_write: the start buffer does not hold the block tables")
    else:
        fits_uint32("kv_cache_write", outer * capacity * inner)
        k_cache = checked(k_cache, dtype, outer * capacity * inner, "kv_cache_write k_cache")
        v_cache = checked(v_cache, dtype, outer * capacity * inner, "kv_cache_write v_cache")
        start = checked(start, ("uint32", "int32"), 1, "kv_cache_write start")
    x, y, _ = grid(count, LOCAL_SIZE, seq.device.limits["max_compute_work_group_count_x"])
    seq.dispatch(seq.device.kernel("kv_cache", VARIANTS[dtype]),
                 [k_new.buffer, v_new.buffer, start.buffer, k_cache.buffer, v_cache.buffer],
                 (x, y, 2),  # z: 0 keys, 1 values
                 push=[count, rows, inner, capacity, k_new.offset, v_new.offset, k_cache.offset, v_cache.offset,
                       start.offset, heads, table_offset, table_stride], spec=[int(page_size)])
