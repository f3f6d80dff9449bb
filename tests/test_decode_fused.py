"""Fused decode-step ops (engine/ops/decode.py) against float64 numpy: RMS norm folded into the
product, bias, residual, gated activations, and q/k/v with the rotary embedding and the KV-cache
write at a position read on the GPU.

Tolerances: float32 1e-4 relative to the output's scale (k up to 520 summed in float32); float16
and bfloat16 inputs are rounded to the storage type first and the result is rounded once, so the
bounds are a few units of the storage type's last place (float16 4e-3, bfloat16 3e-2 of the scale).
"""
import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.engine.kernels import decode as KD
from vkformers.engine.kernels import matmul as KM
from vkformers.engine.ops import decode as fused_ops
from vkformers.engine.ops.decode import (FusedNorm, fusable, fused_gated, fused_head_norm_rope_write, fused_linear,
                                        fused_qkv_rope_write)
from test_attention import rounded
from test_kernels_transformer import rope_reference

DTYPES = ["float32", "float16", "bfloat16"]
TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def make(rng, shape, dtype, scale=1.0):
    """(float64 values as stored, tensor)."""
    exact, host = rounded(rng.standard_normal(shape) * scale, dtype)
    return exact, vkf.tensor(host, dtype=dtype)


def rms(x, weight, eps, offset=False):
    w = 1.0 if weight is None else (1.0 + weight if offset else weight)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def check(got, want, dtype):
    """got: Tensor.numpy() (16-bit values come back widened to float32)."""
    got = np.asarray(got, np.float64)
    scale = max(1.0, np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale)


GPU_SHAPES = {"GPU shape": (4, 2, 1, 1), "GPU shape, a pair per subgroup": (4, 4, 1, 0),
              "GPU shape, k split, 2 pairs": (4, 2, 2, 1), "GPU shape, 4 pairs, 3 in flight": (2, 3, 4, 0)}


@pytest.fixture(params=["this device", *GPU_SHAPES])
def launch(request, monkeypatch, fused_decode_kernel):
    """The launch shape of this device, and a GPU's (several subgroups per workgroup, 2 to 4 loads in flight per lane,
    k split among them or one pair each, or (packed weights) 2 or 4 pairs together), so that lavapipe runs the code
    paths a GPU takes."""
    if request.param in GPU_SHAPES:
        monkeypatch.setattr(KD, "launch_shape", lambda device, rows=1, quant=None, kind="plain": GPU_SHAPES[request.param])
        lazy.clear_plan_cache()  # plans recorded with the other shape
    yield request.param
    lazy.clear_plan_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k, n", [(1, 64, 48), (3, 520, 37), (8, 256, 130)])
