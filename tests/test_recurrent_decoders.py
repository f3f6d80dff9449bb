"""RWKV, xLSTM and MiniMax pieces beyond the fixtures' parity (tests/test_decoder_parity.py and friends run those):
core's lightning attention against its token-by-token definition, in blocks and from a carried state; a cache whose
padding is layout (a server's batch) keeps left padding out of RWKV's and xLSTM's states; refused options."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vkformers.engine.tensor import Tensor
from vkformers.models.cache import KVCache
from vkformers.models.decoder.lightning import lightning_attention, lightning_slopes
from vkformers.models.loading import AutoModelForCausalLM, load_config
from vkformers_ssm.variants import UnsupportedConfigError, minimax, xlstm

FIXTURES = Path(__file__).parent / "fixtures"


def _decayed_reference(q, k, v, slopes, state):
    """out_t = q_t S_t with S_t = exp(-slope) S_{t-1} + k_t v_t^T, in float64."""
    batch, heads, length, _ = q.shape
    state = state.astype(np.float64).copy()
    out = np.zeros((batch, heads, length, v.shape[-1]))
    ratio = np.exp(-slopes.astype(np.float64))[None, :, None, None]
    for t in range(length):
        state = ratio * state + k[:, :, t, :, None] * v[:, :, t, None, :]
        out[:, :, t] = np.einsum("bhd,bhde->bhe", q[:, :, t], state)
    return out, state


@pytest.mark.parametrize("length,block", [(7, 3), (5, 8), (1, 4)])
def test_lightning_attention_is_the_decayed_recurrence(length, block):
    rng = np.random.default_rng(length)
    q, k = (rng.standard_normal((2, 3, length, 4)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, 3, length, 5)).astype(np.float32)
    state = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    slopes = lightning_slopes(3, 0, 2)
    out, last = lightning_attention(Tensor(q), Tensor(k), Tensor(v), slopes, block, Tensor(state))
    want, want_state = _decayed_reference(q, k, v, slopes, state)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last.numpy(), want_state, rtol=1e-5, atol=1e-5)


def test_lightning_slopes_follow_the_layer():
    first, last = lightning_slopes(4, 0, 3), lightning_slopes(4, 2, 3)
    np.testing.assert_allclose(first, (2.0 ** -2) ** np.arange(1, 5) * (1 + 1e-5), rtol=1e-6)
    assert (last < 1e-4 * first).all()  # the last layer barely decays


def _prefill_logits(model, ids, mask, layout: bool):
    cache = KVCache(model.num_layers, ids.shape[0], model.num_kv_heads, model.head_dim, 32)
    cache.padding_is_layout = layout
    return model(ids, attention_mask=mask, cache=cache).logits.numpy()


@pytest.mark.parametrize("name", ["rwkv", "xlstm"])
def test_layout_padding_stays_out_of_the_state(name):
    """transformers runs these models' padding as tokens (the fixtures' padded row); a server's left padding only
    lays rows out, and the row's logits are then those of its tokens alone."""
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)
    ids = np.random.default_rng(3).integers(3, 48, (1, 6)).astype(np.int64)
    padded = np.concatenate([np.zeros((1, 3), np.int64), ids], 1)
    mask = np.concatenate([np.zeros((1, 3), np.int64), np.ones((1, 6), np.int64)], 1)
    alone = _prefill_logits(model, ids, np.ones_like(ids), layout=False)[0]
    laid_out = _prefill_logits(model, padded, mask, layout=True)[0, 3:]
    as_tokens = _prefill_logits(model, padded, mask, layout=False)[0, 3:]
    np.testing.assert_allclose(laid_out, alone, atol=1e-5)
    assert np.abs(as_tokens - alone).max() > 1e-3  # without the flag the pads are tokens, as in transformers


def test_refused_options_name_themselves():
    with pytest.raises(UnsupportedConfigError, match="weight_mode"):
        xlstm({**load_config(FIXTURES / "xlstm"), "weight_mode": "fused"})
    with pytest.raises(UnsupportedConfigError, match="num_heads"):
        xlstm({**load_config(FIXTURES / "xlstm"), "num_heads": 3})
    with pytest.raises(UnsupportedConfigError, match="layer_types"):
        minimax({**load_config(FIXTURES / "minimax"), "layer_types": ["linear_attention", "moe"]})
