"""generate records the decode step of state-space, hybrid and linear-attention models once and replays it for every
later token, as it does for attention-only models: its cache keeps their recurrent states in persistent buffers
overwritten in place (KVCache.keep_states_in_place, as a server's batch does). The replayed tokens are transformers'
(the fixture's greedy tokens, chained 8 steps a submission as tests/conftest.py sets) and the Python forward's; the
forward's call count shows the replay ran."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.safetensors_io import read_safetensors

FIXTURES = Path(__file__).parent / "fixtures"
RECURRENT = ["mamba", "mamba2", "falcon_mamba", "bamba", "jamba", "falcon_h1", "nemotron_h", "granitemoehybrid",
             "zamba", "zamba2", "lfm2", "lfm2_moe", "recurrent_gemma", "rwkv", "xlstm", "minimax", "qwen3_next",
             "kimi_linear", "qwen3_5_text", "olmo_hybrid"]
PREFILL_NOT_REPLAYED = {"lfm2_moe", "kimi_linear"}  # their prefill realizes more than once


def _load(name):
    reference = read_safetensors(FIXTURES / name / "reference.safetensors")
    want = reference["greedy_tokens"].as_float().astype(np.int64)
    ids = reference["input_ids"].as_float().astype(np.int32)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)
    return model, ids, want


def _count_forwards(model) -> list:
    calls, forward = [], model.forward
    object.__setattr__(model, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    return calls


def _replay_off(model, monkeypatch) -> None:
    monkeypatch.setattr(model, "capture_decode", False, raising=False)
    monkeypatch.setattr(model, "capture_decode_with_row_states", False, raising=False)


def assert_generate_replays(model, ids, want) -> list:
    """generate gives ``want`` (transformers' greedy tokens) from the first row of ``ids`` with the decode step
    replayed from the third forward on; returns the forward calls counted (for more generate calls)."""
    prompt, new = ids[:1], want.shape[1] - ids.shape[1]
    calls = _count_forwards(model)
    assert model.replays_decode()
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=new, eos_token_id=[]), want)
    assert len(calls) == 3  # the prefill and two decode steps (recorded, confirmed); the rest replayed
    return calls


@pytest.mark.parametrize("name", RECURRENT)
def test_replayed_decode_gives_transformers_tokens(name, monkeypatch):
    model, ids, want = _load(name)
    prompt, new = ids[:1], want.shape[1] - ids.shape[1]
    calls = assert_generate_replays(model, ids, want)
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=new, eos_token_id=[]), want)
    assert len(calls) == 4  # the prefill only: the decode step replays from the first token
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=new, eos_token_id=[]), want)
    # a prompt of that shape a third time: its prefill replays too, unless it realizes more than once (MoE routing)
    assert len(calls) == (5 if name in PREFILL_NOT_REPLAYED else 4)
    done = len(calls)
    _replay_off(model, monkeypatch)
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=new, eos_token_id=[]), want)
    assert len(calls) == done + new  # every step through the Python forward


@pytest.mark.parametrize("name", ["mamba", "bamba", "rwkv", "qwen3_next"])
def test_replayed_left_padded_batch_equals_the_python_path(name, monkeypatch):
    """Rows of different padding decode together from in-place states: the replayed steps choose the tokens the
    Python forward does."""
    model, ids, _ = _load(name)
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    calls = _count_forwards(model)
    replayed = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    assert len(calls) == 3
    _replay_off(model, monkeypatch)
    built = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    assert len(calls) == 3 + 1 + 9
    np.testing.assert_array_equal(replayed, built)
