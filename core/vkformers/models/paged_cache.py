"""``PagedKVCache``: a KV cache whose memory follows the tokens held, in fixed-size blocks of a shared pool.

A :class:`BlockPool` owns, per layer, two persistent pools ``[blocks, kv_heads, page_size, head_dim]``. A
``PagedKVCache`` of ``batch`` rows gives each row a block table (its logical block j -> a pool block) and takes
blocks from the pool only as its rows store tokens (and LOOKAHEAD tokens more: a chain of replayed decode steps,
models/decode_capture.py, advances on the GPU without the host, and must not write past its table). Blocks of a row that hold only masked columns (a left-padded row's padding) point
to the pool's scratch block 0 instead, which no table owns: the write kernel skips it (it stays zero, so that
a masked read of it, weighted 0, never meets an infinity). When the pool runs out, ``KVBlocksExhausted`` says so (a server answers 503 or waits).

The cache has KVCache's interface (``attend``, ``advance``, ``step_arrays``, ...), so models and ``generate``'s
recorded decode steps run on it unchanged: one uint32 step tensor ``[start, end, tables]`` replaces KVCache's
bounds, and the decode attention reads keys and values through the tables (attention_decode.comp, PAGE_SIZE).
A chunked prefill gathers the stored blocks of each row (the embedding kernel) before attending.

Prefix caching: a block full of prompt tokens can be registered under a key that hashes every token up to its end
(and what else changes its keys and values: the weights, an adapter). A later prompt starting with the same tokens
takes those blocks into its table (:meth:`BlockPool.lookup`) instead of computing them. Blocks are counted by
reference; a registered block no row holds stays in the pool, reusable, until an allocation needs it (least
recently used first). Rows only ever append, past their shared blocks, so no row writes into a shared block.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.ops.cache import decode_attention_paged, write_kv_paged
from vkformers.engine.tensor import Tensor, tensor, zero_parameter
from vkformers.errors import VkformersError
from vkformers.models.cache import CacheFullError, KVCache
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import Device, get_device

PAGE_SIZE = 16  # tokens per block
LOOKAHEAD = 8   # tokens reserved past the stored ones: generate's longest chain of decode steps (8 on a GPU)
SCRATCH = 0     # the pool block that masked blocks and unused table entries point to


class KVBlocksExhausted(VkformersError, RuntimeError):
    """The KV block pool has no free block left."""


class BlockPool:
    """``blocks`` KV blocks of ``page_size`` tokens per layer (block 0: scratch, never handed out)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, blocks: int, page_size: int = PAGE_SIZE,
                 dtype="float32", device: Device | None = None):
        if int(blocks) < 2 or int(page_size) < 1:
            raise ValueError(f"BlockPool: blocks must be >= 2 and page_size >= 1, got {blocks}, {page_size}")
        self.num_layers, self.kv_heads, self.head_dim = int(num_layers), int(kv_heads), int(head_dim)
        self.blocks, self.page_size = int(blocks), int(page_size)
        self.dtype = dt.as_dtype(dtype)
        self.device = device or get_device()
        shape = (self.blocks, self.kv_heads, self.page_size, self.head_dim)
        self.keys = [zero_parameter(shape, self.dtype, self.device, f"k_pool.{i}") for i in range(self.num_layers)]
        self.values = [zero_parameter(shape, self.dtype, self.device, f"v_pool.{i}") for i in range(self.num_layers)]
        self._free = list(range(self.blocks - 1, SCRATCH, -1))  # popped from the end: 1, 2, ...
        self.refs = np.zeros(self.blocks, np.int64)  # rows holding each block
        self._cached: dict[bytes, int] = {}   # prefix key -> block
        self._key_of: dict[int, bytes] = {}   # block -> its prefix key
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered blocks no row holds, least recent first
        self.evictions = 0  # registered blocks taken back for new tokens

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: never used, or registered and held by no row (evicted when taken)."""
        return len(self._free) + len(self._idle)

    @property
    def used_blocks(self) -> int:
        return self.blocks - 1 - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._idle:
            block, _ = self._idle.popitem(last=False)
            del self._cached[self._key_of.pop(block)]
            self.evictions += 1
        else:
            raise KVBlocksExhausted(f"the KV cache's {self.blocks - 1} blocks of {self.page_size} tokens are all in "
                                    "use; wait for requests to finish or give the cache more blocks")
        self.refs[block] = 1
        return block

    def release(self, blocks) -> None:
        for block in (int(b) for b in blocks):
            if block == SCRATCH:
                continue
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def cached_prefix(self, keys) -> int:
        """How many of the leading ``keys`` are registered (nothing taken)."""
        count = 0
        while count < len(keys) and keys[count] in self._cached:
            count += 1
        return count

    def lookup(self, keys) -> list[int]:
        """The blocks registered under the leading ``keys`` (a prompt's block keys, in order), up to the first
        missing one, each now held once more by the caller."""
        found = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            self._idle.pop(block, None)
            self.refs[block] += 1
            found.append(block)
        return found

    def register(self, key: bytes, block: int) -> None:
        """Offer ``block`` (full of the tokens ``key`` hashes) to later prompts; a key already held keeps its
        block (this one stays private to its row)."""
        block = int(block)
        if key not in self._cached and block not in self._key_of and block != SCRATCH:
            self._cached[key] = block
            self._key_of[block] = key


def block_bytes(num_layers: int, kv_heads: int, head_dim: int, page_size: int, dtype) -> int:
    """Device bytes of one block in every layer, keys and values."""
    return 2 * num_layers * kv_heads * page_size * head_dim * dt.as_dtype(dtype).itemsize


def prefix_keys(tokens, page_size: int, salt: bytes = b"") -> list[bytes]:
    """The key of every full block of ``tokens``: a hash of ``salt`` and all the tokens up to the block's end."""
    tokens = np.asarray(tokens, np.int64)
    keys, key = [], hashlib.blake2b(salt, digest_size=16).digest()
    for end in range(page_size, len(tokens) + 1, page_size):
        key = hashlib.blake2b(key + tokens[end - page_size:end].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class PagedKVCache(KVCache):
    """``batch`` rows of up to ``max_len`` tokens (rounded up to whole blocks) over ``pool``."""

    paged = True

    def __init__(self, pool: BlockPool, batch: int, max_len: int):
        if int(batch) < 1 or int(max_len) < 1:
            raise ValueError(f"PagedKVCache: batch and max_len must be >= 1, got {batch}, {max_len}")
        self.pool = pool
        self.num_layers, self.batch, self.kv_heads = pool.num_layers, int(batch), pool.kv_heads
        self.head_dim, self.dtype, self.device = pool.head_dim, pool.dtype, pool.device
        self.page_size = pool.page_size
        self.table_stride = -(-int(max_len) // self.page_size)
        self.max_len = self.table_stride * self.page_size
        self.tables = np.full((self.batch, self.table_stride), SCRATCH, np.uint32)
        self.held = np.zeros((self.batch, self.table_stride), bool)  # entries that own a pool block
        self.dead = np.zeros(self.batch, bool)  # rows whose tokens are gone: they take no blocks (writes to scratch)
        self.mask = np.ones((self.batch, self.max_len), np.uint8)
        self.position = 0
        self.lookahead = LOOKAHEAD
        self._step = None
        self.step_hosts = (None, None)
        self.gather_host = None  # the last chunked prefill's tables input: a recorded prefill rewrites it
        self._own_fields = frozenset(self.__dict__) | {"_own_fields"}

    @property
    def keys(self):
        return self.pool.keys

    @property
    def values(self):
        return self.pool.values

    @property
    def blocks_held(self) -> int:
        return int(self.held.sum())

    def reset(self) -> None:
        """Forget the stored tokens and give the blocks back to the pool."""
        self.release_rows(range(self.batch))
        self.dead[:] = False
        super().reset()

    def release_rows(self, rows) -> None:
        """Give the blocks of ``rows`` back to the pool: their requests left, their outputs are no longer read.
        They take no blocks until place_row fills them again."""
        for row in rows:
            self.pool.release(self.tables[row][self.held[row]])
            self.tables[row] = SCRATCH
            self.held[row] = False
            self.dead[row] = True
        self._step = None

    def rewind(self, count: int) -> None:
        """KVCache.rewind, giving back the blocks past the kept tokens and LOOKAHEAD (a prompt padded to a prefill
        bucket took blocks for its padding)."""
        super().rewind(count)
        keep = -(-min(self.position + self.lookahead, self.max_len) // self.page_size)
        for row in range(self.batch):
            past = np.nonzero(self.held[row, keep:])[0] + keep
            if past.size:
                self.pool.release(self.tables[row, past])
                self.tables[row, past] = SCRATCH
                self.held[row, past] = False

    def place_row(self, source, source_row: int, row: int, rows: int = 1) -> None:
        """KVCache.place_row: ``source``'s stored tokens (a KVCache or a PagedKVCache) into rows ``row``.., ending
        at this cache's position, through blocks taken for them (their padding columns scratch)."""
        self.check_place(source, source_row, row, rows)
        count, end = source.position, self.position
        picked = slice(source_row, source_row + rows)
        self.release_rows(range(row, row + rows))
        self.dead[row:row + rows] = False
        self.mask[row:row + rows, :end - count] = 0
        self.mask[row:row + rows, end - count:end] = source.mask[picked, :count]
        self._reserve(end, range(row, row + rows))
        step = tensor(np.concatenate([np.array([end - count, end], np.uint32), self.tables.reshape(-1)]),
                      dtype=dt.uint32, device=self.device)
        for layer in range(self.num_layers):
            if getattr(source, "paged", False):
                keys = source._gather(source.keys[layer], count)[picked]
                values = source._gather(source.values[layer], count)[picked]
            else:
                keys = source.keys[layer][picked, :, :count]
                values = source.values[layer][picked, :, :count]
            write_kv_paged(self.pool.keys[layer], self.pool.values[layer], keys, values, step,
                           page_size=self.page_size, table_stride=self.table_stride, first_row=row)
        self.place_states(source, source_row, row, rows)
        self._step = None

    def share(self, row: int, blocks) -> None:
        """Row ``row``'s first table entries become ``blocks`` (already held for it, BlockPool.lookup): its leading
        tokens, computed for an earlier prompt. The row only appends after them."""
        blocks = np.asarray(blocks, np.uint32)
        if self.held[row, :len(blocks)].any():
            raise ValueError(f"PagedKVCache.share: row {row} already holds blocks")
        self.tables[row, :len(blocks)] = blocks
        self.held[row, :len(blocks)] = True
        self.dead[row] = False
        self._step = None

    def reserve(self, end: int) -> None:
        """Take the blocks the live rows need to hold ``end`` tokens (KVBlocksExhausted when the pool runs out;
        the blocks taken so far stay with their rows)."""
        self._reserve(end)

    def _reserve(self, end: int, rows=None) -> None:
        """Blocks for the live rows' columns up to ``end`` and LOOKAHEAD more; blocks wholly masked stay scratch."""
        ahead = -(-min(end + self.lookahead, self.max_len) // self.page_size)
        picked = slice(None) if rows is None else np.asarray(rows, np.int64)
        need = ~self.held[picked, :ahead]
        need[self.dead[picked]] = False
        full = min(end // self.page_size, ahead)  # blocks wholly before ``end``: padding only stays scratch
        if full:
            size = self.page_size
            need[:, :full] &= self.mask[picked, :full * size].reshape(-1, full, size).any(axis=2)
        order = np.arange(self.batch) if rows is None else picked
        for index, block in zip(*np.nonzero(need)):  # row by row, in ``rows`` order: as the pool hands them out
            row = order[index]
            self.tables[row, block] = self.pool.allocate()
            self.held[row, block] = True

    def compact(self) -> np.ndarray | None:
        """Drop the columns of wholly masked blocks (scratch entries: left padding, the gap of a prefix-cached
        layout) by moving table entries, not keys and values: each live row's blocks close up towards its last one,
        which stays last, and the columns every row had to spare go (a whole number of blocks). Returns the column
        map [batch, new position]: the old column each new one holds (-1: masked padding), or None when no block
        can go. Only for models whose attention and positions do not count columns (no sliding window, no ALiBi:
        the positions of the tokens are in the mask, whose counts do not change)."""
        page, live = self.page_size, np.nonzero(~self.dead)[0]
        used = -(-self.position // page)  # logical blocks of the stored columns
        if not len(live) or not used or not self.num_layers:  # (no key/value layer: the columns hold nothing)
            return None
        # a block holds tokens when it owns a pool block or has an unmasked column (a model whose layers write no
        # keys or values takes no blocks); the block of the last stored column stays, occupied or not
        occupied = self.held[:, :used] | self.mask[:, :used * page].reshape(self.batch, used, page).any(axis=2)
        drop = min(int(min(used - occupied[row].sum() for row in live)), used - 1)
        if drop <= 0:
            return None
        position = self.position - drop * page
        columns = np.full((self.batch, position), -1, np.int64)
        tables = np.full_like(self.tables, SCRATCH)
        held = np.zeros_like(self.held)
        mask = np.ones_like(self.mask)
        mask[:, :position] = 0
        old_columns = np.arange(self.max_len).reshape(-1, page)
        for row in live:
            kept = np.nonzero(occupied[row])[0]
            order = np.concatenate([kept, np.arange(used, self.table_stride)])  # then the blocks ahead
            first = used - drop - len(kept)  # scratch entries left before the row's blocks
            tables[row, first:first + len(order)] = self.tables[row, order]
            held[row, first:first + len(order)] = self.held[row, order]
            moved = old_columns[order].reshape(-1)
            mask[row, first * page:first * page + len(moved)] = self.mask[row, moved]
            columns[row, first * page:] = moved[:max(position - first * page, 0)]
        self.tables, self.held, self.mask, self.position, self._step = tables, held, mask, position, None
        return columns

    def shift_right(self, blocks: int) -> np.ndarray | None:
        """Move every row's columns ``blocks`` whole blocks right (masked padding before them) by moving table
        entries: room for a longer prompt to join, ending where the rows end. Returns the column map as compact's,
        or None when the blocks held ahead would pass max_len."""
        page, blocks = self.page_size, int(blocks)
        ahead = -(-min(self.position + self.lookahead, self.max_len) // page)
        if ahead + blocks > self.table_stride:
            return None
        keep = self.table_stride - blocks
        self.tables[:, blocks:], self.tables[:, :blocks] = self.tables[:, :keep].copy(), SCRATCH
        self.held[:, blocks:], self.held[:, :blocks] = self.held[:, :keep].copy(), False
        self.mask[:, blocks * page:], self.mask[:, :blocks * page] = self.mask[:, :keep * page].copy(), 0
        self.position += blocks * page
        self._step = None
        columns = np.arange(self.position) - blocks * page
        return np.broadcast_to(np.where(columns >= 0, columns, -1), (self.batch, self.position)).copy()

    def step_arrays(self, new: int, key_padding_mask=None):
        """KVCache.step_arrays with the step tensor ``[start, end, tables]`` in place of the bounds; takes the
        blocks the step writes."""
        start, end = self.position, self.position + new
        if end > self.max_len:
            raise CacheFullError(f"PagedKVCache: {start} stored + {new} new tokens exceed max_len {self.max_len}")
        self._store_mask(start, end, key_padding_mask)
        self._reserve(end)
        mask = None
        if not self.mask[:, :end].all():
            mask = (self.mask if new == 1 else self.mask[:, :end]).astype(bool)
        step = np.concatenate([np.array([start, end], np.uint32), self.tables.reshape(-1)])
        return step, mask

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, window: int = 0,
               softcap: float = 0.0, alibi_slopes: Tensor | None = None, key_padding_mask=None,
               return_lse: bool = False):
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"PagedKVCache: layer {layer} out of range 0..{self.num_layers - 1}")
        batch, heads, new, head_dim = q.shape
        expected = (self.batch, self.kv_heads, new, self.head_dim)
        if k.shape != expected or v.shape != expected or batch != self.batch or head_dim != self.head_dim:
            raise ValueError(f"PagedKVCache.attend: q {q.shape}, k {k.shape}, v {v.shape} do not fit the cache "
                             f"(k and v must be {expected})")
        step, mask = self.step_inputs(new, key_padding_mask)
        write_kv_paged(self.pool.keys[layer], self.pool.values[layer], k, v, step, page_size=self.page_size,
                       table_stride=self.table_stride)
        if new == 1:
            return self.attend_stored(layer, q, scale=scale, window=window, softcap=softcap,
                                      alibi_slopes=alibi_slopes, key_padding_mask=key_padding_mask,
                                      return_lse=return_lse)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        flags = dict(scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, key_padding_mask=mask,
                     return_lse=return_lse)
        if self.position == 0:
            return F.scaled_dot_product_attention(q, k.cast(self.dtype), v.cast(self.dtype), causal=True, **flags)
        end = self.position + new  # chunked prefill: every row's stored blocks gathered, then the new keys' too
        return F.scaled_dot_product_attention(q, self._gather(self.pool.keys[layer], end),
                                              self._gather(self.pool.values[layer], end), causal=True, **flags)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a row of ``tokens`` tokens takes (with LOOKAHEAD), at most."""
        return -(-min(tokens + self.lookahead, self.max_len) // self.page_size)

    def gather_tables(self, blocks: int) -> np.ndarray:
        """The rows' first ``blocks`` table entries as int32 [batch, blocks]: what a chunked prefill's gathers read."""
        return self.tables[:, :blocks].astype(np.int32)

    def _gather(self, pool: Tensor, end: int) -> Tensor:
        """[batch, kv_heads, end, head_dim]: each row's first ``end`` tokens, read through its block table (one
        tables input per forward, shared by its layers, which a recorded prefill rewrites)."""
        blocks = -(-end // self.page_size)
        shared = self._step[3] if self._step is not None else None  # within a forward (not place_row's copy)
        ids = shared.get(("tables", blocks)) if shared is not None else None
        if ids is None:
            ids = tensor(self.gather_tables(blocks), dtype=dt.int32, device=self.device)
            if shared is not None:  # the forward's layers share one input
                shared[("tables", blocks)], self.gather_host = ids, ids.lazy.base.host
        rows = F.embedding(ids, pool.reshape(self.pool.blocks, -1))  # [batch, blocks, kv_heads * page * dim]
        rows = rows.reshape(self.batch, blocks, self.kv_heads, self.page_size, self.head_dim).permute(0, 2, 1, 3, 4)
        return rows.contiguous().reshape(self.batch, self.kv_heads, blocks * self.page_size, self.head_dim)[:, :, :end]

    def attend_stored(self, layer: int, q: Tensor, *, scale: float | None = None, window: int = 0,
                      softcap: float = 0.0, alibi_slopes: Tensor | None = None, key_padding_mask=None,
                      return_lse: bool = False):
        step, mask = self.step_inputs(1, key_padding_mask)
        return decode_attention_paged(q, self.pool.keys[layer], self.pool.values[layer], step,
                                      page_size=self.page_size, table_stride=self.table_stride, scale=scale,
                                      window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                      key_padding_mask=mask, return_lse=return_lse)


__all__ = ["BlockPool", "KVBlocksExhausted", "PAGE_SIZE", "PagedKVCache", "block_bytes", "prefix_keys"]
