"""Transformer ops through the engine (autograd included): numpy forward references and
float64 finite-difference gradients, as in test_engine.py."""
import math

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import functional as F
from test_engine import GRAD_TOL, RNG, check, numeric_grad


def np_rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def test_rms_norm():
    check(lambda x, w: F.rms_norm(x, w, eps=1e-6), np_rms_norm, (3, 5, 8), (8,))


def test_rms_norm_unit_offset():
    check(lambda x, w: F.rms_norm(x, w, eps=1e-6, unit_offset=True), lambda x, w: np_rms_norm(x, 1 + w), (4, 6), (6,))


def test_layer_norm():
    check(lambda x, w, b: F.layer_norm(x, w, b), np_layer_norm, (4, 7), (7,), (7,))


def test_linear_and_gated_mlp():
    def np_silu(x):
        return x / (1 + np.exp(-x))
    check(lambda x, wg, wu: F.gated(F.linear(x, wg), F.linear(x, wu), "silu"),
          lambda x, wg, wu: np_silu(x @ wg.T) * (x @ wu.T), (3, 4), (5, 4), (5, 4))


def test_embedding_forward_and_backward():
    table = RNG.standard_normal((11, 4)).astype(np.float32)
    ids = np.array([[1, 3, 3], [10, 0, 1]], np.int32)
    t = vkf.tensor(table, requires_grad=True)
    out = F.embedding(vkf.tensor(ids), t)
    np.testing.assert_array_equal(out.numpy(), table[ids])
    w = RNG.standard_normal(out.shape)
    (out * vkf.tensor(w)).sum().backward()
    expected = np.zeros_like(table, dtype=np.float64)
    np.add.at(expected, ids.reshape(-1), w.reshape(-1, 4))
    np.testing.assert_allclose(t.grad.numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padding_idx", [3, -8])  # -8: row 3 of 11, counted from the end as torch does
def test_embedding_padding_idx_passes_no_gradient_to_its_row(padding_idx):
    """torch.nn.Embedding(padding_idx=p): the forward reads row p like any other, the backward skips its lookups."""
    table = RNG.standard_normal((11, 4)).astype(np.float32)
    ids = np.array([[3, 1, 3], [10, 3, 1]], np.int32)
    t = vkf.tensor(table, requires_grad=True)
    out = F.embedding(vkf.tensor(ids), t, padding_idx=padding_idx)
    np.testing.assert_array_equal(out.numpy(), table[ids])
    w = RNG.standard_normal(out.shape)
    (out * vkf.tensor(w)).sum().backward()
    expected = np.zeros_like(table, dtype=np.float64)
    np.add.at(expected, ids.reshape(-1), w.reshape(-1, 4))
    expected[3] = 0
    np.testing.assert_allclose(t.grad.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_embedding_looked_up_only_at_padding_idx_gets_zero_gradient_and_weight_decay():
    """As in PyTorch: a parameter in the graph whose gradient is all zero has grad zeros, not None, so AdamW
    still decays it: p * (1 - lr * weight_decay), the Adam term being 0 / (0 + eps) = 0."""
    from vkformers.models.layers import Embedding
    from vkformers.optim import AdamW
    embedding = Embedding(6, 4, padding_idx=0)
    table = RNG.standard_normal((6, 4)).astype(np.float32)
    embedding.load_state_dict({"weight": table})
    (embedding(vkf.tensor(np.zeros((2, 3), np.int32))) * 2.0).sum().backward()
    assert embedding.weight.grad is not None
    np.testing.assert_array_equal(embedding.weight.grad.numpy(), np.zeros_like(table))
    AdamW([embedding.weight], lr=0.1, weight_decay=0.5).step()
    np.testing.assert_allclose(embedding.weight.numpy(), table * np.float32(1 - 0.1 * 0.5), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_take_along_last_matches_torch_gather_and_sums_repeated_picks(dtype, tol):
    """torch.gather(x, -1, index.expand(...)) with one [R, J] index for every leading slice (DeBERTa's relative
    positions): odd sizes, clamped indices that pick one element several times (their gradients add up), and an
    index outside [0, C), which reads zero and passes nothing back."""
    x = RNG.standard_normal((2, 3, 5, 7)).astype(np.float32)
    index = np.clip(np.arange(5)[:, None] - np.arange(6)[None, :] + 3, 0, 6).astype(np.int32)  # [5, 6]
    index[4, 5] = 9
    t = vkf.tensor(x, requires_grad=True)
    xin = t if dtype == "float32" else t.cast(dtype)
    out = F.take_along_last(xin, vkf.tensor(index))
    assert out.shape == (2, 3, 5, 6)
    picked = np.take_along_axis(x, np.clip(index, 0, 6)[None, None].repeat(2, 0).repeat(3, 1), -1)
    expected = np.where(index < 7, picked, 0.0)
    np.testing.assert_allclose(out.float().numpy(), expected, rtol=tol, atol=tol)
    w = RNG.standard_normal(out.shape).astype(np.float32)
    (out.float() * vkf.tensor(w)).sum().backward()
    grad = np.zeros_like(x, dtype=np.float64)
    for r in range(5):
        for j in range(6):
            if index[r, j] < 7:
                grad[:, :, r, index[r, j]] += w[:, :, r, j]
    np.testing.assert_allclose(t.grad.numpy(), grad, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("cols,picks", [(70000, 3), (3, 70000)])
def test_take_along_last_gradient_of_rows_longer_than_one_invocation_may_loop_over(cols, picks):
    """llvmpipe (lavapipe) ends an invocation's loops after 65535 iterations in all: an invocation zeroing a row of
    C elements (a vocabulary of 128256 when picking the target logit) and then adding its J picks stopped short past
    that, leaving the row's end or the later picks out. The picks, now split across dispatches, still add in order:
    equal to float32 additions in pick order, bit for bit."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 2, cols)).astype(np.float32)
    index = rng.integers(0, cols + 1, (2, picks)).astype(np.int32)  # cols: outside, passes nothing back
    index[:, :2] = cols - 1  # one element picked twice at the row's end
    t = vkf.tensor(x, requires_grad=True)
    out = F.take_along_last(t, vkf.tensor(index))
    w = rng.standard_normal(out.shape).astype(np.float32)
    (out * vkf.tensor(w)).sum().backward()
    grad = np.zeros((2, 2, cols + 1), np.float32)
    for p in range(2):
        for r in range(2):
            np.add.at(grad[p, r], index[r], w[p, r])  # unbuffered: float32 additions in pick order
    np.testing.assert_array_equal(t.grad.numpy(), grad[..., :cols])


def test_gather_rows_and_its_gradient_through_the_inverse():
    """Rows picked per slice (each row at most once per slice, -1: a zero row), as a mixture-of-experts block
    lists each expert's tokens; the gradient, a gather through ``inverse``, equals the scatter-add of numpy."""
    src = RNG.standard_normal((5, 3)).astype(np.float32)
    index = np.array([[3, 0, -1, -1, -1], [1, 2, 4, 0, -1]], np.int32)  # two slices of 5 rows
    inverse = np.full((2, 5), -1, np.int32)
    for p, row in enumerate(index):
        for s, r in enumerate(row):
            if r >= 0:
                inverse[p, r] = p * 5 + s
    t = vkf.tensor(src, requires_grad=True)
    out = F.gather_rows(t, vkf.tensor(index), vkf.tensor(inverse))
    np.testing.assert_array_equal(out.numpy(), np.where(index[..., None] >= 0, src[index], 0.0))
    w = RNG.standard_normal(out.shape)
    (out * vkf.tensor(w)).sum().backward()
    expected = np.zeros_like(src, dtype=np.float64)
    keep = index.reshape(-1) >= 0
    np.add.at(expected, index.reshape(-1)[keep], w.reshape(-1, 3)[keep])
    np.testing.assert_allclose(t.grad.numpy(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="inverse"):
        F.gather_rows(t, vkf.tensor(index), vkf.tensor(inverse[:, :4]))


def test_linear_with_live_rows_matches_numpy_on_the_live_rows():
    """F.linear(live_rows=c): rows past c are padding (zeros here, as a mixture-of-experts list pads them); the
    live rows, the input's gradient on them and the weight's gradient are those of the full product."""
    x = RNG.standard_normal((150, 6)).astype(np.float32)
    x[97:] = 0.0
    w = RNG.standard_normal((5, 6)).astype(np.float32)
    g = RNG.standard_normal((150, 5)).astype(np.float32)
    g[97:] = 0.0  # nothing uses the padding rows' results
    tx, tw = vkf.tensor(x, requires_grad=True), vkf.tensor(w, requires_grad=True)
    y = F.linear(tx, tw, live_rows=vkf.tensor(np.array([97.0], np.float32)))
    np.testing.assert_allclose(y.numpy()[:97], x[:97] @ w.T, rtol=1e-5, atol=1e-5)
    (y * vkf.tensor(g)).sum().backward()
    np.testing.assert_allclose(tx.grad.numpy()[:97], g[:97] @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tw.grad.numpy(), g.T @ x, rtol=1e-5, atol=1e-5)


GROUP_SPANS = [(0, 40), (40, 0), (40, 3), (43, 70)]  # rows 113.. 119 belong to no span


@pytest.mark.parametrize("layout", ["list", "list_transposed", "stacked", "stacked_transposed"])
def test_grouped_matmul_over_packed_spans(layout):
    """F.grouped_matmul: span e's rows of x times w_e, forward and both gradients against numpy, for weights as E
    tensors or one stacked [E, k, n], each as stored or a transposed view (a Linear weight's .T). The rows past
    every span are not written (not compared) and get no gradient; a span of 0 rows changes nothing."""
    rows, k, n, experts = 120, 6, 5, len(GROUP_SPANS)
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    g = RNG.standard_normal((rows, n)).astype(np.float32)
    covered = np.zeros(rows, bool)
    for start, count in GROUP_SPANS:
        covered[start:start + count] = True
    g[~covered] = 0.0  # nothing reads those rows
    transposed = layout.endswith("transposed")
    stored = RNG.standard_normal((experts, n, k) if transposed else (experts, k, n)).astype(np.float32)
    ws = np.swapaxes(stored, 1, 2) if transposed else stored  # [E, k, n] as used
    spans = vkf.tensor(np.array(GROUP_SPANS, np.float32))
    tx = vkf.tensor(x, requires_grad=True)
    if layout.startswith("stacked"):
        tw = vkf.tensor(stored, requires_grad=True)
        weights = tw.transpose(1, 2) if transposed else tw
        params = [tw]
    else:
        params = [vkf.tensor(w, requires_grad=True) for w in stored]
        weights = [p.transpose(0, 1) if transposed else p for p in params]
    y = F.grouped_matmul(tx, weights, spans)
    want = np.zeros((rows, n), np.float64)
    for e, (start, count) in enumerate(GROUP_SPANS):
        want[start:start + count] = x[start:start + count] @ ws[e]
    np.testing.assert_allclose(y.numpy()[covered], want[covered], rtol=1e-5, atol=1e-5)
    (y * vkf.tensor(g)).sum().backward()
    gx = np.zeros_like(x, np.float64)
    gw = np.zeros_like(ws, np.float64)
    for e, (start, count) in enumerate(GROUP_SPANS):
        span = slice(start, start + count)
        gx[span] = g[span] @ ws[e].T
        gw[e] = x[span].T @ g[span]
    np.testing.assert_allclose(tx.grad.numpy()[covered], gx[covered], rtol=1e-5, atol=1e-5)
    gw_stored = np.swapaxes(gw, 1, 2) if transposed else gw
    got = params[0].grad.numpy() if len(params) == 1 else np.stack([p.grad.numpy() for p in params])
    np.testing.assert_allclose(got, gw_stored, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_checks_its_operands():
    x = vkf.tensor(np.zeros((8, 4), np.float32))
    w = [vkf.tensor(np.zeros((4, 3), np.float32))] * 2
    with pytest.raises(ValueError, match="spans must be float32"):
        F.grouped_matmul(x, w, vkf.tensor(np.zeros((3, 2), np.float32)))
    with pytest.raises(ValueError, match="every weight"):
        F.grouped_matmul(x, [vkf.tensor(np.zeros((5, 3), np.float32))] * 2, vkf.tensor(np.zeros((2, 2), np.float32)))


def test_cross_entropy_with_ignored_labels():
    logits = RNG.standard_normal((2, 3, 7))
    labels = np.array([[1, -100, 6], [0, 2, -100]], np.int32)

    def np_ce(z):
        z2, lab = z.reshape(-1, 7), labels.reshape(-1)
        keep = lab != -100
        lse = np.log(np.exp(z2 - z2.max(-1, keepdims=True)).sum(-1)) + z2.max(-1)
        return (lse[keep] - z2[keep, lab[keep]]).mean()

    t = vkf.tensor(logits, requires_grad=True)
    loss = F.cross_entropy(t, vkf.tensor(labels))
    np.testing.assert_allclose(loss.item(), np_ce(logits), rtol=1e-5)
    loss.backward()
    np.testing.assert_allclose(t.grad.numpy(), numeric_grad(np_ce, logits.copy()), **GRAD_TOL)


def np_rope(x, pos, inv_freq):
    ang = pos[:, None, :, None] * inv_freq  # [b, 1, s, d/2]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def test_rope_half_layout():
    pos = np.array([[0, 1, 2, 5], [3, 4, 5, 6]], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)
    check(lambda x: F.rope(x, vkf.tensor(pos), vkf.tensor(inv_freq)),
          lambda x: np_rope(x, pos.astype(np.float64), inv_freq.astype(np.float64)), (2, 3, 4, 8))


def test_rope_of_a_permuted_projection_needs_no_copy():
    """q [B, T, H, D] permuted to [B, H, T, D] enters the rope kernel as it lies (no copy node), forward and
    backward agree with numpy."""
    pos = np.array([[0, 1, 2, 5], [3, 4, 5, 6]], np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)
    check(lambda x: F.rope(x.permute(0, 2, 1, 3), vkf.tensor(pos), vkf.tensor(inv_freq)),
          lambda x: np_rope(x.transpose(0, 2, 1, 3), pos.astype(np.float64), inv_freq.astype(np.float64)),
          (2, 4, 3, 8))
    x = vkf.tensor(RNG.standard_normal((2, 4, 3, 8)).astype(np.float32))
    out = F.rope(x.permute(0, 2, 1, 3), vkf.tensor(pos), vkf.tensor(inv_freq))
    assert out.lazy.base.node.inputs[0].base is x.lazy.base


def np_attention(q, k, v, causal=True, return_lse=False):
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    if causal:
        ql, kl = s.shape[-2:]
        s = np.where(np.arange(kl)[None, :] <= np.arange(ql)[:, None] + (kl - ql), s, -np.inf)
    top = s.max(-1, keepdims=True)
    p = np.exp(s - top)
    out = (p / p.sum(-1, keepdims=True)) @ v
    return (out, (top + np.log(p.sum(-1, keepdims=True)))[..., 0]) if return_lse else out


@pytest.mark.parametrize("causal", [True, False])
def test_attention_gqa(causal):
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, causal=causal),
          lambda q, k, v: np_attention(q, k, v, causal), (1, 4, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8))


def test_attention_logsumexp_carries_its_gradient():
    """Attention sinks (gpt-oss): out * sigmoid(lse - sink) renormalises the softmax over one extra logit per
    head; the gradient reaches q and k through the logsumexp too."""
    def ours(q, k, v, sink):
        out, lse = F.scaled_dot_product_attention(q, k, v, return_lse=True)
        return out * (lse - sink.reshape(1, -1, 1)).sigmoid().reshape(*lse.shape, 1)

    def reference(q, k, v, sink):
        out, lse = np_attention(q, k, v, return_lse=True)
        return out / (1 + np.exp(sink[None, :, None] - lse))[..., None]
    check(ours, reference, (1, 4, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), (4,))


def test_attention_on_transposed_views():
    """q, k, v as [batch, seq, heads, dim] transposed: the op makes them contiguous itself."""
    check(lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
          lambda q, k, v: np_attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)),
          (1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4))


def test_dropout_masks_scales_and_replays_with_new_seeds():
    F.manual_seed(0)
    x = vkf.tensor(np.ones((64, 64), np.float32), requires_grad=True)
    y = F.dropout(x, p=0.25)
    out = y.numpy()
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.03
    np.testing.assert_allclose(out[kept], 1 / 0.75, rtol=1e-6)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy() != 0, kept)  # backward keeps the same elements
    second = F.dropout(vkf.tensor(np.ones((64, 64), np.float32)), p=0.25).numpy()
    assert (second != 0).mean() > 0.7 and not np.array_equal(second != 0, kept)
    assert F.dropout(x, p=0.25, training=False) is x


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="unknown activation 'swiglu2'"):
        F.activation("swiglu2")
