"""CPM-Ant beyond its parity fixture (tests/test_decoder_parity.py and the others on tests/fixtures/cpmant): its
bias, mask and prompt ids are built on the host from the ids, so a captured step (the trainer's) must follow each
batch's padding; gradient checkpointing; the refused config option."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkpoint_checks import assert_checkpointing_keeps_gradients

from vkformers.engine import lazy
from vkformers.models.decoder import UnsupportedConfigError
from vkformers.models.loading import AutoModelForCausalLM, load_config
from vkformers_llama.variants import cpmant

FIXTURES = Path(__file__).parent / "fixtures" / "cpmant"


def _model():
    return AutoModelForCausalLM.from_pretrained(FIXTURES, dtype="float32")


def test_a_captured_step_follows_each_batch_padding():
    model, step = _model(), lazy.StepCapture()
    rng = np.random.default_rng(5)
    batches = [rng.integers(3, 48, size=(2, 7)).astype(np.int32) for _ in range(3)]
    batches[2][1, :3] = 0  # id 0 is CPM-Ant's padding: another mask and other segments than the batches before

    def run(ids):
        return step.run(lambda: [model(ids, labels=ids).loss], {"ids": ids})[0]

    for ids in batches:  # replayed or run anew, each step's loss is its batch's
        np.testing.assert_allclose(run(ids), model(ids, labels=ids).loss.numpy(), rtol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = np.random.default_rng(1).integers(3, 48, (2, 10)).astype(np.int32)
    ids[0, :2] = 0
    assert_checkpointing_keeps_gradients(_model, ids)


def test_dropout_is_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="dropout_p"):
        cpmant(dict(load_config(FIXTURES), dropout_p=0.1))
