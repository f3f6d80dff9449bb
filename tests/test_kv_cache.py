"""KV cache: the write kernel (position read on the GPU), the tensor ops (write_kv, decode_attention)
and KVCache.attend (prefill, chunked prefill, decode) against the float64 attention reference of
test_attention.py over the whole sequence. Decode steps must replay one recorded plan.

Tolerances as test_attention.py: float32 1e-5 absolute (values of order 1), float16 3e-3,
bfloat16 2e-2 (inputs rounded to the storage type first, one rounding of the result).
"""

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.engine.kernels import Operand
from vkformers.engine.kernels.kv_cache import kv_cache_write
from vkformers.engine.ops.cache import decode_attention, write_kv
from vkformers.models.cache import CacheFullError, CropError, KVCache
from vkformers.runtime import dtypes as dt
from test_attention import FORWARD_TOL, Case, as_float, reference, rounded

RNG = np.random.default_rng(0)


# ------------------------------------------------------------ the kernel

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows, start", [(1, 0), (5, 3), (3, 9)])  # (3, 9): the last two rows fall off the end
def test_write_kernel_places_rows_at_the_gpu_position(device, dtype, rows, start):
    outer, inner, capacity = 3, 7, 10
    sentinel = np.full((outer, capacity, inner), 7.0)
    new_k, new_v = RNG.standard_normal((2, outer, rows, inner))
    host = lambda x: rounded(x, dtype)[1]
    k_cache, v_cache = device.upload(host(sentinel), dtype=dtype), device.upload(host(-sentinel), dtype=dtype)
    # the position sits at element 2 of a small uint32 buffer; the new rows at an offset of 4 elements
    start_buffer = device.upload(np.array([0, 0, start, 0], np.uint32))
    pad = lambda x: np.concatenate([np.zeros(4, host(x).dtype), host(x).reshape(-1)])
    k_src, v_src = device.upload(pad(new_k), dtype=dtype), device.upload(pad(new_v), dtype=dtype)
    seq = device.sequence()
    kv_cache_write(seq, Operand(k_src, 4), Operand(v_src, 4), Operand(start_buffer, 2), k_cache, v_cache,
                   outer=outer, rows=rows, inner=inner, capacity=capacity)
    seq.replay()
    for cache, new, fill in ((k_cache, new_k, sentinel), (v_cache, new_v, -sentinel)):
        want = rounded(fill, dtype)[0].copy()
        kept = min(rows, capacity - start)
        want[:, start:start + kept] = rounded(new, dtype)[0][:, :kept]
        np.testing.assert_array_equal(as_float(cache.read().reshape(want.shape), dtype), want)


def test_write_kernel_replays_at_new_positions(device):
    outer, inner, capacity = 2, 4, 6
    k_cache, v_cache = device.upload(np.zeros((outer, capacity, inner), np.float32)), \
        device.upload(np.zeros((outer, capacity, inner), np.float32))
    new = device.buffer((outer, 1, inner), "float32", host_visible=True)
    start = device.buffer(1, "uint32", host_visible=True)
    seq = device.sequence().upload(start).upload(new)
    kv_cache_write(seq, new, new, start, k_cache, v_cache, outer=outer, rows=1, inner=inner, capacity=capacity)
    want = np.zeros((outer, capacity, inner), np.float32)
    for position in (0, 1, 4, 5):  # one recording, replayed as the cache grows
        start.host[:] = position
        new.host[...] = RNG.standard_normal((outer, 1, inner))
        want[:, position:position + 1] = new.host
        seq.replay()
    np.testing.assert_array_equal(k_cache.read().reshape(want.shape), want)
    np.testing.assert_array_equal(v_cache.read().reshape(want.shape), want)


def test_write_kernel_checks_arguments(device):
    cache = device.buffer((1, 4, 2), "float32")
    new = device.buffer((1, 5, 2), "float32")
    start = device.upload(np.zeros(1, np.uint32))
    with pytest.raises(ValueError, match="do not fit"):
        kv_cache_write(device.sequence(), new, new, start, cache, cache, outer=1, rows=5, inner=2, capacity=4)
    with pytest.raises(TypeError, match="dtype"):
        kv_cache_write(device.sequence(), new, device.buffer(10, "float16"), start, cache, cache, outer=1, rows=1,
                       inner=2, capacity=4)


