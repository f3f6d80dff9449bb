"""Assisted generation (models/assisted.py): prompt lookup and an assistant model drafting tokens that the main model
verifies in one forward over its cache, cut back to the tokens kept.

tests/data/assisted_generation.json (tools/make_assisted_generation_reference.py) holds transformers' assisted
generate on the tiny Llama of tests/data/pipeline, with tests/data/assisted/assistant (its first layer alone) or the
model itself as the assistant: the tokens, which are the plain greedy ones, and per round the draft tokens verified
and kept. vkformers must give the same tokens after the same rounds, keeping the same draft tokens. Sampling, the
verification forwards' replays, streaming and scores, and what assisted generation refuses are checked on
vkformers' own terms.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vkformers import get_device
from vkformers.models import generation
from vkformers.models.assisted import AssistedGenerationError, lookup_candidates, speculative_tokens
from vkformers.models.cache import CropError, KVCache
from vkformers.models.generation import _draw
from vkformers.models.loading import AutoModelForCausalLM

ROOT = Path(__file__).parent
REFERENCE = json.loads((ROOT / "data" / "assisted_generation.json").read_text())


@pytest.fixture(scope="module")
def main_model():
    return AutoModelForCausalLM.from_pretrained(ROOT / "data" / "pipeline", requires_grad=False)


@pytest.fixture(scope="module")
def small_model():
    return AutoModelForCausalLM.from_pretrained(ROOT / "data" / "assisted" / "assistant", requires_grad=False)


def case_arguments(case, main_model, small_model) -> dict:
    kwargs = dict(case["kwargs"])
    which = kwargs.pop("assistant", None)
    if which is not None:
        kwargs["assistant_model"] = main_model if which == "self" else small_model
        kwargs.update(case["assistant_generation_config"] or {})
    return kwargs


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=[c["name"] for c in REFERENCE["cases"]])
def test_assisted_greedy_gives_transformers_tokens_and_rounds(case, main_model, small_model):
    kwargs = case_arguments(case, main_model, small_model)
    for prompt, expected in zip(REFERENCE["prompts"], case["runs"]):
        ids = np.array([prompt])
        tokens = main_model.generate(ids, do_sample=False, **kwargs)
        stats = main_model.assisted_stats
        assert tokens[0].tolist() == expected["tokens"] == expected["plain"]
        assert len(stats.history) == len(expected["rounds"])
        length = len(prompt)
        for (drafted, kept), (their_drafted, their_kept) in zip(stats.history, expected["rounds"]):
            assert kept == their_kept
            # transformers' prompt lookup drafts past the tokens left (its verification cuts them); vkformers
            # drafts one fewer than the tokens left at most
            budget = kwargs["max_new_tokens"] - (length - len(prompt))
            assert drafted == min(their_drafted, budget - 1)
            length += kept + 1
        assert stats.accepted == sum(k for _, k in expected["rounds"])


def test_greedy_with_and_without_assistance_alike(main_model, small_model):
    """The plain greedy tokens (the main model's decode steps) are the assisted ones, drafts kept and rejected."""
    ids = np.array([[7, 8, 9, 7, 8, 9, 7, 8, 10, 11]])
    plain = main_model.generate(ids, max_new_tokens=16, do_sample=False)
    for kwargs in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": small_model, "num_assistant_tokens": 4,
                                                    "assistant_confidence_threshold": 0.0}):
        assert main_model.generate(ids, max_new_tokens=16, do_sample=False, **kwargs).tolist() == plain.tolist()


def test_drafts_are_used_and_verifications_replay(main_model, monkeypatch):
    """The model as its own assistant: every draft token kept, so far fewer rounds than tokens; the verification
    forwards replay recorded plans once two ran at different positions, padded to a power of two or not. Unpadded,
    the first round's forward (the held logits' 3 draft tokens, the others 4) runs at the prompt's end in every
    call, a position alone, so it never replays: its graph might depend on the position."""
    ids = np.array([REFERENCE["prompts"][0]])
    main_model.forget_captures()  # (the earlier tests' plans aside)
    plain = main_model.generate(ids, max_new_tokens=20, do_sample=False)
    for padding in (False, True):
        monkeypatch.setitem(generation.DRAFT_PADDING, "cpu" if get_device().is_cpu else "gpu", padding)
        for _ in range(2):  # the second call replays what the first recorded
            tokens = main_model.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=main_model,
                                         num_assistant_tokens=3, assistant_confidence_threshold=0.0)
            assert tokens.tolist() == plain.tolist()
        stats = main_model.assisted_stats
        assert stats.accepted == stats.drafted == 15 and stats.rounds == 5
        assert stats.forwards == 5 and stats.replayed == (5 if padding else 4)  # a verification per round
    main_model.generate(ids, max_new_tokens=0, prompt_lookup_num_tokens=3)
    assert main_model.assisted_stats.rounds == main_model.assisted_stats.drafted == 0  # this call's, not the last's