def test_fused_linear_with_norm_bias_and_residual(device, launch, dtype, rows, k, n):
    rng = np.random.default_rng(rows * k + n)
    x, xt = make(rng, (rows, 1, k), dtype)
    w, wt = make(rng, (n, k), dtype, 0.1)
    g, gt = make(rng, (k,), dtype)
    b, bt = make(rng, (n,), dtype)
    r, rt = make(rng, (rows, 1, n), dtype)
    with vkf.no_grad():
        assert fusable(xt, [wt], FusedNorm(gt, 1e-5))
        plain = fused_linear(xt, wt).numpy()
        full = fused_linear(xt, wt, norm=FusedNorm(gt, 1e-5), bias=bt, residual=rt, residual_scale=0.5).numpy()
        bare_norm = fused_linear(xt, wt, norm=FusedNorm(None, 1e-6)).numpy()
    check(plain, x @ w.T, dtype)
    check(full, r + 0.5 * (rms(x, g, 1e-5) @ w.T + b), dtype)
    check(bare_norm, rms(x, None, 1e-6) @ w.T, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_fused_gated_matches_act_gate_times_up(device, launch, dtype, activation):
    rng = np.random.default_rng(7)
    rows, k, n = 2, 128, 72
    x, xt = make(rng, (rows, 1, k), dtype)
    (wg, wgt), (wu, wut) = make(rng, (n, k), dtype, 0.2), make(rng, (n, k), dtype, 0.2)
    g, gt = make(rng, (k,), dtype, 0.1)
    (bg, bgt), (bu, but) = make(rng, (n,), dtype), make(rng, (n,), dtype)
    with vkf.no_grad():
        got = fused_gated(xt, wgt, wut, activation=activation, norm=FusedNorm(gt, 1e-6, unit_offset=True),
                          biases=[bgt, but]).numpy()
    h = rms(x, g, 1e-6, offset=True)
    gate, up = h @ wg.T + bg, h @ wu.T + bu
    from math import erf, sqrt
    acts = {"silu": lambda t: t / (1 + np.exp(-t)),
            "gelu": np.vectorize(lambda t: 0.5 * t * (1 + erf(t / sqrt(2)))),
            "gelu_tanh": lambda t: 0.5 * t * (1 + np.tanh(np.sqrt(2 / np.pi) * (t + 0.044715 * t ** 3)))}
    check(got, acts[activation](gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rot_dim, interleaved", [(16, 16, False), (16, 16, True), (16, 8, False),
                                                           (8, 4, True), (8, 0, False)])  # 0: a NoPE layer
def test_fused_qkv_rotates_and_writes_the_cache(device, launch, dtype, head_dim, rot_dim, interleaved):
    rng = np.random.default_rng(head_dim + rot_dim + interleaved)
    batch, heads, kv_heads, hidden, capacity, start = 3, 4, 2, 64, 6, 4
    x, xt = make(rng, (batch, 1, hidden), dtype)
    (wq, wqt), (wk, wkt), (wv, wvt) = (make(rng, (h * head_dim, hidden), dtype, 0.2)
                                       for h in (heads, kv_heads, kv_heads))
    biases = [make(rng, (h * head_dim,), dtype) for h in (heads, kv_heads, kv_heads)]
    g, gt = make(rng, (hidden,), dtype)
    positions = np.array([[4], [9], [70000]], np.int32)  # left padding: rows sit at different positions
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rot_dim, 2) / rot_dim)).astype(np.float32)
    stored, sentinel = rounded(np.full((batch, kv_heads, capacity, head_dim), 5.0), dtype)
    k_cache = vkf.parameter(sentinel, dtype=dtype, requires_grad=False)
    v_cache = vkf.parameter(sentinel, dtype=dtype, requires_grad=False)
    if interleaved:  # the three as row slices of one fused [q | k | v] weight (Phi-3's qkv_proj)
        fused = vkf.tensor(rounded(np.concatenate([wq, wk, wv]), dtype)[1], dtype=dtype)
        wqt, wkt, wvt = fused[:len(wq)], fused[len(wq):len(wq) + len(wk)], fused[len(wq) + len(wk):]
    with vkf.no_grad():
        q = fused_qkv_rope_write(xt, wqt, wkt, wvt, k_cache=k_cache, v_cache=v_cache,
                                 cache_start=vkf.tensor(np.array([start], np.uint32)),
                                 positions=vkf.tensor(positions), head_dim=head_dim,
                                 inv_freq=vkf.tensor(inv_freq) if rot_dim else None,
                                 attention_scaling=0.9, interleaved=interleaved, norm=FusedNorm(gt, 1e-6),
                                 biases=[b[1] for b in biases]).numpy()
        caches = k_cache.numpy(), v_cache.numpy()
    h = rms(x, g, 1e-6)[:, 0]

    def heads_of(w, b, count):  # [batch, count, 1, head_dim]
        return (h @ w.T + b).reshape(batch, count, 1, head_dim)
    rotate = lambda t: rope_reference(t, positions, inv_freq, rot_dim, interleaved, 0.9)
    check(q, rotate(heads_of(wq, biases[0][0], heads)), dtype)
    want_k, want_v = stored.copy(), stored.copy()
    want_k[:, :, start:start + 1] = rotate(heads_of(wk, biases[1][0], kv_heads))
    want_v[:, :, start:start + 1] = heads_of(wv, biases[2][0], kv_heads)
    check(caches[0], want_k, dtype)
    check(caches[1], want_v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_biases_one_per_row_or_none_beside_column_biases(device, launch, dtype):
    """A bias per row of x (an update computed beside the step: served LoRA adapters) added where the column bias
    goes, beside weights with a column bias or none, in each mode."""
    rng = np.random.default_rng(11)
    rows, hidden, head_dim, heads, kv_heads, capacity, start = 3, 64, 8, 4, 2, 5, 2
    x, xt = make(rng, (rows, 1, hidden), dtype)
    g, gt = make(rng, (hidden,), dtype)
    h = rms(x, g, 1e-6)
    norm = FusedNorm(gt, 1e-6)
    w, wt = make(rng, (40, hidden), dtype, 0.2)
    d, dt_ = make(rng, (rows, 1, 40), dtype)
    r, rt = make(rng, (rows, 1, 40), dtype)
    (wg, wgt), (wu, wut) = make(rng, (24, hidden), dtype, 0.2), make(rng, (24, hidden), dtype, 0.2)
    dg, dgt = make(rng, (rows, 1, 24), dtype)
    (wq, wqt), (wk, wkt), (wv, wvt) = (make(rng, (n * head_dim, hidden), dtype, 0.2) for n in (heads, kv_heads, kv_heads))
    dq, dqt = make(rng, (rows, 1, heads * head_dim), dtype)
    bv, bvt = make(rng, (kv_heads * head_dim,), dtype)
    positions = np.array([[3], [7], [1]], np.int32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    caches = [vkf.parameter(np.zeros((rows, kv_heads, capacity, head_dim), np.float32), dtype=dtype,
                            requires_grad=False) for _ in range(2)]
    with vkf.no_grad():
        plain = fused_linear(xt, wt, norm=norm, bias=dt_, residual=rt).numpy()
        gated = fused_gated(xt, wgt, wut, norm=norm, biases=[dgt, None]).numpy()
        q = fused_qkv_rope_write(xt, wqt, wkt, wvt, k_cache=caches[0], v_cache=caches[1],
                                 cache_start=vkf.tensor(np.array([start], np.uint32)), positions=vkf.tensor(positions),
                                 head_dim=head_dim, inv_freq=vkf.tensor(inv_freq), norm=norm,
                                 biases=[dqt, None, bvt]).numpy()
        k_cache, v_cache = (c.numpy() for c in caches)
    check(plain, r + h @ w.T + d, dtype)
    gate = h @ wg.T + dg
    check(gated, gate / (1 + np.exp(-gate)) * (h @ wu.T), dtype)
    rotate = lambda t: rope_reference(t, positions, inv_freq, head_dim, False, 1.0)  # noqa: E731
    by_head = lambda t, n: t.reshape(rows, n, 1, head_dim)  # noqa: E731
    check(q, rotate(by_head(h @ wq.T + dq, heads)), dtype)
    check(k_cache[:, :, start:start + 1], rotate(by_head(h @ wk.T, kv_heads)), dtype)
    check(v_cache[:, :, start:start + 1], by_head(h @ wv.T + bv, kv_heads), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rot_dim, interleaved, offset", [(16, 16, False, False), (16, 8, True, True),
                                                                   (8, 0, False, False)])
def test_head_norm_rope_write_normalises_each_head(device, dtype, head_dim, rot_dim, interleaved, offset):
    """Qwen3's q_norm / k_norm (one weight over each head's values), rotary and the cache write in one dispatch."""
    rng = np.random.default_rng(head_dim + rot_dim)
    batch, heads, kv_heads, capacity, start = 2, 4, 2, 5, 3
    q, qt = make(rng, (batch, 1, heads * head_dim), dtype, 3.0)
    (k, kt), (v, vt) = make(rng, (batch, 1, kv_heads * head_dim), dtype, 3.0), make(rng, (batch, 1, kv_heads * head_dim), dtype)
    (gq, gqt), (gk, gkt) = make(rng, (head_dim,), dtype), make(rng, (head_dim,), dtype)
    positions = np.array([[6], [70000]], np.int32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rot_dim, 2) / max(rot_dim, 1))).astype(np.float32)
    stored, sentinel = rounded(np.full((batch, kv_heads, capacity, head_dim), 5.0), dtype)
    k_cache, v_cache = (vkf.parameter(sentinel, dtype=dtype, requires_grad=False) for _ in range(2))
    with vkf.no_grad():
        got = fused_head_norm_rope_write(
            qt, kt, vt, q_norm=FusedNorm(gqt, 1e-6, offset), k_norm=FusedNorm(gkt, 1e-6, offset), k_cache=k_cache,
            v_cache=v_cache, cache_start=vkf.tensor(np.array([start], np.uint32)), head_dim=head_dim,
            positions=vkf.tensor(positions), inv_freq=vkf.tensor(inv_freq) if rot_dim else None,
            attention_scaling=0.8, interleaved=interleaved).numpy()
        caches = k_cache.numpy(), v_cache.numpy()

    def normed(x, g, count):  # [batch, count, 1, head_dim]
        return rms(x.reshape(batch, count, 1, head_dim), g, 1e-6, offset)
    rotate = lambda t: rope_reference(t, positions, inv_freq, rot_dim, interleaved, 0.8)  # noqa: E731
    check(got, rotate(normed(q, gq, heads)), dtype)
    want_k, want_v = stored.copy(), stored.copy()
    want_k[:, :, start:start + 1] = rotate(normed(k, gk, kv_heads))
    want_v[:, :, start:start + 1] = v.reshape(batch, kv_heads, 1, head_dim)
    check(caches[0], want_k, dtype)
    check(caches[1], want_v, dtype)