# ------------------------------------------------------------ tensor ops

def test_write_kv_and_decode_attention_ops(device):
    batch, heads, kv_heads, head_dim, max_len, length = 2, 4, 2, 16, 12, 7
    case = Case(batch=batch, heads=heads, kv_heads=kv_heads, q_len=length, kv_len=length, head_dim=head_dim,
                mask=True, window=5, softcap=3.0, alibi=True)
    q, k, v = (RNG.standard_normal((batch, h, length, head_dim)) for h in (heads, kv_heads, kv_heads))
    mask = np.ones((batch, max_len), np.uint8)
    mask[0, :2] = 0
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    zeros = np.zeros((batch, kv_heads, max_len, head_dim), np.float32)
    k_cache, v_cache = (vkf.parameter(zeros, requires_grad=False) for _ in range(2))
    write_kv(k_cache, v_cache, vkf.tensor(k[:, :, :length - 1]), vkf.tensor(v[:, :, :length - 1]),
             vkf.tensor(np.array([0], np.uint32), dtype="uint32"))
    write_kv(k_cache, v_cache, vkf.tensor(k[:, :, -1:]), vkf.tensor(v[:, :, -1:]),
             vkf.tensor(np.array([length - 1], np.uint32), dtype="uint32"))
    out, lse = decode_attention(vkf.tensor(q[:, :, -1:]), k_cache, v_cache,
                                vkf.tensor(np.array([length], np.uint32), dtype="uint32"), scale=head_dim ** -0.5,
                                key_padding_mask=vkf.tensor(mask.astype(bool)), window=5, softcap=3.0,
                                alibi_slopes=vkf.tensor(slopes.astype(np.float32)), return_lse=True)
    want, want_lse = reference(case, q, k, v, mask[:, :length], slopes)
    np.testing.assert_allclose(out.numpy(), want[:, :, -1:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse[:, :, -1:], atol=1e-5, rtol=1e-5)  # attention sinks read it
    np.testing.assert_allclose(k_cache.numpy()[:, :, :length], k, atol=1e-6)
    np.testing.assert_array_equal(k_cache.numpy()[:, :, length:], 0)


def test_write_kv_needs_a_persistent_cache():
    cache = vkf.zeros((1, 1, 4, 2))
    new = vkf.zeros((1, 1, 1, 2))
    with pytest.raises(ValueError, match="persistent"):
        write_kv(cache, cache, new, new, vkf.tensor(np.zeros(1, np.uint32), dtype="uint32"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_into_some_rows_and_place_row(dtype):
    """write_kv from first_row on touches only those rows; KVCache.place_row moves one sequence's stored tokens
    into a row of another cache so that they end at its position, masking the row's earlier columns."""
    layers, kv_heads, head_dim = 2, 2, 4
    host = lambda x: rounded(x, dtype)[0].astype(np.float32)  # values the cache's dtype holds exactly
    target = KVCache(layers, 3, kv_heads, head_dim, 12, dtype)
    source = KVCache(layers, 2, kv_heads, head_dim, 8, dtype)
    old = [host(RNG.standard_normal((3, kv_heads, 12, head_dim))) for _ in range(2 * layers)]
    for tensor, values in zip(target.keys + target.values, old):
        tensor.assign(vkf.tensor(values, dtype=dtype))
    new = [host(RNG.standard_normal((2, kv_heads, 5, head_dim))) for _ in range(2 * layers)]
    for layer in range(layers):
        write_kv(source.keys[layer], source.values[layer], vkf.tensor(new[layer], dtype=dtype),
                 vkf.tensor(new[layers + layer], dtype=dtype), vkf.tensor(np.zeros(1, np.uint32), dtype="uint32"))
    source.step_arrays(5, np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))  # row 0 holds a left-padded prompt
    source.advance(5)
    target.step_arrays(7)
    target.advance(7)
    target.place_row(source, 0, 2)
    lazy.realize([])
    for layer in range(layers):
        for tensor, before, placed in ((target.keys[layer], old[layer], new[layer]),
                                       (target.values[layer], old[layers + layer], new[layers + layer])):
            got = tensor.float().numpy()
            np.testing.assert_array_equal(got[:2], before[:2])          # other rows untouched
            np.testing.assert_array_equal(got[2, :, 2:7], placed[0])    # the 5 tokens end at position 7
            np.testing.assert_array_equal(got[2, :, :2], before[2, :, :2])
            np.testing.assert_array_equal(got[2, :, 7:], before[2, :, 7:])
    np.testing.assert_array_equal(target.mask[2], [0, 0, 0, 0, 1, 1, 1] + [1] * 5)
    np.testing.assert_array_equal(target.mask[:2], 1)
    with pytest.raises(ValueError, match="does not fit"):
        write_kv(target.keys[0], target.values[0], vkf.tensor(new[0]), vkf.tensor(new[0]),
                 vkf.tensor(np.zeros(1, np.uint32), dtype="uint32"), first_row=2)
    too_long = KVCache(layers, 1, kv_heads, head_dim, 16, dtype)
    too_long.step_arrays(9)
    too_long.advance(9)
    with pytest.raises(ValueError, match="do not fit"):
        target.place_row(too_long, 0, 0)


# ------------------------------------------------------------ KVCache.attend

def run_cache(cache: KVCache, case: Case, chunks, q, k, v, mask, slopes, dtype):
    """Feed the sequence in chunks (lengths), one layer; returns the outputs concatenated along T."""
    outs, start = [], 0
    for n in chunks:
        part = lambda x: vkf.tensor(x[:, :, start:start + n].astype(np.float32), dtype=dtype)
        out = cache.attend(0, part(q), part(k), part(v), scale=case.the_scale, window=case.window,
                           softcap=case.softcap, key_padding_mask=None if mask is None else mask[:, :start + n],
                           alibi_slopes=None if slopes is None else vkf.tensor(slopes.astype(np.float32)))
        outs.append(out.float().numpy())
        cache.advance(n)
        start += n
    return np.concatenate(outs, axis=2)


CACHE_CASES = {
    "gqa": Case(batch=2, heads=4, kv_heads=2, head_dim=16, q_len=9, kv_len=9),
    "left_padding": Case(batch=2, heads=2, kv_heads=1, head_dim=8, q_len=9, kv_len=9, mask=True),
    "window_softcap_alibi": Case(batch=1, heads=4, kv_heads=4, head_dim=32, q_len=9, kv_len=9, window=4,
                                 softcap=5.0, alibi=True),
}


@pytest.mark.parametrize("name", CACHE_CASES)
@pytest.mark.parametrize("chunks", [(5, 1, 1, 1, 1), (1, 1, 1, 1, 1, 1, 1, 1, 1), (4, 3, 1, 1)])
def test_attend_equals_attention_over_the_whole_sequence(name, chunks):
    case = CACHE_CASES[name]
    q, k, v = (RNG.standard_normal((case.batch, h, case.q_len, case.head_dim))
               for h in (case.heads, case.kv_heads, case.kv_heads))
    mask = None
    if case.mask:  # row 0 left-padded by 3
        mask = np.ones((case.batch, case.kv_len), np.uint8)
        mask[0, :3] = 0
    slopes = 2.0 ** (-8.0 * np.arange(1, case.heads + 1) / case.heads) if case.alibi else None
    cache = KVCache(1, case.batch, case.kv_heads, case.head_dim, max_len=13)
    got = run_cache(cache, case, chunks, q, k, v, mask, slopes, "float32")
    want = reference(case, q, k, v, mask, slopes)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert cache.position == case.q_len


@pytest.mark.parametrize("name", CACHE_CASES)
@pytest.mark.parametrize("chunks", [(5, 4), (3, 2, 3, 1), (2, 1, 6)])
def test_chunks_replay_attend_over_the_capacity_alike(name, chunks):
    """chunks_replay: several tokens after stored ones attend as a decode step (the stored count read on the GPU,
    a mask over the capacity) and give the whole sequence's attention."""
    case = CACHE_CASES[name]
    q, k, v = (RNG.standard_normal((case.batch, h, case.q_len, case.head_dim))
               for h in (case.heads, case.kv_heads, case.kv_heads))
    mask = None
    if case.mask:
        mask = np.ones((case.batch, case.kv_len), np.uint8)
        mask[0, :3] = 0
    slopes = 2.0 ** (-8.0 * np.arange(1, case.heads + 1) / case.heads) if case.alibi else None
    cache = KVCache(1, case.batch, case.kv_heads, case.head_dim, max_len=13)
    cache.chunks_replay = True
    got = run_cache(cache, case, chunks, q, k, v, mask, slopes, "float32")
    np.testing.assert_allclose(got, reference(case, q, k, v, mask, slopes)[0], atol=1e-5, rtol=1e-5)


def test_chunks_replay_splits_the_capacity_over_dispatches(monkeypatch):
    """On a CPU device the keys of several queries after a cache split over dispatches (llvmpipe's loop limit),
    each resuming from the last; the same result."""
    from vkformers.engine.kernels import attention
    monkeypatch.setattr(attention, "LOOP_ITERATIONS", 1000)
    assert attention.forward_keys_per_dispatch(attention.FORWARD_TILES[0], 16) < 100  # of 200
    case = CACHE_CASES["gqa"]
    q, k, v = (RNG.standard_normal((case.batch, h, case.q_len, case.head_dim))
               for h in (case.heads, case.kv_heads, case.kv_heads))
    cache = KVCache(1, case.batch, case.kv_heads, case.head_dim, max_len=200)
    cache.chunks_replay = True
    got = run_cache(cache, case, (4, 5), q, k, v, None, None, "float32")
    np.testing.assert_allclose(got, reference(case, q, k, v, None, None)[0], atol=1e-5, rtol=1e-5)


def test_chunks_replay_steps_replay_one_plan_and_crop_forgets_tokens():
    """Forwards of 3 tokens after stored ones build one graph at every position (a draft verified, then cropped
    to the tokens kept): after the first, each replays; crop forgets the rejected tokens, whose keys the next
    forward overwrites."""
    case = Case(batch=1, heads=4, kv_heads=2, head_dim=8, q_len=14, kv_len=14)
    q, k, v = (RNG.standard_normal((1, h, 20, case.head_dim)) for h in (case.heads, case.kv_heads, case.kv_heads))
    cache = KVCache(1, 1, case.kv_heads, case.head_dim, max_len=24)
    cache.chunks_replay = True
    kept = []  # the sequence's positions the cache holds, in order
    recorded, outs = [], []
    for start, n, keep in ((0, 4, 4), (4, 3, 1), (5, 3, 3), (8, 3, 2), (10, 3, 3)):
        # the chunk's first token follows the tokens kept; its rows of q, k, v come from positions start..
        out = cache.attend(0, *(vkf.tensor(x[:, :, start:start + n]) for x in (q, k, v)))
        cache.advance(n)
        outs.append((out.numpy(), list(kept) + list(range(start, start + n))))
        recorded.append(lazy.stats["recorded"])
        cache.crop(len(kept) + keep)
        kept += list(range(start, start + keep))
    assert recorded[2:] == [recorded[2]] * 3, recorded  # the first two forwards after the prompt record
    for got, positions in outs:
        sub = Case(batch=1, heads=4, kv_heads=2, head_dim=8, q_len=len(positions), kv_len=len(positions))
        want = reference(sub, *(x[:, :, positions] for x in (q, k, v)), None, None)[0]
        np.testing.assert_allclose(got, want[:, :, -got.shape[2]:], atol=1e-5)
    held = cache.position  # transformers' DynamicCache.crop: a length beyond the tokens held changes nothing, a
    cache.crop(99)         # negative one forgets that many
    assert cache.position == held
    cache.crop(-2)
    assert cache.position == held - 2
    with pytest.raises(CropError, match="cannot forget"):
        cache.crop(-held)  # (held - 2 are left)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attend_half_types(dtype):
    case = Case(batch=2, heads=4, kv_heads=2, head_dim=16, q_len=6, kv_len=6)
    (q, _), (k, _), (v, _) = (rounded(RNG.standard_normal((case.batch, h, case.q_len, case.head_dim)), dtype)
                              for h in (case.heads, case.kv_heads, case.kv_heads))
    cache = KVCache(1, case.batch, case.kv_heads, case.head_dim, max_len=8, dtype=dtype)
    got = run_cache(cache, case, (4, 1, 1), q, k, v, None, None, dtype)
    np.testing.assert_allclose(got, reference(case, q, k, v, None, None)[0], atol=FORWARD_TOL[dtype])


def test_decode_steps_replay_one_plan():
    case = Case(batch=2, heads=4, kv_heads=2, head_dim=8, q_len=12, kv_len=12, mask=True)
    q, k, v = (RNG.standard_normal((case.batch, h, case.q_len, case.head_dim))
               for h in (case.heads, case.kv_heads, case.kv_heads))
    mask = np.ones((case.batch, case.kv_len), np.uint8)
    mask[1, :2] = 0
    cache = KVCache(2, case.batch, case.kv_heads, case.head_dim, max_len=16)
    recorded = []
    for n in (4,) + (1,) * 8:
        start = cache.position
        part = lambda x: vkf.tensor(x[:, :, start:start + n])
        outs = [cache.attend(layer, part(q), part(k), part(v), key_padding_mask=mask[:, :start + n])
                for layer in range(2)]
        cache.advance(n)
        (outs[0] + outs[1]).numpy()
        recorded.append(lazy.stats["recorded"])
    # prefill and the first decode step record; every later decode step replays
    assert recorded[2:] == [recorded[2]] * len(recorded[2:]), recorded
    want = reference(case, q, k, v, mask, None)[0]
    last = (outs[0] + outs[1]).numpy()
    np.testing.assert_allclose(last, 2 * want[:, :, -1:], atol=1e-5)


def test_cache_errors():
    cache = KVCache(2, 1, 1, 4, max_len=3)
    x = vkf.zeros((1, 1, 2, 4))
    with pytest.raises(ValueError, match="do not fit"):
        cache.attend(0, x, vkf.zeros((1, 2, 2, 4)), x)
    with pytest.raises(IndexError):
        cache.attend(2, x, x, x)
    cache.attend(0, x, x, x)
    cache.advance(2)
    with pytest.raises(CacheFullError):
        cache.attend(0, x, x, x)
    with pytest.raises(ValueError, match="key_padding_mask"):
        KVCache(1, 1, 1, 4, max_len=3).attend(0, x, x, x, key_padding_mask=np.ones((1, 5)))
    cache.reset()
    assert cache.position == 0 and cache.keys[0].dtype is dt.float32


def test_reorder_rows_gives_each_row_the_one_named():
    """Beam search's step (models/beam_search.py): row i takes what row rows[i] held, keys, values and mask."""
    cache = KVCache(num_layers=2, batch=3, kv_heads=2, head_dim=4, max_len=5)
    rng = np.random.default_rng(0)
    keys = [rng.standard_normal((3, 2, 5, 4)).astype(np.float32) for _ in range(2)]
    values = [rng.standard_normal((3, 2, 5, 4)).astype(np.float32) for _ in range(2)]
    for held, array in zip(cache.keys + cache.values, keys + values):
        held.assign(vkf.tensor(array))
    cache.mask[1, :2] = 0
    cache.reorder_rows([1, 1, 0])
    for held, array in zip(cache.keys + cache.values, keys + values):
        np.testing.assert_array_equal(held.numpy(), array[[1, 1, 0]])
    assert cache.mask[:, :2].tolist() == [[0, 0], [0, 0], [1, 1]]
    with pytest.raises(ValueError, match="rows of 0..2"):
        cache.reorder_rows([0, 3, 1])
