"""``logits_to_keep`` (transformers' name): a causal LM computes only the logits a caller reads.

A prefill reads the last position's logits; computing all of them costs a [batch, T, vocab] buffer (16.8 GB for 32
prompts of 1,024 tokens at Llama-3's vocabulary: more than one Vulkan buffer may hold). The kept logits must equal
those positions of the full forward: every step is the same per position (norm, head, scale, soft-capping).
Checked on decoder fixtures of each kind of head: plain (llama), final soft-capping (gemma2), a hybrid of attention
and Mamba layers (jamba) and pure Mamba-2 (vkformers-ssm's own model).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_decoder_parity import FIXTURES
from vkformers import no_grad
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.models.loading import AutoModelForCausalLM

ATOL = 1e-5  # float32, the same products over fewer rows: only the reduction order may differ
NAMES = ("llama", "gemma2", "jamba", "mamba2")


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    return AutoModelForCausalLM.from_pretrained(FIXTURES / request.param, dtype="float32", requires_grad=False)


def _batch(model):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, model.config["vocab_size"] - 1, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded
    return ids, mask


def test_kept_logits_equal_those_positions_of_the_full_forward(model):
    ids, mask = _batch(model)
    with no_grad():
        full = model(ids, attention_mask=mask).logits.numpy()
        last = model(ids, attention_mask=mask, logits_to_keep=1).logits.numpy()
        three = model(ids, attention_mask=mask, logits_to_keep=3).logits.numpy()
        every = model(ids, attention_mask=mask, logits_to_keep=0).logits.numpy()
        rows = np.array([0 * 9 + 8, 1 * 9 + 5], np.int32)  # flat b * T + t: one position per row
        picked = model(ids, attention_mask=mask, logits_to_keep=Tensor(rows)).logits.numpy()
    assert last.shape == (2, 1, full.shape[-1]) and three.shape == (2, 3, full.shape[-1])
    np.testing.assert_allclose(last, full[:, -1:], rtol=0, atol=ATOL)
    np.testing.assert_allclose(three, full[:, -3:], rtol=0, atol=ATOL)
    np.testing.assert_array_equal(every, full)
    np.testing.assert_allclose(picked[:, 0], full[[0, 1], [8, 5]], rtol=0, atol=ATOL)


def test_labels_with_kept_logits_are_refused(model):
    ids, mask = _batch(model)
    with pytest.raises(VkformersError, match="logits_to_keep"):
        model(ids, attention_mask=mask, labels=ids, logits_to_keep=1)
