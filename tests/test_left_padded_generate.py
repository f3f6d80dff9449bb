"""Greedy generate of left-padded batches against transformers' (tests/data/left_padded_generate.safetensors,
written by tools/make_left_padded_generate.py from the fixtures' own checkpoints).

The fixtures here are those whose generate path once differed under left padding while their forward matched:
the positions generate gives a padded row (transformers 5: 0 at the pads), DeepSeek-V4's compressed entries (which
pool padded tokens, and which a decode step sees all of), MiniMax-M3's indexer (key slots against the query's
position), TrOCR's positions (its forward reads no position_ids: learned ones count the pads, sinusoidal ones count
them from the first new token on). Each batch has an unpadded row and rows with different amounts of left padding.

Compared: the tokens (exactly), and the raw logits of every step (1e-4 absolute), read from the forwards generate
runs; for a model whose decode steps are captured and replayed (no forward to read), from a second generate with
capture off, whose tokens must also agree.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.safetensors_io import read_safetensors

DATA = Path(__file__).parent / "data" / "left_padded_generate.safetensors"
FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = {k: e.as_float() for k, e in read_safetensors(DATA).items()}
NAMES = sorted({k.split(".")[0] for k in REFERENCE})
LOGITS_ATOL = 1e-4


def _generate_recording(model, ids, mask, new_tokens):
    """generate's tokens and the last position's logits of each forward it ran."""
    steps, forward = [], model.forward
    model.forward = lambda *args, **kwargs: steps.append(forward(*args, **kwargs)) or steps[-1]
    try:
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0)
    finally:
        del model.forward
    return np.asarray(tokens), [out.logits.numpy()[:, -1] for out in steps]


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_generate_matches_transformers(name):
    ids = REFERENCE[f"{name}.input_ids"].astype(np.int32)
    mask = REFERENCE[f"{name}.attention_mask"].astype(np.int32)
    expected_tokens = REFERENCE[f"{name}.tokens"].astype(np.int64)
    expected_logits = REFERENCE[f"{name}.logits"]  # [rows, steps, vocab]
    new_tokens = expected_logits.shape[1]
    assert (mask[1:] == 0).any(axis=1).all() and len(set(mask.sum(1).tolist())) == mask.shape[0]  # varied padding

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")
    tokens, logits = _generate_recording(model, ids, mask, new_tokens)
    np.testing.assert_array_equal(tokens, expected_tokens, err_msg=f"{name}: generated tokens differ")
    if len(logits) != new_tokens:  # captured decode steps ran no forward: once more without capture
        model.capture_decode = False
        uncaptured, logits = _generate_recording(model, ids, mask, new_tokens)
        np.testing.assert_array_equal(uncaptured, expected_tokens)
    assert len(logits) == new_tokens
    errors = [float(np.abs(got - expected_logits[:, step]).max()) for step, got in enumerate(logits)]
    assert max(errors) <= LOGITS_ATOL, f"{name}: step logits differ by {np.round(errors, 5).tolist()}"
