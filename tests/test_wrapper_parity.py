"""Multimodal wrapper checkpoints against transformers 5.24: every fixture in tests/fixtures/wrappers/.

Each fixture (tools/make_wrapper_fixtures.py) is a tiny random *ForConditionalGeneration checkpoint as transformers
saves it (language model, vision / audio tower, projector; the towers' tensors as one-element stand-ins,
tools/slim_wrapper_fixtures.py) plus transformers' outputs for input_ids only: logits of a
[2, 8] batch (row 1 left-padded by 2) and a 12-token greedy generate with the KV cache. vkformers loads the folder
with AutoModelForCausalLM, which runs the wrapper's language model alone. Logits within 1e-4 (positions with a real
token), greedy tokens equal. A spelling vkformers refuses must say so by name (WRAPPER_REFUSED).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from vkformers.errors import VkformersError
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.safetensors_io import read_safetensors

from fixture_cases import fixture_folders

FIXTURES = Path(os.environ.get("VKFORMERS_WRAPPER_FIXTURES", Path(__file__).parent / "fixtures" / "wrappers"))
LOGITS_ATOL = 1e-4
# Wrappers whose checkpoint vkformers refuses (the error names the spelling): {spelling: why}
WRAPPER_REFUSED: dict[str, str] = {}


def reference(name):
    return {k: e.as_float() for k, e in read_safetensors(FIXTURES / name / "reference.safetensors").items()}


@pytest.mark.parametrize("name", fixture_folders(FIXTURES))
def test_wrapper_logits(name):
    if name in WRAPPER_REFUSED:
        with pytest.raises(VkformersError, match=name):
            AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)
        return
    ref = reference(name)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)
    mask = ref["attention_mask"].astype(np.int32)
    got = model(ref["input_ids"].astype(np.int32), attention_mask=mask).logits.numpy()
    real = np.cumsum(mask, axis=1) > 0
    np.testing.assert_allclose(got[real], ref["logits"][real], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("name", [n for n in fixture_folders(FIXTURES) if n not in WRAPPER_REFUSED])
def test_wrapper_greedy_tokens(name):
    ref = reference(name)
    want = ref["greedy_tokens"].astype(np.int64)
    prompt = ref["input_ids"][0:1].astype(np.int64)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)
    got = model.generate(prompt, max_new_tokens=want.shape[1] - prompt.shape[1], eos_token_id=[])
    np.testing.assert_array_equal(got, want)