def test_a_graph_that_depends_on_the_position_is_not_replayed_at_another(monkeypatch):
    """Gemma 4's layers that read an earlier layer's keys attend over the stored keys sliced to their count, so its
    verification forward's graph differs by position. The first two rounds verify at the same position (the
    prompt's held logits and its draft, then the first token and the next draft; padded to one length here): their
    plans agree there, which must not make the later rounds replay that plan at other positions."""
    monkeypatch.setitem(generation.DRAFT_PADDING, "cpu", True)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "gemma4_text", requires_grad=False)
    base = [34, 26, 21, 12, 14, 4]
    ids = np.array([base + base + base[:3]])
    plain = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])
    for _ in range(2):
        tokens = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[], prompt_lookup_num_tokens=3)
        assert tokens.tolist() == plain.tolist()
    assert model.assisted_stats.drafted > model.assisted_stats.accepted > 0  # drafts kept and rejected


def test_a_model_whose_steps_must_not_replay_runs_each_forward(small_model):
    """A model whose decode step depends on more than its inputs (capture_decode False: a plugin's host-built
    masks) runs every forward of assisted generation in Python, as plain generate runs its steps."""
    model = AutoModelForCausalLM.from_pretrained(ROOT / "data" / "pipeline", requires_grad=False)
    object.__setattr__(model, "capture_decode", False)
    ids = np.array([[7, 8, 9, 7, 8, 9, 7, 8, 10, 11]])
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    for kwargs in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": model, "num_assistant_tokens": 2}):
        for _ in range(2):
            assert model.generate(ids, max_new_tokens=12, do_sample=False, **kwargs).tolist() == plain.tolist()
        stats = model.assisted_stats
        assert stats.forwards > 2 and stats.replayed == 0
        held = getattr(model, "_held_draft", None)
        assert held is None or held[1].replays == 0  # the assistant's steps too


def test_prompt_lookup_drafts_from_the_sequence():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3])
    everything = lambda seq, token: True  # noqa: E731
    assert lookup_candidates(tokens, 3, 2, [], everything).tolist() == [4, 9, 2]  # the first match of (2, 3)
    assert lookup_candidates(tokens, 3, 2, [9], everything).tolist() == [4]  # cut at an end-of-sequence token
    assert lookup_candidates(tokens, 3, 2, [], lambda seq, token: token != 9).tolist() == [4]
    # a match whose first token is banned is passed over for the next
    assert lookup_candidates(tokens, 2, 2, [], lambda seq, token: token != 4).tolist() == [5, 6]
    assert lookup_candidates(np.array([1, 2, 3]), 3, 2, [], everything).tolist() == []
    assert lookup_candidates(np.array([4, 1, 7, 1]), 3, 2, [], everything).tolist() == [7, 1]  # unigram


def test_speculative_sampling_follows_the_main_model():
    """Kept with probability min(1, p/q), the first rejection redrawn from max(p - q, 0): the first token is
    distributed as the main model's p whatever the assistant's q."""
    rng = np.random.default_rng(0)
    q = np.array([[0.6, 0.3, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p = np.array([[0.2, 0.3, 0.4, 0.1], [0.1, 0.1, 0.1, 0.7], [0.5, 0.5, 0.0, 0.0]])
    counts = np.zeros(4)
    kept_all = 0
    draws = 20000
    for _ in range(draws):
        first = _draw(q[:1], rng)[0]
        second = _draw(q[1:], rng)[0]
        tokens, kept = speculative_tokens(np.array([first, second]), q, p, rng, _draw)
        counts[tokens[0]] += 1
        kept_all += kept == 2
        assert len(tokens) == kept + 1
    np.testing.assert_allclose(counts / draws, p[0], atol=0.015)
    assert 0 < kept_all < draws
    same, kept = speculative_tokens(np.array([1, 3]), p[:2], p, rng, _draw)  # p == q: every draft token kept
    assert kept == 2 and same[:2].tolist() == [1, 3]


def test_sampling_is_seeded_and_keeps_an_identical_assistants_drafts(main_model):
    ids = np.array([REFERENCE["prompts"][1]])
    runs = [main_model.generate(ids, max_new_tokens=12, do_sample=True, seed=5, top_k=0, assistant_model=main_model,
                                num_assistant_tokens=4, assistant_confidence_threshold=0.0) for _ in range(2)]
    stats = main_model.assisted_stats
    assert runs[0].tolist() == runs[1].tolist() and runs[0].shape == (1, len(ids[0]) + 12)
    assert stats.accepted == stats.drafted > 0  # p == q: speculative sampling keeps every draft token
    looked = [main_model.generate(ids, max_new_tokens=12, do_sample=True, seed=5, prompt_lookup_num_tokens=3)
              for _ in range(2)]
    assert looked[0].tolist() == looked[1].tolist()


def test_stream_and_scores_follow_the_tokens(main_model):
    ids = np.array([REFERENCE["prompts"][0]])
    streamed = []
    plain = main_model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                                output_scores=True, output_logits=True)
    out = main_model.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True,
                              output_scores=True, output_logits=True, prompt_lookup_num_tokens=4,
                              streamer=lambda tokens: streamed.append(int(tokens[0])))
    assert out.sequences.tolist() == plain.sequences.tolist() and streamed == plain.sequences[0, -10:].tolist()
    assert len(out.scores) == len(out.logits) == 10
    np.testing.assert_allclose(np.concatenate(out.scores), np.concatenate(plain.scores), atol=1e-4)
    np.testing.assert_allclose(np.concatenate(out.logits), np.concatenate(plain.logits), atol=1e-4)


def test_heuristic_draft_length_carries_over(small_model, main_model):
    """transformers' "heuristic" schedule: 2 more draft tokens after a round that kept all, 1 fewer otherwise, the
    length reached kept in the assistant's generation config for its next call ("heuristic_transient": not kept)."""
    ids = np.array([REFERENCE["prompts"][2]])
    small_model.generation_config = {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic",
                                     "assistant_confidence_threshold": 0.0}
    try:
        main_model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=small_model)
        history = main_model.assisted_stats.history
        length, made = 5, 0
        for drafted, kept in history:
            assert drafted == min(length, 8 - made - 1)  # one token left for the main model's own
            length = length + 2 if kept == drafted else max(1, length - 1)
            made += kept + 1
        assert small_model.generation_config["num_assistant_tokens"] == length
        assert len({drafted for drafted, _ in history}) > 1  # the schedule moved
        main_model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=small_model)
        assert main_model.assisted_stats.history[0][0] == length
        small_model.generation_config["num_assistant_tokens_schedule"] = "heuristic_transient"
        main_model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=small_model)
        assert small_model.generation_config["num_assistant_tokens"] == length
    finally:
        small_model.generation_config = {}


