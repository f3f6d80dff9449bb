"""``output_hidden_states=True`` on a causal LM (transformers' name): the embeddings, then every layer's output, the
last one after the final norm.

The base models' hidden states are checked against transformers in tests/test_heads_parity.py; a causal LM's must
be those same tensors (bit-identical: the same ops on the same weights), on a left-padded batch, whatever
``logits_to_keep`` keeps, and its logits unchanged by asking for them (the kept last row's within 1e-5, as
test_logits_to_keep allows). A model whose plugin runs the layers in a
loop of its own (Gemma 3n's four streams) refuses the flag instead of giving states of another meaning.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_decoder_parity import FIXTURES
from vkformers import no_grad
from vkformers.errors import VkformersError
from vkformers.models.loading import AutoModel, AutoModelForCausalLM


def batch(config):
    ids = np.random.default_rng(0).integers(3, config["vocab_size"] - 1, (2, 7)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # row 1 left-padded
    return ids, mask


@pytest.mark.parametrize("name", ["llama", "gemma2", "mixtral", "olmo2"])
def test_a_causal_lm_gives_its_base_models_hidden_states(name):
    causal = AutoModelForCausalLM.from_pretrained(FIXTURES / name, requires_grad=False)
    base = AutoModel.from_pretrained(FIXTURES / name, requires_grad=False)
    ids, mask = batch(causal.config)
    with no_grad():
        want = base(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        plain = causal(ids, attention_mask=mask).logits.numpy()
        out = causal(ids, attention_mask=mask, output_hidden_states=True)
        kept = causal(ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    assert len(want) == causal.config["num_hidden_layers"] + 1
    assert causal(ids, attention_mask=mask).hidden_states is None
    np.testing.assert_array_equal(out.logits.numpy(), plain)
    # the head over one row may take another product kernel on a GPU: the reduction order only (test_logits_to_keep)
    np.testing.assert_allclose(kept.logits.numpy(), plain[:, -1:], atol=1e-5, rtol=0)
    for got in (out, kept):
        assert len(got.hidden_states) == len(want)
        for i, (state, expected) in enumerate(zip(got.hidden_states, want)):
            np.testing.assert_array_equal(state.numpy(), expected.numpy(), err_msg=f"{name} hidden_states[{i}]")


def test_a_plugins_own_layer_loop_refuses_the_flag():
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "gemma3n_text", requires_grad=False)
    ids, _ = batch(model.config)
    with pytest.raises(VkformersError, match="output_hidden_states is not supported"):
        model(ids, output_hidden_states=True)
