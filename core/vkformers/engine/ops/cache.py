"""KV-cache ops on tensors: write new keys/values into a persistent cache, and decode attention.

Both read their position from a small uint32 tensor uploaded with the step instead of
baking it into the recorded commands. Consecutive decode steps therefore build graphs of
the same signature and replay one recorded plan (engine/lazy.py), whatever the position.
Inference only: neither op has a gradient.

The paged forms (``write_kv_paged``, ``decode_attention_paged``) keep keys and values in pools of fixed-size blocks
[blocks, kv_heads, page_size, head_dim]; one uint32 step tensor holds ``[start, end, block tables...]`` (each
sequence's logical block j -> a pool block), uploaded with the step like the contiguous cache's bounds.
"""
from __future__ import annotations

import math

from vkformers.engine.function import KernelOp, node, wrap
from vkformers.engine.kernels import attention as KA
from vkformers.engine.kernels import Operand
from vkformers.engine.kernels import kv_cache as KV
from vkformers.runtime import dtypes as dt


class KVCacheWrite(KernelOp):
    """ins: k_new, v_new, start, k_cache (old), v_cache (old); outs: the caches' new versions (in place).
    ``first_row``: the cache's batch row that k_new's first row goes to."""

    name = "kv_cache_write"

    def emit(self, seq, outs, ins):
        (k_cache, v_cache), (k_new, v_new, start, _, _) = outs, ins
        batch, kv_heads, rows, head_dim = k_new.shape
        if self.page_size:  # start: the step tensor [start, end, tables]
            step = start.operand
            KV.kv_cache_write(seq, k_new.operand, v_new.operand, step, k_cache.operand, v_cache.operand,
                              outer=batch * kv_heads, rows=rows, inner=head_dim,
                              capacity=self.table_stride * self.page_size, page_size=self.page_size, heads=kv_heads,
                              table_offset=step.offset + 2 + self.first_row * self.table_stride,
                              table_stride=self.table_stride)
            return
        skip = self.first_row * kv_heads * k_cache.shape[2] * head_dim
        k_out = Operand(k_cache.operand.buffer, k_cache.operand.offset + skip)
        v_out = Operand(v_cache.operand.buffer, v_cache.operand.offset + skip)
        KV.kv_cache_write(seq, k_new.operand, v_new.operand, start.operand, k_out, v_out,
                          outer=batch * kv_heads, rows=rows, inner=head_dim, capacity=k_cache.shape[2])


def write_kv(k_cache, v_cache, k_new, v_new, start, first_row: int = 0) -> None:
    """``k_cache[r:r+B, :, s:s+T] = k_new`` and the same for v, with ``s = start[0]`` read on the GPU and
    ``r = first_row``.

    k_cache, v_cache: persistent tensors (``vkformers.parameter``) [batch, kv_heads, max_len, head_dim];
    k_new, v_new: [B, kv_heads, T, head_dim] (B = batch, or fewer rows from ``first_row`` on: one sequence
    moved into a running batch); start: a uint32 tensor of one element (a view of a larger one is fine).
    The caches' tensors are updated in place: later reads of them in the same graph see the new rows; the
    write runs with the next realization.
    """
    for cache, new, what in ((k_cache, k_new, "k"), (v_cache, v_new, "v")):
        if not cache.lazy.base.persistent:
            raise ValueError(f"write_kv: the {what} cache must be a persistent tensor (vkformers.parameter)")
        if new.ndim != 4 or new.shape[1] != cache.shape[1] or new.shape[3] != cache.shape[3] \
                or not 0 <= first_row or first_row + new.shape[0] > cache.shape[0]:
            raise ValueError(f"write_kv: new {what} {new.shape} from row {first_row} does not fit the cache "
                             f"{cache.shape}")
    if k_new.shape != v_new.shape:
        raise ValueError(f"write_kv: k {k_new.shape} and v {v_new.shape} differ")
    if start.numel() != 1 or start.dtype not in (dt.uint32, dt.int32):
        raise TypeError(f"write_kv: start must be one uint32 element, got {start.shape} {start.dtype.name}")
    k_new, v_new = k_new.cast(k_cache.dtype), v_new.cast(v_cache.dtype)
    op = KVCacheWrite(first_row=int(first_row), page_size=0)
    k_out, v_out = node(op, [k_new.lazy, v_new.lazy, start.reshape(1).lazy, k_cache.lazy, v_cache.lazy],
                        [(k_cache.shape, k_cache.dtype), (v_cache.shape, v_cache.dtype)],
                        into=[k_cache.lazy, v_cache.lazy])
    k_cache._set_lazy(k_out)
    v_cache._set_lazy(v_out)