def test_refusals(main_model, small_model):
    ids = np.array([[5, 6, 7]])
    cases = [
        (dict(input_ids=np.array([[5, 6, 7], [8, 9, 10]]), prompt_lookup_num_tokens=2), "batch size 2"),
        (dict(num_return_sequences=2, do_sample=True, prompt_lookup_num_tokens=2), "num_return_sequences 2"),
        (dict(num_beams=2, prompt_lookup_num_tokens=2), "beam search"),
        (dict(prompt_lookup_num_tokens=-1), "prompt_lookup_num_tokens must be a whole number >= 1"),
        (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens must be a whole number >= 1"),
        (dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=0), "max_matching_ngram_size"),
        (dict(prompt_lookup_num_tokens=2, assistant_model=small_model), "not both"),
        (dict(num_assistant_tokens=3), "drafts nothing"),
        (dict(assistant_model=small_model, num_assistant_tokens=0), "num_assistant_tokens"),
        (dict(assistant_model=small_model, num_assistant_tokens_schedule="fast"), "num_assistant_tokens_schedule"),
        (dict(assistant_model=small_model, assistant_confidence_threshold=2), "assistant_confidence_threshold"),
        (dict(assistant_model=small_model, assistant_tokenizer=object()), "universal assisted decoding"),
        (dict(assistant_model="gpt2"), "vkformers causal LM"),
    ]
    for kwargs, message in cases:
        kwargs = {"input_ids": ids, **kwargs}
        with pytest.raises(AssistedGenerationError, match=message):
            main_model.generate(max_new_tokens=4, **kwargs)
    other = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "llama", requires_grad=False)
    with pytest.raises(AssistedGenerationError, match=r"vocabulary \(48 tokens\) is not this model's \(300\)"):
        main_model.generate(ids, max_new_tokens=4, assistant_model=other)
    recurrent = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "mamba", requires_grad=False)
    with pytest.raises(AssistedGenerationError, match="cannot forget rejected draft tokens"):
        recurrent.generate(ids, max_new_tokens=4, prompt_lookup_num_tokens=2)


def test_a_cache_that_cannot_forget_tokens_is_refused_before_a_token():
    """Layers that keep state on the cache besides keys and values (DeepSeek-V3.2's indexer keys) cannot forget
    rejected draft tokens: refused, as the main model or as the assistant, before any token is streamed."""
    indexed = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "deepseek_v32", requires_grad=False)
    llama = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "llama", requires_grad=False)
    ids = np.array([[5, 6, 7, 5, 6]])
    for model, role, kwargs in ((indexed, "this model", {"prompt_lookup_num_tokens": 2}),
                                (llama, "the assistant", {"assistant_model": indexed})):
        streamed = []
        with pytest.raises(AssistedGenerationError, match=f"{role} .* keeps index_keys on its cache .* cannot forget "
                                                          "rejected draft tokens; generate without"):
            model.generate(ids, max_new_tokens=4, streamer=streamed.append, **kwargs)
        assert streamed == []


def test_crop_refuses_a_recurrent_state():
    cache = KVCache(1, 1, 1, 4, max_len=8)
    cache.linear_states = {0: None}
    with pytest.raises(CropError, match="linear_states"):
        cache.crop(0)
