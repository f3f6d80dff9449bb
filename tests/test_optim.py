"""vkformers.optim.AdamW against a numpy transcription of torch.optim.AdamW (single-tensor path)."""
import numpy as np

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.optim import AdamW


def torch_adamw(p, g, m, v, step, lr, b1, b2, eps, wd):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - b2 ** step) + eps
    return p - lr / (1 - b1 ** step) * m / denom, m, v


def test_three_steps_match_torch_semantics_and_replay():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 3)).astype(np.float32)
    b0 = rng.standard_normal(3).astype(np.float32)
    w, b = vkf.parameter(w0), vkf.parameter(b0)
    opt = AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=0.05, weight_decay=0.1)
    ref = {"w": [w0.astype(np.float64), 0.0, 0.0], "b": [b0.astype(np.float64), 0.0, 0.0]}
    xs = rng.standard_normal((3, 4, 5)).astype(np.float32)
    recorded = None
    for step in range(1, 4):
        x = xs[step - 1]
        loss = ((vkf.tensor(x) @ w + b) ** 2.0).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        if step == 2:
            recorded = lazy.stats["recorded"]
        # the same step in float64 numpy
        pw, pb = ref["w"][0], ref["b"][0]
        y = x @ pw + pb
        gy = 2 * y / y.size
        gw, gb = x.T @ gy, gy.sum(0)
        ref["w"] = list(torch_adamw(pw, gw, ref["w"][1], ref["w"][2], step, 0.05, 0.9, 0.999, 1e-8, 0.1))
        ref["b"] = list(torch_adamw(pb, gb, ref["b"][1], ref["b"][2], step, 0.05, 0.9, 0.999, 1e-8, 0.0))
        np.testing.assert_allclose(w.numpy(), ref["w"][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b.numpy(), ref["b"][0], rtol=1e-5, atol=1e-6)
    assert lazy.stats["recorded"] == recorded  # step 3 replayed step 2's recording
    np.testing.assert_allclose(opt.state_dict()["0.0.exp_avg"], ref["w"][1], rtol=1e-5, atol=1e-7)


def test_bfloat16_parameter_keeps_a_float32_master():
    w = vkf.parameter(np.full((4,), 1.0, np.float32), dtype="bfloat16")
    opt = AdamW([w], lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        (w.float() * vkf.tensor(np.ones(4, np.float32))).sum().backward()
        opt.step()
        opt.zero_grad()
    master = opt.state[id(w)]["master"].numpy()
    np.testing.assert_allclose(master, 1.0 - 3e-3, rtol=1e-5)  # Adam's first steps move by ~lr each
    np.testing.assert_array_equal(w.numpy(), vkf.dtypes.from_bfloat16(vkf.dtypes.to_bfloat16(master)))
