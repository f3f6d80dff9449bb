"""Transformer kernels on the device (lavapipe in CI) against numpy float64 references.

Tolerances: float32 outputs 1e-5 relative to the largest reference magnitude; float16 and
bfloat16 outputs are compared with a reference that rounds where the kernel rounds, within
2 units in the last place of the storage type (float16 2^-10, bfloat16 2^-7 relative to
the largest magnitude), since float32 and float64 math can land on either side of a rounding.
"""
import numpy as np
import pytest

from vkformers.engine.kernels import Operand
from vkformers.engine.kernels.adamw import adamw_scalars, adamw_step
from vkformers.engine.kernels.cross_entropy import cross_entropy, cross_entropy_backward
from vkformers.engine.kernels.embedding import embedding, embedding_backward
from vkformers.engine.kernels.norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward
from vkformers.engine.kernels.rope import rope
from vkformers.runtime.dtypes import from_bfloat16, to_bfloat16

DTYPES = ["float32", "float16", "bfloat16"]
ULP = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def round_to(x, dtype):
    """float64 values after a round trip through the storage dtype."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return from_bfloat16(to_bfloat16(x.astype(np.float32))).astype(np.float64)
    return x.astype(np.float32).astype(np.float64)


def upload(device, x, dtype):
    x = np.asarray(x)
    if dtype == "bfloat16":
        return device.upload(to_bfloat16(x.astype(np.float32)), dtype="bfloat16")
    return device.upload(x.astype(dtype))


def read(buf):
    x = buf.read()
    return from_bfloat16(x).astype(np.float64) if buf.dtype.name == "bfloat16" else x.astype(np.float64)


def assert_close(actual, expected, dtype, rel=None):
    """Within rel (default: 1e-5 for float32, 2 ulp of the storage type otherwise) of the largest |expected|."""
    rel = rel if rel is not None else (1e-5 if dtype == "float32" else 2 * ULP[dtype])
    scale = max(np.max(np.abs(expected)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rel * scale)


# ---------------------------------------------------------------- embedding

@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_forward_zero_rows_for_out_of_range_ids(device, dtype):
    rng = np.random.default_rng(0)
    vocab, dim = 50, 33
    table = round_to(rng.standard_normal((vocab, dim)), dtype)
    ids = np.array([3, 0, 49, -1, 50, 7, 3], np.int32)
    out = device.buffer((len(ids), dim), dtype)
    device.run(lambda s: embedding(s, upload(device, table, dtype), device.upload(ids), out,
                                   count=len(ids), dim=dim))
    expected = np.where(((ids >= 0) & (ids < vocab))[:, None], table[np.clip(ids, 0, vocab - 1)], 0.0)
    np.testing.assert_array_equal(read(out), expected)


def test_embedding_operand_offsets(device):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = np.array([99, 2, 5], np.int32)  # the first id is skipped by the offset
    out = device.upload(np.full(3 * 4, -1, np.float32))
    device.run(lambda s: embedding(s, Operand(device.upload(table.reshape(-1)), 4), Operand(device.upload(ids), 1),
                                   Operand(out, 4), count=2, dim=4, vocab=9))
    result = out.read()
    np.testing.assert_array_equal(result[:4], -1)
    np.testing.assert_array_equal(result[4:], table[1:][[2, 5]].reshape(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedding_backward_scatter_adds_into_existing_gradient(device, dtype):
    rng = np.random.default_rng(1)
    vocab, dim = 20, 37
    ids = np.array([4, 4, 0, 19, 4, 25, -3, 0], np.int32)  # repeats and out-of-range ids
    d_out = round_to(rng.standard_normal((len(ids), dim)), dtype)
    start = rng.standard_normal((vocab, dim)).astype(np.float32)
    d_table = device.upload(start)
    device.run(lambda s: embedding_backward(s, upload(device, d_out, dtype), device.upload(ids), d_table,
                                            count=len(ids), dim=dim))
    expected = start.astype(np.float64)
    for n, i in enumerate(ids):
        if 0 <= i < vocab:
            expected[i] += d_out[n]
    np.testing.assert_allclose(d_table.read(), expected, rtol=1e-6, atol=1e-6)


def test_embedding_backward_of_more_tokens_than_one_invocation_may_loop_over(device):
    """llvmpipe (lavapipe) ends an invocation's loops after 65535 iterations in all: an invocation walking every
    token of a column stopped short past that, leaving the later tokens' gradients out. The tokens, now split
    across dispatches, are still summed in token order: equal to float32 additions in that order, bit for bit."""
    rng = np.random.default_rng(2)
    vocab, dim, count = 5, 2, 70000
    ids = rng.integers(-1, vocab, count).astype(np.int32)
    d_out = rng.standard_normal((count, dim)).astype(np.float32)
    d_table = device.upload(np.zeros((vocab, dim), np.float32))
    device.run(lambda s: embedding_backward(s, device.upload(d_out), device.upload(ids), d_table, count=count,
                                            dim=dim, padding_idx=3))
    expected = np.zeros((vocab, dim), np.float32)
    keep = (ids >= 0) & (ids != 3)
    np.add.at(expected, ids[keep], d_out[keep])  # unbuffered: one float32 addition after another, in order
    np.testing.assert_array_equal(d_table.read(), expected)


def test_embedding_rejects_bad_arguments(device):
    table = device.buffer((10, 4), "float32")
    with pytest.raises(TypeError, match="int32"):
        embedding(device.sequence(), table, device.buffer(3, "float32"), device.buffer(12, "float32"), count=3, dim=4)
    with pytest.raises(ValueError, match="needs 16 elements"):
        embedding(device.sequence(), table, device.buffer(4, "int32"), device.buffer(12, "float32"), count=4, dim=4)


# ---------------------------------------------------------------- norms: numpy references

def rms_reference(x, w, eps, dtype, unit_offset=False, round_before_weight=None):
    if round_before_weight is None:
        round_before_weight = not unit_offset
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    x_hat = x * rstd
    if round_before_weight:
        x_hat = round_to(x_hat, dtype)
    scale = 1.0 if w is None else (1.0 + w if unit_offset else w)
    return x_hat * scale, rstd[:, 0]


def rms_backward_reference(dy, x, w, eps, unit_offset=False):
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    x_hat = x * rstd
    g = dy * (1.0 if w is None else (1.0 + w if unit_offset else w))
    dx = rstd * (g - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True))
    return dx, np.sum(dy * x_hat, axis=0)


def ln_reference(x, w, b, eps):
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    y = (x - mean) * rstd * (1.0 if w is None else w) + (0.0 if b is None else b)
    return y, mean[:, 0], rstd[:, 0]


def ln_backward_reference(dy, x, w, eps):
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    x_hat = (x - mean) * rstd
    g = dy * (1.0 if w is None else w)
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - x_hat * np.mean(g * x_hat, axis=-1, keepdims=True))
    return dx, np.sum(dy * x_hat, axis=0), np.sum(dy, axis=0)


def numeric_gradient(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = f()
        x[i] = old - eps
        down = f()
        x[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


def test_norm_and_cross_entropy_reference_gradients_match_finite_differences():
    """The analytic numpy gradients the kernels are tested against, checked in float64."""
    rng = np.random.default_rng(2)
    x, w, b, dy = rng.standard_normal((3, 7)), rng.standard_normal(7), rng.standard_normal(7), rng.standard_normal((3, 7))
    for unit_offset in (False, True):
        loss = lambda: np.sum(dy * rms_reference(x, w, 1e-5, "float64", unit_offset, False)[0])  # noqa: E731
        dx, dw = rms_backward_reference(dy, x, w, 1e-5, unit_offset)
        np.testing.assert_allclose(numeric_gradient(loss, x), dx, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(numeric_gradient(loss, w), dw, rtol=1e-6, atol=1e-8)
    loss = lambda: np.sum(dy * ln_reference(x, w, b, 1e-5)[0])  # noqa: E731
    dx, dw, db = ln_backward_reference(dy, x, w, 1e-5)
    for analytic, wrt in ((dx, x), (dw, w), (db, b)):
        np.testing.assert_allclose(numeric_gradient(loss, wrt), analytic, rtol=1e-6, atol=1e-8)
    logits, labels = rng.standard_normal((4, 9)), np.array([1, -100, 8, 0])
    loss = lambda: ce_reference(logits, labels)[2]  # noqa: E731
    np.testing.assert_allclose(numeric_gradient(loss, logits), ce_backward_reference(logits, labels, 1.0),
                               rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 4097), (33, 64)])
def test_rms_norm_forward(device, dtype, rows, cols):
    rng = np.random.default_rng(rows * cols)
    x = round_to(rng.standard_normal((rows, cols)) * 3, dtype)
    w = round_to(rng.standard_normal(cols), dtype)
    out, rstd = device.buffer((rows, cols), dtype), device.buffer(rows, "float32")
    device.run(lambda s: rms_norm(s, upload(device, x, dtype), upload(device, w, dtype), out, rstd,
                                  rows=rows, cols=cols, eps=1e-6))
    expected, expected_rstd = rms_reference(x, w, 1e-6, dtype)
    assert_close(read(out), round_to(expected, dtype), dtype)
    np.testing.assert_allclose(rstd.read(), expected_rstd, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_unit_offset_and_no_weight(device, dtype):
    rng = np.random.default_rng(3)
    rows, cols = 4, 300
    x = round_to(rng.standard_normal((rows, cols)), dtype)
    w = round_to(rng.standard_normal(cols) * 0.1, dtype)
    xb = upload(device, x, dtype)
    gemma, plain = device.buffer((rows, cols), dtype), device.buffer((rows, cols), dtype)
    rstd = device.buffer(rows, "float32")

    def build(s):
        rms_norm(s, xb, upload(device, w, dtype), gemma, rstd, rows=rows, cols=cols, eps=1e-6, unit_offset=True)
        rms_norm(s, xb, None, plain, rstd, rows=rows, cols=cols, eps=1e-6)
    device.run(build)
    # Gemma: (1 + w) multiplied in float32, rounded once.
    assert_close(read(gemma), round_to(rms_reference(x, w, 1e-6, dtype, unit_offset=True)[0], dtype), dtype)
    assert_close(read(plain), round_to(rms_reference(x, None, 1e-6, dtype)[0], dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,unit_offset", [(1, 1, False), (300, 67, False), (7, 4097, True)])
def test_rms_norm_backward(device, dtype, rows, cols, unit_offset):
    rng = np.random.default_rng(rows + cols)
    x = round_to(rng.standard_normal((rows, cols)), dtype)
    w = round_to(rng.standard_normal(cols), dtype)
    dy = round_to(rng.standard_normal((rows, cols)), dtype)
    xb, wb = upload(device, x, dtype), upload(device, w, dtype)
    out, rstd = device.buffer((rows, cols), dtype), device.buffer(rows, "float32")
    dx, dw = device.buffer((rows, cols), dtype), device.buffer(cols, "float32")

    def build(s):
        rms_norm(s, xb, wb, out, rstd, rows=rows, cols=cols, eps=1e-6, unit_offset=unit_offset,
                 round_before_weight=False)
        rms_norm_backward(s, upload(device, dy, dtype), xb, wb, rstd, dx, dw, rows=rows, cols=cols,
                          unit_offset=unit_offset, round_before_weight=False)
    device.run(build)
    expected_dx, expected_dw = rms_backward_reference(dy, x, w, 1e-6, unit_offset)
    # dx of a row of one column is ~0 (cancellation): judge it against the gradient's natural scale.
    rel = 1e-5 if dtype == "float32" else 4 * ULP[dtype]
    np.testing.assert_allclose(read(dx), expected_dx, rtol=0,
                               atol=rel * max(np.abs(expected_dx).max(), np.abs(dy).max()))
    np.testing.assert_allclose(dw.read(), expected_dw, rtol=0, atol=1e-5 * np.abs(expected_dw).max() + 1e-6)


def test_rms_norm_backward_accumulates_dweight_and_skips_dx(device):
    rng = np.random.default_rng(5)
    rows, cols = 40, 19
    x, w, dy = rng.standard_normal((rows, cols)), rng.standard_normal(cols), rng.standard_normal((rows, cols))
    start = rng.standard_normal(cols).astype(np.float32)
    xb, wb = device.upload(x.astype(np.float32)), device.upload(w.astype(np.float32))
    out, rstd, dw = device.buffer((rows, cols)), device.buffer(rows), device.upload(start)

    def build(s):
        rms_norm(s, xb, wb, out, rstd, rows=rows, cols=cols, eps=1e-5)
        rms_norm_backward(s, device.upload(dy.astype(np.float32)), xb, wb, rstd, None, dw, rows=rows, cols=cols,
                          accumulate=True)
    device.run(build)
    np.testing.assert_allclose(dw.read(), start + rms_backward_reference(dy, x, w, 1e-5)[1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- LayerNorm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,affine", [(1, 1, True), (3, 4097, True), (300, 45, False)])
def test_layer_norm_forward_and_backward(device, dtype, rows, cols, affine):
    rng = np.random.default_rng(rows * 7 + cols)
    x = round_to(rng.standard_normal((rows, cols)) * 2 + 1, dtype)
    w = round_to(rng.standard_normal(cols), dtype) if affine else None
    b = round_to(rng.standard_normal(cols), dtype) if affine else None
    dy = round_to(rng.standard_normal((rows, cols)), dtype)
    xb = upload(device, x, dtype)
    wb = upload(device, w, dtype) if affine else None
    bb = upload(device, b, dtype) if affine else None
    out, mean, rstd = device.buffer((rows, cols), dtype), device.buffer(rows), device.buffer(rows)
    dx = device.buffer((rows, cols), dtype)
    dw, db = (device.buffer(cols), device.buffer(cols)) if affine else (None, None)

    def build(s):
        layer_norm(s, xb, wb, bb, out, mean, rstd, rows=rows, cols=cols, eps=1e-5)
        layer_norm_backward(s, upload(device, dy, dtype), xb, wb, mean, rstd, dx, dw, db, rows=rows, cols=cols)
    device.run(build)
    expected, expected_mean, expected_rstd = ln_reference(x, w, b, 1e-5)
    assert_close(read(out), round_to(expected, dtype), dtype)
    np.testing.assert_allclose(mean.read(), expected_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd.read(), expected_rstd, rtol=1e-5)
    expected_dx, expected_dw, expected_db = ln_backward_reference(dy, x, w, 1e-5)
    rel = 1e-5 if dtype == "float32" else 4 * ULP[dtype]
    # dx multiplies (x - mean) by rstd; where the row's variance is ~0 (one column), rstd ~ 1/sqrt(eps) turns
    # one float32 rounding of x - mean into a visible error (4e-6 on the H200): allow exactly that much.
    rounding = np.abs(dy * (w if w is not None else 1)).max() * expected_rstd.max() * np.abs(x).max() * 2.0 ** -23
    np.testing.assert_allclose(read(dx), expected_dx, rtol=0,
                               atol=rel * max(np.abs(expected_dx).max(), np.abs(dy).max()) + rounding)
    if affine:
        np.testing.assert_allclose(dw.read(), expected_dw, rtol=0, atol=1e-5 * np.abs(expected_dw).max() + 1e-6)
        np.testing.assert_allclose(db.read(), expected_db, rtol=0, atol=1e-5 * np.abs(expected_db).max() + 1e-6)


def test_norm_rejects_mismatched_dtypes(device):
    x = device.buffer((2, 8), "float16")
    with pytest.raises(TypeError, match="weight"):
        rms_norm(device.sequence(), x, device.buffer(8, "float32"), device.buffer((2, 8), "float16"),
                 device.buffer(2), rows=2, cols=8, eps=1e-6)
    with pytest.raises(TypeError, match="rstd"):
        rms_norm(device.sequence(), x, None, device.buffer((2, 8), "float16"), device.buffer(2, "float16"),
                 rows=2, cols=8, eps=1e-6)


# ---------------------------------------------------------------- RoPE

def rope_reference(x, positions, inv_freq, rot_dim, interleaved, scaling, inverse=False):
    """x [b, h, s, d] float64; angle = float32(position * inv_freq) as HF computes it."""
    angle = (positions[:, None, :, None].astype(np.float32) * inv_freq.astype(np.float32)).astype(np.float64)
    cos, sin = np.cos(angle) * scaling, np.sin(angle) * scaling * (-1 if inverse else 1)
    out = x.copy()
    half = rot_dim // 2
    if interleaved:
        x1, x2 = x[..., 0:rot_dim:2], x[..., 1:rot_dim:2]
        out[..., 0:rot_dim:2], out[..., 1:rot_dim:2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., :half], x[..., half:rot_dim]
        out[..., :half], out[..., half:rot_dim] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (80, 32), (6, 2)])
def test_rope_forward(device, dtype, interleaved, head_dim, rot_dim):
    rng = np.random.default_rng(head_dim + rot_dim)
    batch, heads, seq_len = 2, 3, 5
    x = round_to(rng.standard_normal((batch, heads, seq_len, head_dim)), dtype)
    positions = np.array([[0, 1, 2, 3, 4], [7, 100, 4095, 70000, 131071]], np.int32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rot_dim, 2) / rot_dim)).astype(np.float32)
    out = device.buffer(x.shape, dtype)
    device.run(lambda s: rope(s, upload(device, x, dtype), device.upload(positions), device.upload(inv_freq), out,
                              batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, rot_dim=rot_dim,
                              interleaved=interleaved, attention_scaling=1.25))
    expected = rope_reference(x, positions, inv_freq, rot_dim, interleaved, 1.25)
    assert_close(read(out), round_to(expected, dtype), dtype)
    np.testing.assert_array_equal(read(out)[..., rot_dim:], x[..., rot_dim:])  # pass-through is exact


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_in_place_and_inverse_round_trip(device, interleaved):
    rng = np.random.default_rng(9)
    batch, heads, seq_len, head_dim, rot_dim = 1, 2, 3, 10, 8
    x = rng.standard_normal((batch, heads, seq_len, head_dim)).astype(np.float32)
    positions = np.array([[5, 6, 30000]], np.int32)
    inv_freq = (1.0 / 500000.0 ** (np.arange(0, rot_dim, 2) / rot_dim)).astype(np.float32)
    xb, pb, fb = device.upload(x), device.upload(positions), device.upload(inv_freq)
    args = dict(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, rot_dim=rot_dim,
                interleaved=interleaved, attention_scaling=0.5)
    device.run(lambda s: rope(s, xb, pb, fb, xb, **args))  # in place
    rotated = rope_reference(x.astype(np.float64), positions, inv_freq, rot_dim, interleaved, 0.5)
    assert_close(xb.read(), rotated, "float32")
    back = device.buffer(x.shape)
    device.run(lambda s: rope(s, xb, pb, fb, back, inverse=True, **args))  # the backward: R(-angle), same scale
    expected = rope_reference(rotated, positions, inv_freq, rot_dim, interleaved, 0.5, inverse=True)
    assert_close(back.read(), expected, "float32")
    np.testing.assert_allclose(back.read()[..., :rot_dim], 0.25 * x[..., :rot_dim], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_reads_x_through_its_strides(device, dtype, interleaved):
    """x as a projection leaves it, [batch, seq, heads, head_dim] at an offset, read as [batch, heads, seq, head_dim]
    through x_strides; the output is dense and equals the rotation of the transposed copy."""
    rng = np.random.default_rng(17)
    batch, heads, seq_len, head_dim, rot_dim, offset = 2, 3, 5, 12, 8, 7
    stored = round_to(rng.standard_normal((batch, seq_len, heads, head_dim)), dtype)
    positions = np.array([[0, 1, 2, 3, 4], [9, 10, 300, 4096, 65535]], np.int32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rot_dim, 2) / rot_dim)).astype(np.float32)
    flat = np.concatenate([np.zeros(offset), stored.reshape(-1)])
    out = device.buffer((batch, heads, seq_len, head_dim), dtype)
    device.run(lambda s: rope(s, Operand(upload(device, flat, dtype), offset), device.upload(positions),
                              device.upload(inv_freq), out, batch=batch, heads=heads, seq_len=seq_len,
                              head_dim=head_dim, rot_dim=rot_dim, interleaved=interleaved,
                              x_strides=(seq_len * heads * head_dim, head_dim, heads * head_dim)))
    x = stored.transpose(0, 2, 1, 3)
    assert_close(read(out), round_to(rope_reference(x, positions, inv_freq, rot_dim, interleaved, 1.0), dtype), dtype)
    np.testing.assert_array_equal(read(out)[..., rot_dim:], x[..., rot_dim:])


def test_rope_rejects_bad_rot_dim(device):
    x = device.buffer((1, 1, 1, 8))
    with pytest.raises(ValueError, match="rot_dim"):
        rope(device.sequence(), x, device.buffer(1, "int32"), device.buffer(8), x, batch=1, heads=1, seq_len=1,
             head_dim=8, rot_dim=10)


# ---------------------------------------------------------------- cross-entropy

def ce_reference(logits, labels, ignore_index=-100):
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]
    keep = labels != ignore_index
    picked = logits[np.arange(len(labels)), np.where(keep, labels, 0)]
    loss = np.where(keep, lse - picked, 0.0)
    return loss, lse, loss.sum() / keep.sum() if keep.any() else np.nan


def ce_backward_reference(logits, labels, d_loss, ignore_index=-100):
    _, lse, _ = ce_reference(logits, labels, ignore_index)
    keep = labels != ignore_index
    grad = np.exp(logits - lse[:, None])
    grad[np.arange(len(labels))[keep], labels[keep]] -= 1.0
    return np.where(keep[:, None], grad * d_loss / keep.sum(), 0.0)


def run_cross_entropy(device, logits, labels, dtype, d_loss=1.0, in_place=False):
    rows, vocab = logits.shape
    lb = upload(device, logits, dtype)
    yb = device.upload(labels.astype(np.int32))
    loss_rows, lse, mean, count = device.buffer(rows), device.buffer(rows), device.buffer(1), device.buffer(1)
    d_logits = lb if in_place else device.buffer((rows, vocab), dtype)

    def build(s):
        cross_entropy(s, lb, yb, loss_rows, lse, mean, count, rows=rows, vocab=vocab)
        cross_entropy_backward(s, lb, yb, lse, device.upload(np.array([d_loss], np.float32)), count, d_logits,
                               rows=rows, vocab=vocab)
    device.run(build)
    return loss_rows.read(), lse.read(), mean.read()[0], count.read()[0], read(d_logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_vocab_50k_with_ignored_rows(device, dtype):
    rng = np.random.default_rng(11)
    rows, vocab = 6, 50257
    logits = round_to(rng.standard_normal((rows, vocab)) * 4, dtype)
    logits[2, 123] = 40.0  # a dominant logit: the max subtraction must keep exp finite
    labels = np.array([5, -100, 123, vocab - 1, -100, 0])
    loss, lse, mean, count, d_logits = run_cross_entropy(device, logits, labels, dtype, d_loss=2.0)
    ref_loss, ref_lse, ref_mean = ce_reference(logits, labels)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=1e-5 * np.abs(ref_lse).max())
    assert count == 4
    np.testing.assert_allclose(mean, ref_mean, rtol=0, atol=1e-5 * np.abs(ref_lse).max())
    expected = ce_backward_reference(logits, labels, 2.0)
    rel = 1e-5 if dtype == "float32" else 2 * ULP[dtype]
    np.testing.assert_allclose(d_logits, expected, rtol=rel, atol=rel * np.abs(expected).max())
    assert not d_logits[[1, 4]].any()


def test_cross_entropy_single_row_in_place_and_all_ignored(device):
    logits = np.array([[0.5]])  # vocab 1: loss 0, gradient 0
    loss, _, mean, count, d_logits = run_cross_entropy(device, logits, np.array([0]), "float32", in_place=True)
    assert loss[0] == 0 and mean == 0 and count == 1 and d_logits[0, 0] == 0
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((3, 33))
    loss, _, mean, count, d_logits = run_cross_entropy(device, logits, np.full(3, -100), "float32")
    assert count == 0 and np.isnan(mean) and not loss.any() and not d_logits.any()


def test_cross_entropy_out_of_range_label_is_nan(device):
    logits = np.zeros((2, 8))
    loss, _, mean, _, d_logits = run_cross_entropy(device, logits, np.array([8, 1]), "float32")
    assert np.isnan(loss[0]) and loss[1] == pytest.approx(np.log(8)) and np.isnan(mean)
    assert np.isnan(d_logits[0]).all()


# ---------------------------------------------------------------- AdamW

def torch_adamw_reference(param, grad_steps, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW single-tensor update (amsgrad=False) transcribed to numpy float32."""
    p = param.astype(np.float32).copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    f32 = np.float32
    for step, g in enumerate(grad_steps, start=1):
        p *= f32(1 - lr * weight_decay)
        m += f32(1 - beta1) * (g - m)  # lerp(grad, 1 - beta1), weight < 0.5 branch
        v = v * f32(beta2) + f32(1 - beta2) * g * g
        step_size = lr / (1 - beta1 ** step)
        denom = np.sqrt(v) / f32((1 - beta2 ** step) ** 0.5) + f32(eps)
        p += f32(-step_size) * (m / denom)
    return p, m, v


