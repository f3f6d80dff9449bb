"""The paged KV cache: the write and decode-attention kernels through block tables (PAGE_SIZE of kv_cache.comp and
attention_decode.comp) against the contiguous kernels on the same keys and values, and PagedKVCache under the llama
fixture's generate (greedy tokens identical to the contiguous cache's, padded batch), a chunked prefill, and the
blocks it takes and gives back."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import functional as F
from vkformers.engine.function import no_grad
from vkformers.engine.kernels import subgroups_are_full
from vkformers.engine.ops.cache import decode_attention, decode_attention_paged, write_kv, write_kv_paged
from vkformers.models import generation
from vkformers.models.cache import KVCache
from vkformers.models.paged_cache import LOOKAHEAD, BlockPool, KVBlocksExhausted, PagedKVCache
from vkformers.runtime import dtypes as dt

FIXTURES = Path(__file__).parent / "fixtures"
TOL = {"float32": 1e-6, "float16": 1e-3}


def scattered_tables(batch, stride, blocks, rng):
    """Each row's logical blocks at shuffled pool blocks (none at the scratch block 0)."""
    picked = rng.permutation(np.arange(1, blocks))[:batch * stride]
    return picked.reshape(batch, stride).astype(np.uint32)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, kv_len", [(4, 2, 8, 37), (2, 2, 16, 16), (6, 3, 32, 70)])