def test_fusable_refuses_what_the_kernel_cannot_take(device, fused_decode_kernel):
    x = vkf.tensor(np.zeros((9, 1, 64), np.float32))
    w = vkf.tensor(np.zeros((8, 64), np.float32))
    with vkf.no_grad():
        assert not fusable(x, [w])  # 9 rows
        assert not fusable(x[:2], [vkf.tensor(np.zeros((8, 64), np.float16))])  # mixed dtypes
        assert not fusable(vkf.tensor(np.zeros((1, 1, 66), np.float32)), [vkf.tensor(np.zeros((8, 66), np.float32))])
        assert not fusable(x[:2], [w.reshape(-1)[2:2 + 7 * 64].reshape(7, 64)])  # rows not on 16-byte vectors
        assert fusable(x[:2], [w[1:]])  # a row slice of a fused weight
        assert fusable(x[:2], [w])
    trainable = vkf.tensor(np.zeros((8, 64), np.float32), requires_grad=True)
    assert not fusable(x[:2], [trainable])  # a gradient is being recorded


def test_large_dense_weights_fuse_where_the_product_takes_the_small_m_kernel(device, monkeypatch,
                                                                              fused_decode_kernel):
    """The default on a GPU: weights fuse up to KD.MAX_ROWS rows, but with a cooperative matrix for their dtype a
    product whose largest weight has FUSED_DENSE_MAX_BYTES or more fuses only up to SMALL_M_MAX_COOPMAT_LINEAR rows
    (past it x @ W^T takes the skinny tiles, and the model composes the ordinary ops); forced on, up to KD.MAX_ROWS
    whatever the device and size."""
    monkeypatch.setattr(fused_ops, "enabled", None)
    monkeypatch.setattr(fused_ops, "FUSED_DENSE_MAX_BYTES", 8 * 64 * 2)  # an [8, 64] float16 weight's bytes
    monkeypatch.setitem(device.info, "type", "discrete-gpu")  # (only the choice is asked: nothing runs)
    x = vkf.tensor(np.zeros((KD.MAX_ROWS, 1, 64), np.float16))
    large, small = vkf.tensor(np.zeros((8, 64), np.float16)), vkf.tensor(np.zeros((7, 64), np.float16))
    limit = KM.SMALL_M_MAX_COOPMAT_LINEAR
    with vkf.no_grad():
        monkeypatch.setattr(KM, "coopmat_supported", lambda device, dtype: False)
        assert fusable(x, [large]) and fusable(x[:limit + 1], [large])
        monkeypatch.setattr(KM, "coopmat_supported", lambda device, dtype: True)
        assert fusable(x[:1], [large]) and fusable(x[:limit], [large])
        assert not fusable(x[:limit + 1], [large]) and not fusable(x, [large])
        assert not fusable(x, [small, large]) and fusable(x, [small, small])  # the largest weight counts
        monkeypatch.setattr(fused_ops, "enabled", True)
        assert fusable(x, [large])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_positions", [True, False])
