"""The engine: lazy tensors, views, broadcasting, autograd and capture-and-replay.

Forward results are checked against numpy; every backward against central finite
differences of the same function computed in float64 numpy.
"""
import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.tensor import Tensor, no_grad, parameter

RNG = np.random.default_rng(0)
FORWARD_TOL = dict(rtol=1e-5, atol=1e-6)   # fp32 kernels against float64 numpy
GRAD_TOL = dict(rtol=2e-3, atol=2e-4)      # fp32 gradients against float64 finite differences


def numeric_grad(f, x, eps=1e-6):
    """d f(x) / dx by central differences, in float64."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        hi = f(x)
        flat[i] = old - eps
        lo = f(x)
        flat[i] = old
        gflat[i] = (hi - lo) / (2 * eps)
    return g


def check(vk_fn, np_fn, *shapes, positive=False, grads=True):
    xs = [RNG.standard_normal(s) for s in shapes]
    if positive:
        xs = [np.abs(x) + 0.5 for x in xs]
    xs = [x.astype(np.float32).astype(np.float64) for x in xs]  # exactly representable in fp32
    ts = [vkf.tensor(x, requires_grad=grads) for x in xs]
    out = vk_fn(*ts)
    expected = np_fn(*xs)
    np.testing.assert_allclose(out.numpy(), expected, **FORWARD_TOL)
    if not grads:
        return
    weights = RNG.standard_normal(np.shape(expected))
    (out * vkf.tensor(weights)).sum().backward()
    for i, (x, t) in enumerate(zip(xs, ts)):
        def f(xi, i=i):
            args = list(xs)
            args[i] = xi
            return float((np_fn(*args) * weights).sum())
        np.testing.assert_allclose(t.grad.numpy(), numeric_grad(f, x.copy()), **GRAD_TOL,
                                   err_msg=f"gradient of input {i}")


def gelu(x):
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


@pytest.mark.parametrize("name, vk_fn, np_fn, shapes, positive", [
    ("add broadcast", lambda a, b: a + b, lambda a, b: a + b, [(3, 1, 5), (4, 5)], False),
    ("sub", lambda a, b: a - b, lambda a, b: a - b, [(2, 3), (2, 3)], False),
    ("mul row", lambda a, b: a * b, lambda a, b: a * b, [(3, 4), (4,)], False),
    ("div", lambda a, b: a / b, lambda a, b: a / b, [(5,), (5,)], True),
    ("pow", lambda a, b: a ** b, lambda a, b: a ** b, [(6,), (6,)], True),
    ("scalar ops", lambda a: (a * 3.0 + 1.5) / 2.0 - 0.25, lambda a: (a * 3 + 1.5) / 2 - 0.25, [(7,)], False),
    ("rsub scalar", lambda a: 2.0 - a, lambda a: 2.0 - a, [(3,)], False),
    ("exp", lambda a: a.exp(), np.exp, [(4, 3)], False),
    ("log", lambda a: a.log(), np.log, [(9,)], True),
    ("sqrt", lambda a: a.sqrt(), np.sqrt, [(9,)], True),
    ("rsqrt", lambda a: a.rsqrt(), lambda a: 1 / np.sqrt(a), [(9,)], True),
    ("tanh", lambda a: a.tanh(), np.tanh, [(9,)], False),
    ("acos", lambda a: (a.tanh() * 0.9).acos(), lambda a: np.arccos(np.tanh(a) * 0.9), [(9,)], False),
    ("sigmoid", lambda a: a.sigmoid(), lambda a: 1 / (1 + np.exp(-a)), [(9,)], False),
    ("silu", lambda a: a.silu(), lambda a: a / (1 + np.exp(-a)), [(9,)], False),
    ("gelu", lambda a: a.gelu(), gelu, [(9,)], False),
    ("maximum", lambda a, b: a.maximum(b), np.maximum, [(8,), (8,)], False),
    ("matmul", lambda a, b: a @ b, lambda a, b: a @ b, [(5, 7), (7, 3)], False),
    ("batched matmul broadcast", lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 4, 5), (5, 6)], False),
    ("matmul transposed", lambda a, b: a.T @ b.transpose(0, 1), lambda a, b: a.T @ b.T, [(4, 3), (5, 4)], False),
    ("sum axis", lambda a: a.sum(axis=1), lambda a: a.sum(axis=1), [(3, 4, 5)], False),
    ("sum keepdim", lambda a: a.sum(axis=(0, 2), keepdim=True), lambda a: a.sum(axis=(0, 2), keepdims=True),
     [(3, 4, 5)], False),
    ("mean", lambda a: a.mean(), lambda a: a.mean(), [(4, 6)], False),
    ("max", lambda a: a.max(axis=-1), lambda a: a.max(axis=-1), [(4, 6)], False),
    ("softmax", lambda a: a.softmax(-1), lambda a: np.exp(a - a.max(-1, keepdims=True)) /
     np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True), [(3, 7)], False),
    ("log_softmax axis 0", lambda a: a.log_softmax(0), lambda a: a - a.max(0) - np.log(np.exp(a - a.max(0)).sum(0)),
     [(5, 2)], False),
    ("views", lambda a: a.reshape(6, 4).T[1:3] * 2.0, lambda a: a.reshape(6, 4).T[1:3] * 2, [(2, 3, 4)], False),
    ("slice and index", lambda a: a[1, :, ::2] + a[0, :, 1::2], lambda a: a[1, :, ::2] + a[0, :, 1::2],
     [(2, 3, 4)], False),
    ("strided slices of several dims", lambda a: a[1:3, ::3, 2:7:2] * 1.5, lambda a: a[1:3, ::3, 2:7:2] * 1.5,
     [(4, 8, 9)], False),
    ("expand", lambda a: a.expand(3, 4) * 1.0, lambda a: np.broadcast_to(a, (3, 4)) * 1.0, [(1, 4)], False),
    ("cat last dim", lambda a, b: F.cat([a, b], -1), lambda a, b: np.concatenate([a, b], -1),
     [(2, 3, 4), (2, 3, 1)], False),
    ("cat of views, middle dim", lambda a, b, c: F.cat([a.transpose(0, 2), b[:, ::2], c], 1),
     lambda a, b, c: np.concatenate([a.transpose(2, 1, 0), b[:, ::2], c], 1), [(5, 3, 2), (2, 7, 5), (2, 1, 5)],
     False),
    ("cat dim 0", lambda a, b: F.cat([a, b]), lambda a, b: np.concatenate([a, b]), [(1, 3), (4, 3)], False),
    ("stack new middle dim", lambda a, b: F.stack([a, b * 2.0], 1), lambda a, b: np.stack([a, b * 2], 1),
     [(3, 4), (3, 4)], False),
    ("softplus", lambda a: F.softplus(a * 8.0), lambda a: np.logaddexp(0, a * 8), [(40,)], False),
    ("softplus beta", lambda a: F.softplus(a * 8.0, beta=2.0, threshold=5.0),
     lambda a: np.where(a * 16 > 5, a * 8, np.logaddexp(0, a * 16) / 2), [(40,)], False),
])
def test_forward_and_backward(name, vk_fn, np_fn, shapes, positive):
    check(vk_fn, np_fn, *shapes, positive=positive)


def test_cat_in_half_precision_and_its_errors():
    a = RNG.standard_normal((2, 3)).astype(np.float16)
    b = RNG.standard_normal((2, 5)).astype(np.float16)
    out = F.cat([vkf.tensor(a, dtype=vkf.float16), vkf.tensor(b, dtype=vkf.float16)], 1)
    assert out.dtype is vkf.float16
    np.testing.assert_array_equal(out.float().numpy(), np.concatenate([a, b], 1).astype(np.float32))
    with pytest.raises(ValueError, match="differ outside dim 1"):
        F.cat([vkf.tensor(a), vkf.tensor(b.T)], 1)
    with pytest.raises(TypeError, match="cast one first"):
        F.cat([vkf.tensor(a.astype(np.float32)), vkf.tensor(b, dtype=vkf.float16)], 1)
    with pytest.raises(IndexError, match="out of range"):
        F.cat([vkf.tensor(a)], 2)
    with pytest.raises(ValueError, match="one shape"):
        F.stack([vkf.tensor(a), vkf.tensor(b)])


def test_argmax_and_compare():
    x = np.array([[1.0, 3.0, 3.0], [-1.0, -2.0, 0.5]], np.float32)
    t = vkf.tensor(x)
    np.testing.assert_array_equal(t.argmax(-1).numpy(), [1, 2])
    np.testing.assert_array_equal((t > 0.75).numpy(), x > 0.75)


def test_odd_shapes_length_one_and_batch_one():
    check(lambda a, b: a @ b, lambda a, b: a @ b, (1, 1, 1), (1, 1))
    check(lambda a: a.sum(axis=0), lambda a: a.sum(axis=0), (1,))
    check(lambda a, b: a * b, lambda a, b: a * b, (1, 37, 1), (53, 1, 1))


def test_no_grad_and_detach():
    a = vkf.tensor(np.ones(3), requires_grad=True)
    with no_grad():
        b = a * 2.0
    assert not b.requires_grad
    assert not (a * 2.0).detach().requires_grad


def test_gradients_accumulate():
    a = vkf.tensor(np.array([1.0, 2.0]), requires_grad=True)
    (a * 3.0).sum().backward()
    (a * a).sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), 3.0 + 2 * np.array([1.0, 2.0]))


def test_backward_computes_the_gradients_before_returning():
    """backward() runs the forward and backward in one submission before it returns (as PyTorch's has run), so
    a loop that never reads the gradients still computes them; inside lazy.deferred_backward() (the trainer's
    step) they stay lazy and are realized with what reads them."""
    w = parameter(RNG.standard_normal((8, 4)).astype(np.float32))
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    runs = lazy.stats["recorded"] + lazy.stats["replayed"]
    loss = (vkf.tensor(x) @ w).relu().sum()
    loss.backward()
    assert w.grad.lazy.realized and loss.lazy.realized  # the loss comes with them: no second submission
    assert lazy.stats["recorded"] + lazy.stats["replayed"] == runs + 1
    want = x.T @ (x @ w.numpy() > 0).astype(np.float32)
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-6)

    w.grad = None
    with lazy.deferred_backward():
        loss = (vkf.tensor(x) @ w).relu().sum()
        loss.backward()
    assert not w.grad.lazy.realized and not loss.lazy.realized
    runs = lazy.stats["recorded"] + lazy.stats["replayed"]
    lazy.realize([loss.lazy, w.grad.lazy])
    assert lazy.stats["recorded"] + lazy.stats["replayed"] == runs + 1
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-6)


def test_same_graph_replays_without_recording():
    w = parameter(RNG.standard_normal((8, 4)).astype(np.float32))

    def step(x):
        return (vkf.tensor(x) @ w).relu().sum().numpy()

    step(RNG.standard_normal((3, 8)))
    recorded = lazy.stats["recorded"]
    replayed = lazy.stats["replayed"]
    for _ in range(3):
        x = RNG.standard_normal((3, 8)).astype(np.float32)
        np.testing.assert_allclose(step(x), np.maximum(x @ w.numpy(), 0).sum(), rtol=1e-5)
    assert lazy.stats["recorded"] == recorded  # same shapes: no new recording
    assert lazy.stats["replayed"] == replayed + 3
    step(RNG.standard_normal((5, 8)))  # a new shape records a new plan
    assert lazy.stats["recorded"] == recorded + 1


def test_results_of_an_earlier_replay_stay_valid():
    w = parameter(np.eye(2, dtype=np.float32))
    first = vkf.tensor(np.array([[1.0, 2.0]])) @ w
    first.numpy()
    second = vkf.tensor(np.array([[5.0, 6.0]])) @ w
    np.testing.assert_array_equal(second.numpy(), [[5.0, 6.0]])
    np.testing.assert_array_equal(first.numpy(), [[1.0, 2.0]])


def _train_mlp(steps: int, replay: bool) -> list[float]:
    rng = np.random.default_rng(42)
    w1 = parameter(rng.standard_normal((4, 16)).astype(np.float32) * 0.5)
    b1 = parameter(np.zeros(16, np.float32))
    w2 = parameter(rng.standard_normal((16, 1)).astype(np.float32) * 0.5)
    x_all = rng.standard_normal((steps, 8, 4)).astype(np.float32)
    y_all = np.sin(x_all.sum(-1, keepdims=True))
    losses = []
    for step in range(steps):
        if not replay:
            lazy.clear_plan_cache()
        x, y = vkf.tensor(x_all[step]), vkf.tensor(y_all[step])
        pred = (x @ w1 + b1).gelu() @ w2
        loss = ((pred - y) ** 2.0).mean()
        loss.backward()
        for p in (w1, b1, w2):
            p.assign(p - p.grad * 0.1)
            p.grad = None
        losses.append(loss.item())
    return losses


def test_mlp_trained_by_replay_matches_step_by_step_recording():
    recorded = lazy.stats["recorded"]
    replayed_losses = _train_mlp(20, replay=True)
    assert lazy.stats["recorded"] - recorded <= 2  # the first step records; the rest replay
    rerecorded_losses = _train_mlp(20, replay=False)
    assert replayed_losses == rerecorded_losses
    assert replayed_losses[-1] < replayed_losses[0] * 0.7  # and it learns


def test_error_messages():
    a = vkf.tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match="do not align"):
        a @ a
    with pytest.raises(ValueError, match="do not broadcast"):
        a + vkf.tensor(np.ones(4))
    with pytest.raises(ValueError, match="cannot reshape"):
        a.reshape(4, 2)
    with pytest.raises(RuntimeError, match="one-element"):
        vkf.tensor(np.ones(3), requires_grad=True).mul(2.0).backward() if hasattr(Tensor, "mul") else \
            (vkf.tensor(np.ones(3), requires_grad=True) * 2.0).backward()


def test_clamp_backward_passes_gradient_inside_the_range_only():
    check(lambda a: a.clamp(-0.5, 0.5), lambda a: np.clip(a, -0.5, 0.5), (13,))


def test_scalar_operands_of_every_binary_op():
    """A Python number on the right: each op computes only its own scalar (maximum(0.0) must not divide
    by it), and x / 0.0 gives inf as numpy does."""
    x = np.array([-1.5, 0.0, 2.0], np.float32)
    t = vkf.tensor(x)
    np.testing.assert_array_equal(t.maximum(0.0).numpy(), np.maximum(x, 0.0))
    np.testing.assert_array_equal(t.minimum(0.0).numpy(), np.minimum(x, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal((t / 0.0).numpy(), x / np.float32(0.0))
    np.testing.assert_allclose((t - 2.0).numpy(), x - 2.0)


def test_binary_ops_keep_only_what_their_wanted_gradients_read():
    """A sum keeps none of its operands for the backward, a product with a constant only the constant (an
    activation kept alive for nothing is memory a deep model's training runs out of); gradients unchanged."""
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    c = RNG.standard_normal((3, 4)).astype(np.float32)
    a, b, const = vkf.tensor(x, requires_grad=True), vkf.tensor(c, requires_grad=True), vkf.tensor(c)

    def kept(t):  # (a, b, result): which are kept
        return [v is not None for v in t._ctx.saved]
    assert kept(a + b) == [False, False, False] and kept(a - b) == [False, False, False]
    assert kept(a * const) == [False, True, False] and kept(a * b) == [True, True, False]
    assert kept(a / const) == [False, True, False] and kept(const / a) == [False, True, True]
    ((a * const + a / const - (const / a)) * b).sum().backward()
    np.testing.assert_allclose(a.grad.numpy(), (c + 1 / c + c / x ** 2) * c, rtol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), x * c + x / c - c / x, rtol=1e-5)


def test_garbage_collector_pauses_while_building_and_resumes_after_realizing():
    import gc
    from vkformers.engine import lazy
    assert gc.isenabled()
    with lazy.building_graph():
        y = vkf.tensor(np.ones(3, np.float32)) * 2.0
    assert not gc.isenabled()  # until the graph is realized and cut
    np.testing.assert_array_equal(y.numpy(), [2.0, 2.0, 2.0])
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with lazy.building_graph():
            raise ValueError("a forward that fails")
    assert gc.isenabled()  # no realization follows a failed build


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_numpy_of_a_view_reads_only_its_span(dtype, monkeypatch):
    """numpy() of a view of a computed tensor copies only the elements the view spans (e.g. the last token's
    logits of a long prompt), from any element offset (odd ones included for 16-bit types)."""
    from vkformers.runtime import vulkan
    host = (np.arange(5 * 7 * 9, dtype=np.float32).reshape(5, 7, 9) % 64) / 4  # exact in every dtype
    x = vkf.tensor(host, dtype=dtype) * 1.0  # computed: its storage is a device-only buffer
    x.realize()
    staged = []  # bytes copied into staging (the staging buffer itself may be a reused, larger one)
    copy = vulkan.Sequence._copy_tensor
    monkeypatch.setattr(vulkan.Sequence, "_copy_tensor", lambda seq, src, dst, nbytes, src_offset=0:
                        staged.append(nbytes) or copy(seq, src, dst, nbytes, src_offset))
    itemsize = 4 if dtype == "float32" else 2
    views = ((x[4:5, 6], host[4:5, 6], 9), (x[2, 3:6, 1::3], host[2, 3:6, 1::3], 2 * 9 + 7 + 1),
             (x[4, 6, 8], host[4, 6, 8], 1), (x.transpose(0, 2)[1:3], host.transpose(2, 1, 0)[1:3], None),
             (x[:, -1], host[:, -1], None), (x[1:1], host[1:1], 0))
    for view, want, span in views:
        staged.clear()
        np.testing.assert_array_equal(view.numpy(), want)
        if span is not None:  # a view of x itself (the others are copies first): only its span is staged
            assert (len(staged) == 1 or span == 0) and sum(staged) <= span * itemsize + 4, (want.shape, staged)


def test_a_realized_graph_leaves_no_cyclic_garbage():
    """Realizing a graph (forward and backward) frees it by reference counting: nothing waits for the garbage
    collector (a reference cycle holding each realized graph cost ~7 ms of collection per decode step of a
    22-layer model). Nodes built and dropped without being realized still form cycles (a node and its outputs)."""
    import gc
    x = vkf.tensor(RNG.standard_normal((4, 4)).astype(np.float32), requires_grad=True)

    def step():  # as a training step: the loss and the gradients are read, so every node is realized
        y = ((x @ x).relu() * 2.0 + x.transpose(0, 1)).sum()
        y.backward()
        lazy.realize([y.lazy, x.grad.lazy])
        x.grad = None
    step()
    gc.collect()
    step()
    assert gc.collect() == 0


def test_a_graph_deeper_than_the_recursion_limit_realizes():
    """Scheduling walks the graph with its own stacks: an 80-layer training step is thousands of nodes deep."""
    import sys
    x = vkf.tensor(np.ones(4, np.float32), requires_grad=True)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)
    try:
        y = x
        for _ in range(2000):
            y = y * 1.0 + 1.0
        loss = y.sum()
        loss.backward()
        values, grad = y.numpy(), x.grad.numpy()
    finally:
        sys.setrecursionlimit(limit)
    np.testing.assert_array_equal(values, np.full(4, 2001.0, np.float32))
    np.testing.assert_array_equal(grad, np.ones(4, np.float32))