def test_paged_write_and_decode_attention_equal_the_contiguous_ones(dtype, heads, kv_heads, head_dim, kv_len):
    rng = np.random.default_rng(kv_len)
    batch, page, stride = 3, 16, 5
    max_len = page * stride
    blocks = batch * stride + 4
    tables = scattered_tables(batch, stride, blocks, rng)
    keys, values = rng.standard_normal((2, batch, kv_heads, kv_len, head_dim)).astype(np.float32)
    q = rng.standard_normal((batch, heads, 1, head_dim)).astype(np.float32)
    mask = np.ones((batch, max_len), bool)
    mask[1, :5] = False  # a left-padded row
    with no_grad():
        k_cache = vkf.parameter(np.zeros((batch, kv_heads, max_len, head_dim), np.float32), dtype, requires_grad=False)
        v_cache = vkf.parameter(np.zeros((batch, kv_heads, max_len, head_dim), np.float32), dtype, requires_grad=False)
        k_pool = vkf.parameter(np.zeros((blocks, kv_heads, page, head_dim), np.float32), dtype, requires_grad=False)
        v_pool = vkf.parameter(np.zeros((blocks, kv_heads, page, head_dim), np.float32), dtype, requires_grad=False)
        start = vkf.tensor(np.array([0], np.uint32), dtype=dt.uint32)
        step = vkf.tensor(np.concatenate([[0, kv_len], tables.reshape(-1)]).astype(np.uint32), dtype=dt.uint32)
        k, v = vkf.tensor(keys).cast(dtype), vkf.tensor(values).cast(dtype)
        write_kv(k_cache, v_cache, k, v, start)
        write_kv_paged(k_pool, v_pool, k, v, step, page_size=page, table_stride=stride)
        pool = k_pool.numpy().astype(np.float32)
        for row in range(batch):  # every key at its block's slot
            for key in range(kv_len):
                np.testing.assert_array_equal(pool[tables[row, key // page], :, key % page],
                                              k_cache.numpy().astype(np.float32)[row, :, key])
        kv_len_tensor = vkf.tensor(np.array([kv_len], np.uint32), dtype=dt.uint32)
        query, key_mask = vkf.tensor(q).cast(dtype), vkf.tensor(mask)
        want = decode_attention(query, k_cache, v_cache, kv_len_tensor, key_padding_mask=key_mask).float().numpy()
        got = decode_attention_paged(query, k_pool, v_pool, step, page_size=page, table_stride=stride,
                                     key_padding_mask=key_mask).float().numpy()
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_paged_decode_attention_skips_tiles_of_scratch_padding(dtype):
    """Left padding takes no blocks: its table entries are the scratch block 0, and the decode attention skips key
    tiles wholly in it (several tiles of the CPU's 64 keys and a GPU's 128 for row 0, one block for row 1), with
    the same result as the contiguous kernel over the masked columns."""
    rng = np.random.default_rng(7)
    batch, heads, kv_heads, head_dim, page, kv_len = 3, 4, 2, 16, 16, 400
    stride = kv_len // page
    blocks = batch * stride + 4
    tables = scattered_tables(batch, stride, blocks, rng)
    mask = np.ones((batch, kv_len), bool)
    for row, padding in ((0, 300), (1, 20)):
        mask[row, :padding] = False
        tables[row, :padding // page] = 0  # wholly masked blocks point to scratch
    keys, values = rng.standard_normal((2, batch, kv_heads, kv_len, head_dim)).astype(np.float32)
    q = rng.standard_normal((batch, heads, 1, head_dim)).astype(np.float32)
    with no_grad():
        caches = [vkf.parameter(np.zeros((batch, kv_heads, kv_len, head_dim), np.float32), dtype,
                                requires_grad=False) for _ in range(2)]
        pools = [vkf.parameter(np.zeros((blocks, kv_heads, page, head_dim), np.float32), dtype, requires_grad=False)
                 for _ in range(2)]
        step = vkf.tensor(np.concatenate([[0, kv_len], tables.reshape(-1)]).astype(np.uint32), dtype=dt.uint32)
        k, v = vkf.tensor(keys).cast(dtype), vkf.tensor(values).cast(dtype)
        write_kv(*caches, k, v, vkf.tensor(np.array([0], np.uint32), dtype=dt.uint32))
        write_kv_paged(*pools, k, v, step, page_size=page, table_stride=stride)
        assert not pools[0].numpy()[0].any()  # the scratch block stays zero
        query, key_mask = vkf.tensor(q).cast(dtype), vkf.tensor(mask)
        want = decode_attention(query, *caches, vkf.tensor(np.array([kv_len], np.uint32), dtype=dt.uint32),
                                key_padding_mask=key_mask).float().numpy()
        got = decode_attention_paged(query, *pools, step, page_size=page, table_stride=stride,
                                     key_padding_mask=key_mask).float().numpy()
    np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=0)


def llama(name="llama"):
    pytest.importorskip("vkformers_llama")
    return vkf.AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)


PADDED = np.array([[0, 0, 0, 5, 9, 14, 2, 33, 7, 1], [4, 8, 15, 16, 23, 42, 11, 3, 46, 12]])
PADDED_MASK = (np.arange(10) >= np.array([[3], [0]])).astype(np.int64)


@pytest.mark.parametrize("bucket", [0, 64])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_generate_on_a_paged_cache_gives_the_same_tokens(device, name, bucket, monkeypatch):
    """Greedy generate of a left-padded batch on the contiguous cache and on a paged one (blocks of 2 tokens, so
    that the 10-token prompts and 24 new tokens span many): identical tokens, the fused decode layer writing
    through the block tables (decode_matvec.comp's qkv mode; qwen3's QK-norm: decode_head_norm_rope.comp); the
    padded row's wholly masked block is scratch, and the cache holds blocks for its tokens only (and LOOKAHEAD)."""
    model = llama(name)
    want = model.generate(PADDED, attention_mask=PADDED_MASK, max_new_tokens=24)
    # a GPU pads the prompt to a prefill bucket of 64 and rewinds: the padding's blocks go back to the pool
    monkeypatch.setitem(generation.PREFILL_BUCKET, "cpu", bucket)
    pool = BlockPool(model.num_layers, model.num_kv_heads, model.head_dim, blocks=64, page_size=2)
    paged = PagedKVCache(pool, batch=2, max_len=64)
    writes = []
    for fused in ("fused_qkv_rope_write", "fused_head_norm_rope_write"):
        original = getattr(F, fused)
        monkeypatch.setattr(F, fused, lambda *a, _original=original, **k: (writes.append(k.get("page_size")),
                                                                           _original(*a, **k))[1])
    object.__setattr__(model, "_generation_cache", lambda batch, length, chunks_replay=False: (paged.reset(), paged)[1])
    try:
        got = model.generate(PADDED, attention_mask=PADDED_MASK, max_new_tokens=24)
    finally:
        object.__delattr__(model, "_generation_cache")
    np.testing.assert_array_equal(got, want)
    # (the ordinary ops compose the step where the fused kernel is not used: subgroups narrower than reported)
    assert set(writes) == ({2} if subgroups_are_full(device) else set())
    stored = paged.position  # 10 + 23 tokens (the last token is not fed back)
    assert stored == 33 and paged.tables[0, 0] == 0 and paged.tables[1, 0] != 0  # row 0: 3 columns of padding
    assert paged.blocks_held == 2 * -(-(stored + LOOKAHEAD) // 2) - 1 == pool.used_blocks
    paged.reset()
    assert pool.used_blocks == 0 and paged.blocks_held == 0


def test_chunked_prefill_and_decode_on_a_paged_cache():
    """A prompt prefilled in two chunks (the second attends to the first through the gathered blocks), then decode
    steps: the logits of the contiguous cache's."""
    model = llama()
    ids, mask = PADDED[:, :], PADDED_MASK
    positions = model.generation_positions(mask, ids, ids.shape[1])
    pool = BlockPool(model.num_layers, model.num_kv_heads, model.head_dim, blocks=32, page_size=4)
    caches = [KVCache(model.num_layers, 2, model.num_kv_heads, model.head_dim, 32), PagedKVCache(pool, 2, 32)]
    logits = []
    with no_grad():
        for cache in caches:
            model.prefill(ids[:, :6], mask[:, :6], positions[:, :6], cache)
            out = [model.prefill(ids[:, 6:], mask, positions[:, 6:], cache)]
            step_mask = mask
            for token in (5, 17):
                step_mask = np.concatenate([step_mask, np.ones((2, 1), mask.dtype)], axis=1)
                step_positions = model.generation_positions(step_mask, np.zeros_like(step_mask), 10)[:, -1:]
                result = model(np.full((2, 1), token, np.int32), attention_mask=step_mask,
                               position_ids=step_positions.astype(np.int32), cache=cache)
                out.append(result.logits.float().numpy()[:, -1])
            logits.append(out)
    for got, want in zip(logits[1], logits[0]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_blocks_follow_the_tokens_and_run_out_cleanly():
    pool = BlockPool(1, 1, 4, blocks=8, page_size=4)  # 7 usable blocks
    cache = PagedKVCache(pool, batch=2, max_len=32)
    cache.step_arrays(3)
    cache.advance(3)
    assert cache.blocks_held == 6 and pool.free_blocks == 1  # 3 + LOOKAHEAD tokens: 3 blocks a row
    with pytest.raises(KVBlocksExhausted, match="blocks of 4 tokens are all in use"):
        cache.step_arrays(6)
    cache.reset()
    assert pool.free_blocks == 7
    step, _ = cache.step_arrays(2)
    assert step[:2].tolist() == [0, 2] and len(step) == 2 + 2 * 8


def test_the_scratch_block_is_never_written():
    pool = vkf.parameter(np.zeros((3, 1, 2, 4), np.float32), "float32", requires_grad=False)
    values = vkf.parameter(np.zeros((3, 1, 2, 4), np.float32), "float32", requires_grad=False)
    step = vkf.tensor(np.array([0, 4, 0, 2], np.uint32), dtype=dt.uint32)  # logical block 0 -> scratch, 1 -> 2
    new = vkf.tensor(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4) + 1)
    with no_grad():
        write_kv_paged(pool, values, new, new, step, page_size=2, table_stride=2)
        stored = pool.numpy()
    assert not stored[0].any() and not stored[1].any()
    np.testing.assert_array_equal(stored[2, 0], new.numpy()[0, 0, 2:])


def test_compact_moves_the_columns_of_rows_that_hold_tokens_but_no_blocks():
    """A model whose layers write no keys or values (RWKV on a hybrid's cache) takes no blocks: compact finds a
    row's tokens in its mask and keeps them, as it keeps the blocks of a model that attends."""
    pool = BlockPool(2, 1, 4, blocks=8, page_size=4)
    cache = PagedKVCache(pool, batch=2, max_len=32)
    cache.position = 12
    cache.mask[0, :12] = [0] * 8 + [1] * 4  # one block of tokens after two of padding
    cache.mask[1, :12] = [0] * 4 + [1] * 8  # two blocks of tokens after one of padding
    columns = cache.compact()
    assert cache.position == 8 and cache.blocks_held == 0  # the one block both rows had to spare went
    assert columns.tolist() == [[-1] * 4 + list(range(8, 12)), list(range(4, 12))]
    assert cache.mask[:, :8].tolist() == [[0] * 4 + [1] * 4, [1] * 8]
