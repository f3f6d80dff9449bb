"""What the model tests share to check gradient checkpointing: the same gradients with it as without it."""
from __future__ import annotations

import numpy as np


def assert_checkpointing_keeps_gradients(load_model, ids, tolerances=None):
    """One loss on ``ids`` (labels = ids) of a fresh ``load_model()`` without and with gradient checkpointing gives
    gradients for the same parameters, bit for bit; ``tolerances(name)`` gives (rtol, atol) instead for a
    parameter whose gradient sums the same terms in another order under checkpointing, None where it does not."""
    grads = []
    for checkpointing in (False, True):
        model = load_model()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        close = tolerances(name) if tolerances is not None else None
        if close is None:
            np.testing.assert_array_equal(grads[1][name], grads[0][name], err_msg=name)
        else:
            np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=close[0], atol=close[1], err_msg=name)
