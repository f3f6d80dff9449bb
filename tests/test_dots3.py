"""dots3-note's text decoder beyond its parity fixture (tests/test_decoder_parity.py and the others on
tests/fixtures/dots3_note_text, whose layers differ in MLA sizes): a left-padded row generates what it generates
alone (the cache holds each layer's keys flattened, padding masked), gradient checkpointing, refused options."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkpoint_checks import assert_checkpointing_keeps_gradients

from vkformers.models.decoder import UnsupportedConfigError
from vkformers.models.loading import AutoModelForCausalLM, load_config

pytest.importorskip("vkformers_moe")

from vkformers_moe.variants import dots3_note_text  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "dots3_note_text"


def _model():
    return AutoModelForCausalLM.from_pretrained(FIXTURES, dtype="float32")


def test_a_padded_row_generates_as_alone():
    model = _model()
    row = np.array([29, 14, 9, 42, 31, 14])
    ids = np.array([[47, 12, 41, 18, 46, 27, 10, 31], [0, 0, *row]])
    mask = (np.arange(8)[None] >= np.array([[0], [2]])).astype(np.int64)
    both = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    alone = model.generate(row[None], max_new_tokens=10, eos_token_id=[])
    np.testing.assert_array_equal(both[1, 2:], alone[0])


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = np.random.default_rng(1).integers(3, 48, (2, 10)).astype(np.int32)
    assert_checkpointing_keeps_gradients(_model, ids)


@pytest.mark.parametrize("change, option", [
    (dict(layer_types=["chunked_attention", "indexed_attention"]), "layer_types"),
    (dict(per_layer_config={"0": {"q_lora_rank": None}}), "q_lora_rank"),
    (dict(output_router_logits=True), "output_router_logits"),
])
def test_unsupported_options_are_refused_by_name(change, option):
    with pytest.raises(UnsupportedConfigError, match=option):
        dots3_note_text(dict(load_config(FIXTURES), **change))