@pytest.mark.parametrize("copy_dtype", [None, "float16", "bfloat16"])
def test_adamw_three_steps_match_torch_formula(device, copy_dtype):
    rng = np.random.default_rng(13)
    n = 1000
    param = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) * 10 ** rng.uniform(-4, 1, n).astype(np.float32)
             for _ in range(3)]
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    scalars = device.buffer(12, "uint32", host_visible=True)
    pb, gb = Operand(device.upload(np.concatenate([[7.0], param]).astype(np.float32)), 1), device.buffer(n)
    m, v = device.upload(np.zeros(n, np.float32)), device.upload(np.zeros(n, np.float32))
    copy = device.buffer(n, copy_dtype) if copy_dtype else None
    seq = device.sequence().upload(scalars)
    adamw_step(seq, scalars, pb, gb, m, v, count=n, model_copy=copy)
    for step, g in enumerate(grads, start=1):  # one recording, replayed with new scalars and gradients
        scalars.host[:] = adamw_scalars(step=step, beta1=hp["beta1"], beta2=hp["beta2"], lr=hp["lr"],
                                        eps=hp["eps"], weight_decay=hp["weight_decay"])
        gb.write(g)
        seq.replay()
    ref_p, ref_m, ref_v = torch_adamw_reference(param, grads, **hp)
    p = pb.buffer.read()
    assert p[0] == 7.0
    np.testing.assert_allclose(p[1:], ref_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m.read(), ref_m, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(v.read(), ref_v, rtol=1e-6, atol=1e-20)
    if copy_dtype:
        np.testing.assert_array_equal(read(copy), round_to(p[1:], copy_dtype))


@pytest.mark.parametrize("grad_dtype", ["float16", "bfloat16"])
def test_adamw_reads_16_bit_gradients_times_a_device_factor(device, grad_dtype):
    """A 16-bit gradient is read as stored (no float32 copy) and multiplied by a float32 element from the GPU
    (a clipping factor): the update equals the float32 formula on the widened gradient times that factor."""
    rng = np.random.default_rng(14)
    n, factor = 777, np.float32(0.37)
    param = rng.standard_normal(n).astype(np.float32)
    grad = round_to(rng.standard_normal(n), grad_dtype).astype(np.float32)
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    scalars = device.upload(adamw_scalars(step=1, **hp))
    pb, m, v = (device.upload(x) for x in (param, np.zeros(n, np.float32), np.zeros(n, np.float32)))
    gb = upload(device, grad, grad_dtype)
    copy = device.buffer(n, grad_dtype)
    factor_buf = Operand(device.upload(np.array([5.0, factor], np.float32)), 1)
    seq = device.sequence()
    adamw_step(seq, scalars, pb, gb, m, v, count=n, model_copy=copy, grad_factor=factor_buf)
    seq.replay()
    ref_p, ref_m, ref_v = torch_adamw_reference(param, [grad * factor], **hp)
    np.testing.assert_allclose(pb.read(), ref_p, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(m.read(), ref_m, rtol=1e-6, atol=1e-12)
    np.testing.assert_array_equal(read(copy), round_to(pb.read(), grad_dtype))
    with pytest.raises(ValueError, match="grad_factor and param overlap|param and grad_factor overlap"):
        adamw_step(device.sequence(), scalars, pb, gb, m, v, count=n, grad_factor=Operand(pb, 5))
    with pytest.raises(TypeError, match="model copy"):
        adamw_step(device.sequence(), scalars, pb, gb, m, v, count=n, model_copy=device.buffer(n, "float16"
                   if grad_dtype == "bfloat16" else "bfloat16"))


def test_adamw_rejects_overlapping_state(device):
    buf = device.buffer(20)
    with pytest.raises(ValueError, match="overlap"):
        adamw_step(device.sequence(), device.buffer(12, "uint32"), Operand(buf, 0), device.buffer(10),
                   Operand(buf, 5), device.buffer(10), count=10)
