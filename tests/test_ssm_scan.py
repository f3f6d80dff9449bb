"""vkformers-ssm's selective scan (plugins/ssm/shaders/selective_scan.comp) against numpy in float64: the outputs
and the last state, a scan split in two (the second half from the first's state, as a recurrent cache runs) against
the whole, and the gradients of u, delta, A, B, C and D against central differences, over shapes that cross the
kernel's tiles: more channels than a workgroup's, more steps than a checkpoint chunk, a single step, B and C in
groups of channels (Mamba-2), Mamba-2's state of 128; long scans, split in several dispatches, against numpy and
its backward. Then Mamba-2's chunked scan (vkformers_ssm.ssd) against the numpy recurrence, finite differences and
the sequential kernel, and its segment_decay kernel."""
from __future__ import annotations

import numpy as np
import pytest

from vkformers.engine.tensor import Tensor
from vkformers_ssm.scan import CHUNK, GROUP, MAX_STATE, StateSizeError, _dispatches, selective_scan
from vkformers_ssm.ssd import ChunkedScanShapeError, chunked_scan, segment_decay


def reference(u, delta, A, B, C, D, h0=None):
    batch, length, channels = u.shape
    h = np.zeros((batch, channels, A.shape[1])) if h0 is None else h0.copy()
    if B.ndim == 4:  # groups: each run of channels / groups channels reads its own B and C
        B, C = (np.repeat(v, channels // v.shape[2], axis=2) for v in (B, C))
        return _reference_per_channel(u, delta, A, B, C, D, h)
    B, C = (np.repeat(v[:, :, None], channels, axis=2) for v in (B, C))
    return _reference_per_channel(u, delta, A, B, C, D, h)


def _reference_per_channel(u, delta, A, B, C, D, h):
    length = u.shape[1]
    ys = []
    for t in range(length):
        h = np.exp(delta[:, t, :, None] * A) * h + delta[:, t, :, None] * B[:, t] * u[:, t, :, None]
        ys.append((h * C[:, t]).sum(-1) + D * u[:, t])
    return np.stack(ys, 1), h


def _inputs(rng, batch, length, channels, state, groups=None):
    bc = (batch, length, state) if groups is None else (batch, length, groups, state)
    return [rng.standard_normal((batch, length, channels)),
            np.abs(rng.standard_normal((batch, length, channels))) * 0.5,
            -np.exp(rng.standard_normal((channels, state)) * 0.5), rng.standard_normal(bc), rng.standard_normal(bc),
            rng.standard_normal(channels)]


def _tensors(values, requires_grad=False):
    return [Tensor(np.asarray(v, np.float32), requires_grad=requires_grad) for v in values]


@pytest.mark.parametrize("batch,length,channels,state,groups", [
    (2, 5, 3, 4, None), (1, 1, 8, 16, None), (2, 2 * CHUNK + 3, 5, 2, None), (1, 4, GROUP + 6, 128, None),
    (2, 5, 12, 4, 3), (1, 3, 2 * (GROUP + 2), 8, 2)])
def test_forward_and_last_state_match_numpy(batch, length, channels, state, groups):
    rng = np.random.default_rng(0)
    values = _inputs(rng, batch, length, channels, state, groups)
    h0 = rng.standard_normal((batch, channels, state))
    y, last = selective_scan(*_tensors(values), initial_state=Tensor(h0.astype(np.float32)))
    want_y, want_last = reference(*values, h0)
    np.testing.assert_allclose(y.numpy(), want_y, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(last.numpy(), want_last, atol=2e-4, rtol=1e-4)


def test_a_scan_continued_from_its_state_equals_the_whole():
    values = _inputs(np.random.default_rng(1), 2, 9, 6, 4)
    whole, whole_last = selective_scan(*_tensors(values))
    first = [v[:, :4] if v.ndim == 3 and v.shape[1] == 9 else v for v in values]
    rest = [v[:, 4:] if v.ndim == 3 and v.shape[1] == 9 else v for v in values]
    y1, state = selective_scan(*_tensors(first))
    outputs, step_state = [y1.numpy()], state
    for t in range(5):  # one token at a time, as generation steps
        step = [v[:, t:t + 1] if v.ndim == 3 and v.shape[1] == 5 else v for v in rest]
        y, step_state = selective_scan(*_tensors(step), initial_state=step_state)
        outputs.append(y.numpy())
    np.testing.assert_allclose(np.concatenate(outputs, 1), whole.numpy(), atol=1e-5)
    np.testing.assert_allclose(step_state.numpy(), whole_last.numpy(), atol=1e-5)


def _central_differences(f, value, eps=1e-6):
    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        step = np.zeros_like(value)
        step[index] = eps
        grad[index] = (f(value + step) - f(value - step)) / (2 * eps)
    return grad


@pytest.mark.parametrize("batch,length,channels,state,groups", [
    (2, 6, 3, 4, None), (1, CHUNK + 2, 2, 2, None), (1, 3, GROUP + 2, 2, None), (2, 4, 6, 3, 3),
    (1, 2, 2 * (GROUP + 1), 2, 2)])
def test_gradients_match_finite_differences(batch, length, channels, state, groups):
    rng = np.random.default_rng(2)
    values = _inputs(rng, batch, length, channels, state, groups)
    g = rng.standard_normal((batch, length, channels))
    tensors = _tensors(values, requires_grad=True)
    y, _ = selective_scan(*tensors)
    (y * Tensor(g.astype(np.float32))).sum().backward()
    names = ["u", "delta", "A", "B", "C", "D"]
    for k, (name, tensor) in enumerate(zip(names, tensors)):
        if channels > GROUP and name in ("u", "delta"):  # per element, like D's: the wide case checks B, C, A, D
            continue

        def loss(v, k=k):
            args = list(values)
            args[k] = v
            return (reference(*args)[0] * g).sum()
        want = _central_differences(loss, values[k])
        scale = max(np.abs(want).max(), 1e-3)
        np.testing.assert_allclose(tensor.grad.numpy(), want, atol=1e-4 * scale, err_msg=name)


def reference_gradients(u, delta, A, B, C, D, g):
    """The gradients of sum(g * y) for u, delta, A, B, C and D by the recurrence run backwards, in float64."""
    batch, length, channels = u.shape
    grouped = B.ndim == 4
    Bc, Cc = ((np.repeat(v, channels // v.shape[2], axis=2) if grouped else np.repeat(v[:, :, None], channels, 2))
              for v in (B, C))
    hs = [np.zeros((batch, channels, A.shape[1]))]
    for t in range(length):
        hs.append(np.exp(delta[:, t, :, None] * A) * hs[-1] + delta[:, t, :, None] * Bc[:, t] * u[:, t, :, None])
    du, ddelta, dA, dB, dC = (np.zeros_like(v) for v in (u, delta, A, Bc, Cc))
    gh = np.zeros_like(hs[0])  # dL/dh_t
    for t in reversed(range(length)):
        dt, a = delta[:, t, :, None], np.exp(delta[:, t, :, None] * A)
        gh = gh + g[:, t, :, None] * Cc[:, t]
        dC[:, t] = g[:, t, :, None] * hs[t + 1]
        du[:, t] = D * g[:, t] + (gh * dt * Bc[:, t]).sum(-1)
        dB[:, t] = gh * dt * u[:, t, :, None]
        ddelta[:, t] = (gh * (Bc[:, t] * u[:, t, :, None] + A * a * hs[t])).sum(-1)
        dA += (gh * dt * a * hs[t]).sum(0)
        gh = gh * a
    if grouped:
        dB, dC = (v.reshape(*B.shape[:3], -1, B.shape[3]).sum(3) for v in (dB, dC))
    else:
        dB, dC = dB.sum(2), dC.sum(2)
    return du, ddelta, dA, dB, dC, (g * u).sum((0, 1))


# Lengths past where the forward (state 128: step 491, 64: 961, 256: 248) and the backward (128: about 150 steps from
# the end, 64: about 300) went wrong on lavapipe when one dispatch ran the whole scan; each now takes several.
@pytest.mark.parametrize("batch,length,channels,state,groups", [
    (1, 500, 2, 128, None), (2, 1000, 1, 64, None), (1, 300, 2, 256, None), (1, 500, 4, 128, 2)])
def test_long_scans_match_numpy(batch, length, channels, state, groups):
    assert len(_dispatches(length, state, backward=False)) > 1
    rng = np.random.default_rng(10)
    values = _inputs(rng, batch, length, channels, state, groups)
    h0 = rng.standard_normal((batch, channels, state))
    y, last = selective_scan(*_tensors(values), initial_state=Tensor(h0.astype(np.float32)))
    want_y, want_last = reference(*values, h0)
    np.testing.assert_allclose(y.numpy(), want_y, atol=2e-4 * np.abs(want_y).max(), rtol=1e-4)
    np.testing.assert_allclose(last.numpy(), want_last, atol=2e-4 * np.abs(want_last).max(), rtol=1e-4)


@pytest.mark.parametrize("batch,length,channels,state,groups", [
    (1, 200, 2, 128, None), (2, 400, 1, 64, None), (1, 150, 1, 256, None), (1, 200, 4, 128, 2),
    (2, 200, GROUP + 6, 128, None)])
def test_long_scan_gradients_match_the_numpy_backward(batch, length, channels, state, groups):
    assert len(_dispatches(length, state, backward=True)) > 1
    rng = np.random.default_rng(11)
    values = _inputs(rng, batch, length, channels, state, groups)
    g = rng.standard_normal((batch, length, channels))
    tensors = _tensors(values, requires_grad=True)
    y, _ = selective_scan(*tensors)
    (y * Tensor(g.astype(np.float32))).sum().backward()
    want_y = reference(*values)[0]
    np.testing.assert_allclose(y.numpy(), want_y, atol=2e-4 * np.abs(want_y).max(), rtol=1e-4)
    for name, tensor, want in zip(["u", "delta", "A", "B", "C", "D"], tensors, reference_gradients(*values, g)):
        np.testing.assert_allclose(tensor.grad.numpy(), want, atol=2e-4 * np.abs(want).max(), rtol=1e-3,
                                   err_msg=name)


def test_a_state_above_the_kernels_is_refused():
    values = _inputs(np.random.default_rng(3), 1, 2, 2, MAX_STATE + 1)
    with pytest.raises(StateSizeError, match="state size"):
        selective_scan(*_tensors(values))


# ---- Mamba-2's chunked scan (vkformers_ssm.ssd), against the same numpy recurrence with per-head A and dt

def _mamba2_inputs(rng, batch, length, heads, head_dim, groups, state):
    return [rng.standard_normal((batch, length, heads, head_dim)),
            np.abs(rng.standard_normal((batch, length, heads))) * 0.5, -np.exp(rng.standard_normal(heads) * 0.5),
            rng.standard_normal((batch, length, groups, state)), rng.standard_normal((batch, length, groups, state))]


def _mamba2_reference(x, dt, A, B, C, h0=None):
    batch, length, heads, head_dim = x.shape
    state = B.shape[-1]
    channels = heads * head_dim
    y, last = reference(x.reshape(batch, length, channels), np.repeat(dt, head_dim, axis=2),
                        np.repeat(A, head_dim)[:, None].repeat(state, 1), B, C, np.zeros(channels), h0)
    return y, last


@pytest.mark.parametrize("batch,length,heads,head_dim,groups,state,chunk", [
    (2, 7, 4, 3, 2, 5, 3), (1, 8, 2, 4, 1, 3, 4), (1, 1, 2, 2, 2, 2, 4), (2, 9, 6, 2, 3, 4, 16)])
def test_chunked_scan_matches_the_recurrence(batch, length, heads, head_dim, groups, state, chunk):
    rng = np.random.default_rng(5)
    values = _mamba2_inputs(rng, batch, length, heads, head_dim, groups, state)
    h0 = rng.standard_normal((batch, heads * head_dim, state))
    y, last = chunked_scan(*_tensors(values), chunk, initial_state=Tensor(h0.astype(np.float32)))
    want_y, want_last = _mamba2_reference(*values, h0)
    np.testing.assert_allclose(y.numpy(), want_y, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(last.numpy(), want_last, atol=2e-4, rtol=1e-4)


def test_chunked_scan_gradients_match_finite_differences():
    rng = np.random.default_rng(6)
    values = _mamba2_inputs(rng, 1, 5, 2, 2, 2, 3)
    g = rng.standard_normal((1, 5, 4))
    tensors = _tensors(values, requires_grad=True)
    y, _ = chunked_scan(*tensors, 2)
    (y * Tensor(g.astype(np.float32))).sum().backward()
    for k, (name, tensor) in enumerate(zip(["x", "dt", "A", "B", "C"], tensors)):
        def loss(v, k=k):
            args = list(values)
            args[k] = v
            return (_mamba2_reference(*args)[0] * g).sum()
        want = _central_differences(loss, values[k])
        np.testing.assert_allclose(tensor.grad.numpy(), want, atol=1e-4 * max(np.abs(want).max(), 1e-3),
                                   err_msg=name)


def _sequential(x, dt, A, B, C, h0=None):
    """The selective-scan kernel on the same tensors, each head's dt and A given to its channels (D = 0)."""
    batch, length, heads, head_dim = x.shape
    channels, state = heads * head_dim, B.shape[-1]
    delta = dt.reshape(batch, length, heads, 1).expand(batch, length, heads, head_dim).reshape(batch, length,
                                                                                                 channels)
    A_channels = A.reshape(heads, 1, 1).expand(heads, head_dim, state).reshape(channels, state)
    return selective_scan(x.reshape(batch, length, channels), delta, A_channels, B, C,
                          Tensor(np.zeros(channels, np.float32)), h0)


@pytest.mark.parametrize("length,chunk", [(13, 4), (13, 5), (13, 13), (13, 32), (70, 16), (70, 64), (1, 8)])
def test_chunked_scan_equals_the_sequential_scan_forward_and_backward(length, chunk):
    """Chunked (matrix products) against sequential (selective_scan.comp) on the same tensors: outputs, last state
    and the gradients of x, dt, A, B and C, for lengths that are and are not a multiple of the chunk."""
    rng = np.random.default_rng(7)
    batch, heads, head_dim, groups, state = 2, 6, 4, 3, 8
    values = _mamba2_inputs(rng, batch, length, heads, head_dim, groups, state)
    h0 = Tensor(rng.standard_normal((batch, heads * head_dim, state)).astype(np.float32))
    g = Tensor(rng.standard_normal((batch, length, heads * head_dim)).astype(np.float32))
    results = []
    for scan in (lambda *v: chunked_scan(*v, chunk, initial_state=h0), lambda *v: _sequential(*v, h0)):
        tensors = _tensors(values, requires_grad=True)
        y, last = scan(*tensors)
        (y * g).sum().backward()
        results.append([y.numpy(), last.numpy()] + [t.grad.numpy() for t in tensors])
    names = ["y", "last state", "x", "dt", "A", "B", "C"]
    for name, got, want in zip(names, *results):
        np.testing.assert_allclose(got, want, atol=2e-5 * max(np.abs(want).max(), 1.0), rtol=1e-4, err_msg=name)


def test_chunked_scan_refuses_mismatched_shapes():
    values = _tensors(_mamba2_inputs(np.random.default_rng(8), 1, 5, 4, 2, 3, 2))
    with pytest.raises(ChunkedScanShapeError, match="groups"):
        chunked_scan(*values, 4)
    values = _tensors(_mamba2_inputs(np.random.default_rng(8), 1, 5, 4, 2, 2, 2))
    with pytest.raises(ChunkedScanShapeError, match="dt must be"):
        chunked_scan(values[0], values[1][:, :4], *values[2:], 4)


def test_segment_decay_matches_numpy_and_its_gradient_finite_differences():
    """exp(cs_l - cs_s) on and below the diagonal, exact zeros above it even where the difference would overflow,
    and the gradient of cs (row sums less column sums of g * out) against central differences."""
    rng = np.random.default_rng(9)
    cs = np.cumsum(-np.abs(rng.standard_normal((2, 3, 7))), -1)
    cs[0, 0] *= 100.0  # above the diagonal exp(cs_l - cs_s) would be inf
    g = rng.standard_normal((2, 3, 7, 7))

    def reference(v):
        lower = np.tril(np.ones((7, 7), bool))
        return np.where(lower, np.exp(np.where(lower, v[..., :, None] - v[..., None, :], 0.0)), 0.0)

    t = Tensor(cs.astype(np.float32), requires_grad=True)
    out = segment_decay(t)
    np.testing.assert_allclose(out.numpy(), reference(cs), rtol=1e-5, atol=1e-7)
    assert (out.numpy()[..., np.triu_indices(7, 1)[0], np.triu_indices(7, 1)[1]] == 0).all()
    (out * Tensor(g.astype(np.float32))).sum().backward()
    want = _central_differences(lambda v: (reference(v) * g).sum(), cs)
    np.testing.assert_allclose(t.grad.numpy(), want, atol=1e-4 * np.abs(want).max())