def test_next_token_is_numpys_argmax_and_advances_the_step(device, dtype, with_positions):
    """decode_next_token.comp (chained greedy decoding): per row the argmax of a strided logits view (ties: the
    lowest index; a row of -inf: token 0), written to ids and to the step's slot of the history; positions and
    both cache bounds advance by one."""
    rows, vocab, stride, step = 3, 5000, 5008, 2
    rng = np.random.default_rng(0)
    exact, host = rounded(rng.standard_normal((rows, stride)) * 4, dtype)
    exact[0, [17, 4000]] = exact[0].max() + 1.0  # a tie: 17 wins
    exact[2, :] = -np.inf
    host = rounded(exact, dtype)[1]
    logits = device.upload(host, dtype=dtype)
    ids = device.upload(np.full(rows, -1, np.int32))
    positions = device.upload(np.array([5, 9, 11], np.int32))
    bounds = device.upload(np.array([7, 8], np.uint32))
    history = device.upload(np.full((step + 1) * rows, -1, np.int32))
    seq = device.sequence()
    KD.next_token(seq, logits, ids, bounds, history, rows=rows, vocab=vocab, row_stride=stride, step=step,
                  positions=positions if with_positions else None)
    seq.replay()
    want = np.argmax(exact[:, :vocab], axis=-1)
    assert want[0] == 17 and want[2] == 0
    np.testing.assert_array_equal(ids.read(), want)
    np.testing.assert_array_equal(history.read()[step * rows:], want)
    np.testing.assert_array_equal(history.read()[:step * rows], -1)
    np.testing.assert_array_equal(positions.read(), [6, 10, 12] if with_positions else [5, 9, 11])
    np.testing.assert_array_equal(bounds.read(), [8, 9])