def write_kv_paged(k_pool, v_pool, k_new, v_new, step, *, page_size: int, table_stride: int,
                   first_row: int = 0) -> None:
    """Store k_new, v_new ([B, kv_heads, T, head_dim]) at logical positions step[0].. of sequences first_row..
    through their block tables (``step``: uint32 [2 + sequences * table_stride], see above) into the pools
    (persistent [blocks, kv_heads, page_size, head_dim]). In place, like write_kv."""
    for pool, new, what in ((k_pool, k_new, "k"), (v_pool, v_new, "v")):
        if not pool.lazy.base.persistent:
            raise ValueError(f"write_kv_paged: the {what} pool must be a persistent tensor (vkformers.parameter)")
        if new.ndim != 4 or pool.ndim != 4 or new.shape[1] != pool.shape[1] or new.shape[3] != pool.shape[3] \
                or pool.shape[2] != page_size:
            raise ValueError(f"write_kv_paged: new {what} {new.shape} does not fit the pool {pool.shape}")
    if k_new.shape != v_new.shape:
        raise ValueError(f"write_kv_paged: k {k_new.shape} and v {v_new.shape} differ")
    if step.dtype != dt.uint32 or step.numel() < 2 + (first_row + k_new.shape[0]) * table_stride:
        raise ValueError(f"write_kv_paged: step must be uint32 [start, end, tables of {table_stride} entries], got "
                         f"{step.shape} {step.dtype.name}")
    k_new, v_new = k_new.cast(k_pool.dtype), v_new.cast(v_pool.dtype)
    op = KVCacheWrite(first_row=int(first_row), page_size=int(page_size), table_stride=int(table_stride))
    k_out, v_out = node(op, [k_new.lazy, v_new.lazy, step.lazy, k_pool.lazy, v_pool.lazy],
                        [(k_pool.shape, k_pool.dtype), (v_pool.shape, v_pool.dtype)],
                        into=[k_pool.lazy, v_pool.lazy])
    k_pool._set_lazy(k_out)
    v_pool._set_lazy(v_out)


class DecodeAttention(KernelOp):
    """ins: q, k_cache, v_cache, kv_len [, key padding mask] [, alibi slopes]; out: [B, H, T, D] (T = q's)."""

    name = "attention_decode"

    def emit(self, seq, outs, ins):
        (out, *lse), (q, k_cache, v_cache, kv_len, *extra) = outs, ins
        mask = extra.pop(0).operand if self.has_mask else None
        slopes = extra.pop(0).operand if self.has_alibi else None
        batch, heads, q_len, head_dim = q.shape
        _, kv_heads, max_len, _ = k_cache.shape
        kv_len = kv_len.operand
        if self.page_size:  # the step tensor [start, end, tables]: kv_len is its second element
            max_len = self.table_stride * self.page_size
            kv_len = Operand(kv_len.buffer, kv_len.offset + 1)
        KA.attention_decode(seq, q.operand, k_cache.operand, v_cache.operand, out.operand, batch=batch, heads=heads,
                            kv_heads=kv_heads, kv_len=None, max_len=max_len, head_dim=head_dim, scale=self.scale,
                            kv_len_buffer=kv_len, key_padding_mask=mask, window=self.window,
                            softcap=self.softcap, alibi_slopes=slopes, lse=lse[0].operand if lse else None,
                            page_size=self.page_size, q_len=q_len)