def test_reductions_take_pytorch_and_numpy_axis_spellings():
    from vkformers.engine import functional as F
    from vkformers.errors import ArgumentError
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    t = Tensor(x)
    np.testing.assert_allclose(t.sum(dim=1, keepdim=True).numpy(), x.sum(1, keepdims=True), **FORWARD_TOL)
    np.testing.assert_allclose(t.sum(axis=(0, 2), keepdims=True).numpy(), x.sum((0, 2), keepdims=True),
                               **FORWARD_TOL)
    np.testing.assert_allclose(t.mean(dim=-1).numpy(), x.mean(-1), **FORWARD_TOL)
    np.testing.assert_allclose(t.mean(axis=0, keepdims=True).numpy(), x.mean(0, keepdims=True), **FORWARD_TOL)
    np.testing.assert_allclose(t.max(dim=1, keepdims=True).numpy(), x.max(1, keepdims=True), **FORWARD_TOL)
    np.testing.assert_array_equal(t.argmax(axis=0, keepdims=True).numpy(), x.argmax(0)[None])
    np.testing.assert_array_equal(t.argmax(dim=2).numpy(), x.argmax(2))
    e = np.exp(x - x.max(0, keepdims=True))
    np.testing.assert_allclose(F.softmax(t, axis=0).numpy(), e / e.sum(0), **FORWARD_TOL)
    np.testing.assert_allclose(t.softmax(dim=0).numpy(), e / e.sum(0), **FORWARD_TOL)
    np.testing.assert_allclose(F.log_softmax(t, dim=0).numpy(), np.log(e / e.sum(0)), rtol=1e-5, atol=1e-5)
    for call in (lambda: t.sum(axis=1, dim=1), lambda: t.max(1, dim=0), lambda: F.softmax(t, 0, axis=0)):
        with pytest.raises(ArgumentError, match="axis was given twice"):
            call()
    with pytest.raises(ArgumentError, match="keepdim=True and keepdims=True both given"):
        t.mean(0, keepdim=True, keepdims=True)


@pytest.mark.parametrize("assignment_first", [True, False])
def test_an_assignment_runs_after_every_reader_of_the_old_value_whichever_target_comes_first(assignment_first):
    """The schedule walks the targets in order; a reader of the old value that the walk reaches after the assignment
    (the assignment a target before it) must still run first."""
    p = parameter(np.array([1.0, 2.0, 3.0], np.float32))
    doubled = p * 2.0  # reads the old value, unrealized
    p.assign(p + 10.0)
    targets = [p.lazy, doubled.lazy] if assignment_first else [doubled.lazy, p.lazy]
    lazy.realize(targets)
    np.testing.assert_array_equal(doubled.numpy(), [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(p.numpy(), [11.0, 12.0, 13.0])
