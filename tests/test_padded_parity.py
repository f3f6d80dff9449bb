"""Padded batches against transformers, for every decoder fixture: tests/fixtures/<name>/padded.safetensors
(tools/make_padded_references.py).

- Greedy generate on the fixture's batch itself (row 1 left-padded by 2, with its attention_mask), 12 new tokens,
  eos off: the tokens of both rows equal transformers' ``generate`` on the same padded batch, and so do the logits
  of every step while the tokens agree (1e-4 absolute, the decoder parity's logits tolerance).
- The pad row's gradient: the fixture's batch with the pad id also a real, attended token of row 0. Where
  transformers builds the token embedding with ``padding_idx`` (index.json ``padding_idx``), no lookup passes that
  row gradient and only a tied LM head's share is left; where it does not (GPT-2's wte) every lookup does. The
  loss within 1e-5 relative, the row within 1e-3 of its largest value (floor 1e-5 absolute: a row that is exactly
  zero in transformers).

Where transformers' own padded generate is not pad-invariant (index.json ``padded_generate_pad_invariant`` false:
a row's tokens or logits differ from that row generated alone), the reference is still transformers' padded result;
the test names that in its failure message.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from fixture_cases import CLEAN_GENERATION, with_known_failures
from test_decoder_parity import FIXTURES, LOGITS_ATOL, LOSS_RTOL, _unsupported_reason, fixture_names
from test_encoder_parity import FIXTURES as ENCODER_FIXTURES
from test_encoder_parity import _inputs as encoder_inputs
from test_encoder_parity import _reference as encoder_reference
from test_encoder_parity import fixture_names as encoder_fixture_names
from test_encoder_parity import unsupported_reason as encoder_unsupported_reason
from test_seq2seq_parity import FIXTURES as SEQ2SEQ_FIXTURES
from test_seq2seq_parity import fixture_names as seq2seq_fixture_names
from vkformers.models.loading import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
from vkformers.models.safetensors_io import read_safetensors

PADDED = "padded.safetensors"
ROW_RTOL, ROW_FLOOR = 1e-3, 1e-5

# Known to differ from transformers, each with the open bug that covers it (fixed in the architecture's plugin):
# none today.
KNOWN_PADDED_GENERATE_FAILURES: dict[str, str] = {}
KNOWN_PAD_GRADIENT_FAILURES: dict[str, str] = {}


def _index() -> dict:
    return json.loads((FIXTURES / "index.json").read_text()).get("built", {})


def _reference(name: str) -> dict:
    path = FIXTURES / name / PADDED
    assert path.is_file(), f"{name}: no {PADDED}; run tools/make_padded_references.py --only {name}"
    return {k: e.as_float() for k, e in read_safetensors(path).items()}


def _model(name: str):
    reason = _unsupported_reason(FIXTURES / name)
    if reason:
        pytest.skip(f"not implemented: {reason}")
    return AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")


def _cases(known: dict) -> list:
    return with_known_failures(fixture_names(), known)


@pytest.mark.parametrize("name", _cases(KNOWN_PADDED_GENERATE_FAILURES))
def test_padded_generate(name):
    ref = _reference(name)
    model = _model(name)
    want = ref["generate_tokens"].astype(np.int64)
    ids, mask = (read_safetensors(FIXTURES / name / "reference.safetensors")[k].as_float().astype(np.int64)
                 for k in ("input_ids", "attention_mask"))
    prompt = ids.shape[1]
    got = model.generate(ids, attention_mask=mask, max_new_tokens=want.shape[1] - prompt, eos_token_id=[],
                         **CLEAN_GENERATION)
    invariant = _index().get(name, {}).get("padded_generate_pad_invariant", True)
    note = "" if invariant is True else " (transformers' padded generate is not pad-invariant for it: index.json)"
    for row in range(ids.shape[0]):
        if np.array_equal(got[row], want[row]):
            continue
        step = int(np.argmax(got[row] != want[row])) - prompt
        pytest.fail(f"{name}: row {row}'s tokens differ from step {step} on{note}; transformers' logits there: "
                    f"top {np.sort(ref['generate_logits'][step, row])[-2:].tolist()}\n got  {got[row].tolist()}\n"
                    f" want {want[row].tolist()}")


@pytest.mark.parametrize("name", _cases(KNOWN_PAD_GRADIENT_FAILURES))
def test_pad_row_gradient(name):
    ref = _reference(name)
    model = _model(name)
    ids, mask, labels = (ref[f"pad_grad_{k}"].astype(np.int32) for k in ("input_ids", "attention_mask", "labels"))
    pad = int(ids[1, 0])  # row 1 is left-padded with the pad id
    out = model(ids, attention_mask=mask, labels=labels)
    loss = out.loss.item()
    out.loss.backward()
    error = abs(loss - float(ref["pad_grad_loss"])) / abs(float(ref["pad_grad_loss"]))
    assert error <= LOSS_RTOL, f"{name}: loss {loss} vs {float(ref['pad_grad_loss'])} (relative error {error:.3g})"
    want = ref["pad_grad_embedding_row"]
    grad = model.embed.weight.grad
    assert grad is not None, f"{name}: the token embedding got no gradient"
    got = grad.numpy()[pad]
    error, bound = np.abs(got - want).max(), ROW_RTOL * max(np.abs(want).max(), ROW_FLOOR / ROW_RTOL)
    assert error <= bound, (f"{name}: the pad row's gradient differs by {error:.3g} (tolerance {bound:.3g}; "
                            f"transformers' padding_idx: {_index().get(name, {}).get('padding_idx')}); "
                            f"max |ours| {np.abs(got).max():.3g}, max |theirs| {np.abs(want).max():.3g}")


@pytest.mark.parametrize("name", encoder_fixture_names())
def test_encoder_pad_row_gradient(name):
    """The encoders' word embedding: the fixture's (right-padded) batch with the pad id also a real token of row 0
    (encoders/<name>/padded.safetensors); every family but ESM C has padding_idx = pad_token_id in transformers.
    The masked-LM loss within 1e-5 relative, the pad row within 1e-3 of its largest value (floor 1e-5)."""
    if encoder_unsupported_reason(ENCODER_FIXTURES / name):
        pytest.skip("not implemented")
    ref = {k: e.as_float() for k, e in read_safetensors(ENCODER_FIXTURES / name / PADDED).items()}
    fixture = encoder_reference(ENCODER_FIXTURES / name)
    model = AutoModelForMaskedLM.from_pretrained(ENCODER_FIXTURES / name, dtype="float32")
    inputs = dict(encoder_inputs(fixture), input_ids=ref["pad_grad_input_ids"].astype(np.int32))
    out = model(**inputs, labels=fixture["labels"].astype(np.int32))
    out.loss.backward()
    want_loss = float(ref["pad_grad_loss"])
    loss = out.loss.item()
    assert abs(loss - want_loss) <= LOSS_RTOL * abs(want_loss), f"{name}: loss {loss} vs {want_loss}"
    pad = int(fixture["input_ids"][1, -1])  # row 1 is right-padded with the pad id
    got = model.word.weight.grad.numpy()[pad]
    want = ref["pad_grad_embedding_row"]
    error, bound = np.abs(got - want).max(), ROW_RTOL * max(np.abs(want).max(), ROW_FLOOR / ROW_RTOL)
    assert error <= bound, f"{name}: the pad row's gradient differs by {error:.3g} (tolerance {bound:.3g})"


@pytest.mark.parametrize("name", seq2seq_fixture_names())
def test_seq2seq_padded_generate(name):
    """Greedy generate from both rows of an encoder-decoder fixture's batch at once (row 1 right-padded by 2, with its
    attention_mask; seq2seq/<name>/padded.safetensors), eos off: transformers' tokens, and every step's logits of
    both rows within 1e-4."""
    ref = {k: e.as_float() for k, e in read_safetensors(SEQ2SEQ_FIXTURES / name / PADDED).items()}
    fixture = {k: e.as_float() for k, e in read_safetensors(SEQ2SEQ_FIXTURES / name / "reference.safetensors").items()}
    model = AutoModelForSeq2SeqLM.from_pretrained(SEQ2SEQ_FIXTURES / name, dtype="float32", requires_grad=False)
    want = ref["generate_tokens"].astype(np.int64)
    tokens, logits = model.generate(fixture["input_ids"].astype(np.int64),
                                    attention_mask=fixture["attention_mask"].astype(np.int64),
                                    max_new_tokens=want.shape[1] - 1, eos_token_id=[], output_logits=True,
                                    **CLEAN_GENERATION)
    assert tokens.tolist() == want.tolist(), f"{name}: {tokens.tolist()} vs transformers {want.tolist()}"
    error = np.abs(logits - ref["generate_logits"]).max()
    assert error <= LOGITS_ATOL, f"{name}: step logits differ from transformers' by {error:.3g}"