def decode_attention(q, k_cache, v_cache, kv_len, *, scale: float | None = None, key_padding_mask=None,
                     window: int = 0, softcap: float = 0.0, alibi_slopes=None, return_lse: bool = False):
    """Attention of the new queries of each row over the first ``kv_len`` entries of the caches.

    q: [batch, heads, T, head_dim]; k_cache, v_cache: [batch, kv_heads, max_len, head_dim];
    kv_len: a uint32 tensor of one element, read on the GPU (query i sits at position kv_len - T + i, causal,
    and the new keys must already be in the cache); key_padding_mask: bool/uint8 [batch, max_len],
    1 = attend. Returns [batch, heads, T, head_dim] in q's dtype (and with ``return_lse`` the logsumexp of
    each row's scores, float32 [batch, heads, T]). T > 1 (a draft's tokens verified after the cache): the
    graph is the same at every position, as a decode step's, so that it replays.
    """
    batch, heads, q_len, head_dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"decode_attention: caches {k_cache.shape}, {v_cache.shape} do not fit q {q.shape}")
    if kv_len.numel() != 1 or kv_len.dtype not in (dt.uint32, dt.int32):
        raise TypeError(f"decode_attention: kv_len must be one uint32 element, got {kv_len.shape} {kv_len.dtype.name}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    dtype = k_cache.dtype
    extra = []
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, k_cache.shape[2]):
            raise ValueError(f"decode_attention: key_padding_mask must be [batch, max_len] "
                             f"({batch}, {k_cache.shape[2]}), got {key_padding_mask.shape}")
        extra.append(key_padding_mask.lazy)
    if alibi_slopes is not None:
        extra.append(alibi_slopes.float().lazy)
    op = DecodeAttention(scale=scale, window=int(window), softcap=float(softcap),
                         has_mask=key_padding_mask is not None, has_alibi=alibi_slopes is not None, page_size=0)
    outs = node(op, [q.cast(dtype).lazy, k_cache.lazy, v_cache.lazy, kv_len.reshape(1).lazy, *extra],
                [((batch, heads, q_len, head_dim), dtype)] + ([((batch, heads, q_len), dt.float32)] if return_lse
                                                               else []))
    return tuple(wrap(o) for o in outs) if return_lse else wrap(outs[0])


def decode_attention_paged(q, k_pool, v_pool, step, *, page_size: int, table_stride: int, scale: float | None = None,
                           key_padding_mask=None, window: int = 0, softcap: float = 0.0, alibi_slopes=None,
                           return_lse: bool = False):
    """decode_attention over paged pools (see above): the query of row b at logical position step[1] - 1 against
    its first step[1] keys, read through its block table. key_padding_mask: [batch, table_stride * page_size]."""
    batch, heads, q_len, head_dim = q.shape
    max_len = table_stride * page_size
    if q_len != 1:
        raise ValueError(f"decode_attention_paged: one query per row, got q_len {q_len}")
    if k_pool.shape != v_pool.shape or k_pool.ndim != 4 or k_pool.shape[2] != page_size or k_pool.shape[3] != head_dim:
        raise ValueError(f"decode_attention_paged: pools {k_pool.shape}, {v_pool.shape} do not fit q {q.shape} and "
                         f"page_size {page_size}")
    if step.dtype != dt.uint32 or step.numel() < 2 + batch * table_stride:
        raise ValueError(f"decode_attention_paged: step must be uint32 [start, end, {batch} tables of {table_stride} "
                         f"entries], got {step.shape} {step.dtype.name}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    dtype = k_pool.dtype
    extra = []
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, max_len):
            raise ValueError(f"decode_attention_paged: key_padding_mask must be [batch, max_len] ({batch}, {max_len}), "
                             f"got {key_padding_mask.shape}")
        extra.append(key_padding_mask.lazy)
    if alibi_slopes is not None:
        extra.append(alibi_slopes.float().lazy)
    op = DecodeAttention(scale=scale, window=int(window), softcap=float(softcap), has_mask=key_padding_mask is not None,
                         has_alibi=alibi_slopes is not None, page_size=int(page_size), table_stride=int(table_stride))
    outs = node(op, [q.cast(dtype).lazy, k_pool.lazy, v_pool.lazy, step.lazy, *extra],
                [((batch, heads, 1, head_dim), dtype)] + ([((batch, heads, 1), dt.float32)] if return_lse else []))
    return tuple(wrap(o) for o in outs) if return_lse else wrap(outs[0])
