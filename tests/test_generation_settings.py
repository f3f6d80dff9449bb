"""generate's settings as transformers resolves them (models/generation_settings.py): the call's arguments, then the
checkpoint's generation_config.json, then transformers' defaults, and the logits processors they turn on.

tests/data/generation_settings.json (tools/make_generation_settings_reference.py) holds transformers' greedy tokens
for fixtures run with forced bos and eos tokens, banned words (one and several tokens), suppressed tokens at every
step and at the first, n-gram blocking, a minimum length, and generation_config.json files that set these with a
repetition penalty and lengths; each case changes the plain greedy output (the script prints both). vkformers must
give the same tokens. ``return_dict_in_generate`` with ``output_scores`` and ``output_logits`` gives transformers'
processed scores, raw logits and transition scores. The sampling defaults, the beam-search warning, saving the
generation config and bad arguments are checked on vkformers' own terms.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from vkformers.errors import InputError
from vkformers.models.generation import sampling_probabilities
from vkformers.models.generation_settings import LogitRules, end_token_ids, sampling_settings
from vkformers.models.loading import AutoModelForCausalLM, AutoModelForSeq2SeqLM

ROOT = Path(__file__).parent
REFERENCE = json.loads((ROOT / "data" / "generation_settings.json").read_text())


def fixture_copy(tmp_path, fixture, generation_config=None):
    folder = tmp_path / "model"
    shutil.copytree(ROOT / "fixtures" / fixture, folder)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def custom_arguments(name: str) -> dict:
    """generate's arguments for a reference case's "custom" name, as the script's functions are for torch."""
    if name == "prefix_even_odd":
        return {"prefix_allowed_tokens_fn": lambda batch_id, ids: list(range(0, 48, 2)) if batch_id == 0
                else list(range(30))}
    if name == "boost_seven_ban_five":
        def processor(ids, scores):
            scores[:, 7] += 2.0
            scores[:, 5] = -np.inf
            return scores
        return {"logits_processor": [processor]}
    if name == "stop_after_28":
        return {"stopping_criteria": [lambda ids, scores: ids[:, -1] == 28]}
    raise ValueError(name)


def with_custom(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    custom = kwargs.pop("custom", None)
    return {**kwargs, **custom_arguments(custom)} if custom is not None else kwargs


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=[c["name"] for c in REFERENCE["cases"]])
def test_generate_gives_transformers_tokens_under_its_settings(case, tmp_path):
    folder = fixture_copy(tmp_path, case["fixture"], case["generation_config"])
    if case["kind"].startswith("seq2seq"):
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, requires_grad=False)
        ids = np.array(REFERENCE["seq2seq_prompts" if case["kind"] == "seq2seq_batch" else "seq2seq_prompt"],
                       np.int64)
        mask = np.ones_like(ids)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, requires_grad=False)
        ids = np.array(REFERENCE["decoder_prompts"], np.int64)
        mask = np.array(REFERENCE["decoder_mask"], np.int64)
    tokens = model.generate(ids, attention_mask=mask, do_sample=False, **with_custom(case["kwargs"]))
    assert tokens.tolist() == case["tokens"]


@pytest.mark.parametrize("case", REFERENCE["warpers"], ids=lambda c: f"t{c['temperature']}-k{c['top_k']}-p"
                         f"{c['top_p']}-min{c['min_p']}-typ{c.get('typical_p', 1)}-eps{c.get('epsilon_cutoff', 0)}"
                         f"-eta{c.get('eta_cutoff', 0)}")
def test_sampling_draws_from_transformers_warped_distribution(case):
    """temperature, top-k, top-p, min-p, then typical, epsilon and eta cutoffs in transformers' order: the same
    probabilities within 1e-6."""
    rules = LogitRules(**{name: case[name] for name in ("typical_p", "epsilon_cutoff", "eta_cutoff") if name in case})
    probs = sampling_probabilities(np.array(REFERENCE["warper_scores"], np.float32), case["temperature"],
                                   case["top_k"], case["top_p"], case["min_p"], rules)
    np.testing.assert_allclose(probs, case["probabilities"], atol=1e-6, rtol=0)


# The llama fixture's float32 logits against transformers' (eager attention on the CPU), and the scores and
# log-probabilities derived from them
OUTPUT_TOLERANCE = 1e-5


def same_scores(ours, theirs):
    """Equal where transformers' are -inf (tokens a processor or warper dropped), within OUTPUT_TOLERANCE elsewhere."""
    theirs = np.asarray(theirs, np.float32)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    dropped = np.isneginf(theirs)
    assert (np.isneginf(ours) == dropped).all()
    np.testing.assert_allclose(ours[~dropped], theirs[~dropped], atol=OUTPUT_TOLERANCE, rtol=0)


@pytest.mark.parametrize("case", REFERENCE["outputs"], ids=[c["name"] for c in REFERENCE["outputs"]])
def test_generate_returns_transformers_scores_and_logits(case):
    """Each step's scores after the processors (greedy: repetition penalty, n-gram blocking) or the warpers
    (sampling: temperature, top-k, top-p, the dropped tokens at -inf), the raw logits, and compute_transition_scores'
    log-probabilities; a sampled sequence is numpy's draw, so only its first step is compared."""
    model = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "llama", requires_grad=False)
    ids = np.array(REFERENCE["decoder_prompts"], np.int64)
    out = model.generate(ids, attention_mask=np.array(REFERENCE["decoder_mask"], np.int64), seed=0,
                         return_dict_in_generate=True, output_scores=True, output_logits=True,
                         **{"do_sample": False, **with_custom(case["kwargs"])})
    assert out.keys() == ["sequences", "scores", "logits"] and out[0] is out.sequences and out["scores"] is out.scores
    assert len(out.scores) == len(out.logits) == out.sequences.shape[1] - ids.shape[1] == len(case["scores"])
    for ours, theirs in zip(out.scores, case["scores"]):
        same_scores(ours, theirs)
    for ours, theirs in zip(out.logits, case["logits"]):
        np.testing.assert_allclose(ours, theirs, atol=OUTPUT_TOLERANCE, rtol=0)
    if not case["kwargs"].get("do_sample"):
        assert out.sequences.tolist() == case["sequences"]
        np.testing.assert_allclose(model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True),
                                   case["transition_scores"], atol=OUTPUT_TOLERANCE, rtol=0)
    plain = model.generate(ids, attention_mask=np.array(REFERENCE["decoder_mask"], np.int64), seed=0,
                           **{"do_sample": False, **with_custom(case["kwargs"])})
    assert plain.tolist() == out.sequences.tolist()  # returning scores changes no token


def test_generate_output_options_alone_and_with_beams():
    model = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "llama", requires_grad=False)
    ids = np.array(REFERENCE["decoder_prompts"], np.int64)
    tokens = model.generate(ids, max_new_tokens=4, output_scores=True)  # without return_dict: the array, as before
    assert isinstance(tokens, np.ndarray)
    out = model.generate(ids, max_new_tokens=4, return_dict_in_generate=True)
    assert out.keys() == ["sequences"] and out.scores is None and out.sequences.tolist() == tokens.tolist()
    beams = model.generate(ids, max_new_tokens=4, num_beams=2, return_dict_in_generate=True)
    assert beams.sequences.tolist() == model.generate(ids, max_new_tokens=4, num_beams=2).tolist()
    with pytest.raises(InputError, match="output_scores and output_logits with beam search"):
        model.generate(ids, max_new_tokens=4, num_beams=2, return_dict_in_generate=True, output_scores=True)
    with pytest.raises(InputError, match="output_logits must be True or False"):
        model.generate(ids, max_new_tokens=4, output_logits="yes")


def test_sampling_takes_the_generation_configs_settings_then_transformers_defaults(tmp_path):
    assert sampling_settings((None, {}), do_sample=True) == {"do_sample": True, "temperature": 1.0, "top_k": 50,
                                                              "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    configured = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.8, "min_p": 0.1,
                  "repetition_penalty": 1.1}
    assert sampling_settings(({**configured, "top_k": 0},), top_k=7) == {**configured, "top_k": 7}
    model = AutoModelForCausalLM.from_pretrained(fixture_copy(tmp_path, "llama", {**configured, "eos_token_id": 2}),
                                                 requires_grad=False)
    prompt = np.array([[5, 17, 22, 9]], np.int64)
    drawn = model.generate(prompt, max_new_tokens=8, seed=3)  # samples, as the generation config says
    explicit = {k: v for k, v in configured.items()}
    np.testing.assert_array_equal(drawn, model.generate(prompt, max_new_tokens=8, seed=3, **explicit))
    assert not np.array_equal(drawn, model.generate(prompt, max_new_tokens=8, seed=3, do_sample=False))


def test_a_generation_config_asking_for_beams_a_model_does_not_run_warns_and_is_saved_again(tmp_path):
    """Mamba-2 keeps recurrent state per row, which beams do not move: no beam search."""
    config = {"eos_token_id": 2, "pad_token_id": 0, "num_beams": 4}
    model = AutoModelForCausalLM.from_pretrained(fixture_copy(tmp_path, "mamba2", config), requires_grad=False)
    prompt = np.array([[5, 17, 22, 9]], np.int64)
    with pytest.warns(UserWarning, match=r"beam search \(num_beams=4\)"):
        model.generate(prompt, max_new_tokens=2)
    with pytest.raises(InputError, match="beam search"):
        model.generate(prompt, max_new_tokens=2, num_beams=3)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text()) == config


@pytest.mark.parametrize("argument, message", [
    ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences=3 is more than num_beams=2"),
    ({"num_beams": 2, "do_sample": True}, "beam sampling"),
    ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping must be"),
    ({"num_beams": 0}, "num_beams must be a whole number >= 1"),
])
def test_bad_beam_arguments_are_refused_by_name(argument, message):
    model = AutoModelForSeq2SeqLM.from_pretrained(ROOT / "fixtures" / "seq2seq" / "bart", requires_grad=False)
    with pytest.raises(InputError, match=message):
        model.generate(np.array(REFERENCE["seq2seq_prompt"], np.int64), max_new_tokens=2, **argument)


@pytest.mark.parametrize("argument, message", [
    ({"bad_words_ids": [11]}, "bad_words_ids must be a list of token-id lists"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be a whole number"),
    ({"forced_bos_token_id": "a"}, "forced_bos_token_id must be token ids"),
    ({"forced_eos_token_id": 10 ** 6}, "outside the vocabulary"),
])
def test_bad_processor_arguments_are_refused_by_name(argument, message):
    model = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "llama", requires_grad=False)
    with pytest.raises(InputError, match=message):
        model.generate(np.array([[5, 17]], np.int64), max_new_tokens=2, **argument)


def test_completions_stop_at_the_generation_configs_end_tokens_too(tmp_path):
    """Llama 3 Instruct lists <|eot_id|> in generation_config.json only: vkformers generate and serve stop there."""
    model = AutoModelForCausalLM.from_pretrained(fixture_copy(tmp_path, "llama", {"eos_token_id": [2, 40]}),
                                                 requires_grad=False)

    class Tokenizer:
        eos_token_id = 7
    assert end_token_ids(model, Tokenizer()) == [2, 7, 40]
    assert end_token_ids(model) == [2, 40]


def test_the_generation_config_is_transformers_object_to_read_and_set(tmp_path):
    """Without generation_config.json it holds the config's generation keys (GenerationConfig.from_model_config);
    its keys read and set as attributes, and what is set there is what generate decodes with."""
    model = AutoModelForSeq2SeqLM.from_pretrained(ROOT / "fixtures" / "seq2seq" / "bart", requires_grad=False)
    (tmp_path / "bare").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "fixtures" / "seq2seq" / "bart" / name, tmp_path / "bare" / name)
    bare = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "bare", requires_grad=False)
    assert bare.generation_config.forced_eos_token_id == 2 and bare.generation_config.decoder_start_token_id == 2
    prompt = np.array(REFERENCE["seq2seq_prompt"], np.int64)
    for target in (model, bare):
        target.generation_config.forced_bos_token_id = 7
        target.generation_config.max_new_tokens = 6
        assert target.generate(prompt).tolist() == next(c["tokens"] for c in REFERENCE["cases"]
                                                        if c["name"] == "bart_forced_bos")


class PairTokenizer:
    """Each token id reads as two letters, so that a stop string may end inside a token (transformers' overhang)."""

    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return "".join(chr(97 + int(t) % 26) + chr(97 + int(t) // 26 % 26) for t in ids)


def test_stop_strings_end_a_row_at_the_token_that_completes_them():
    """A row stops at the token whose text completes a stop string (spanning tokens, or ending inside the token),
    keeps that token and pads after it; the other row goes on; beams and a missing tokenizer are refused."""
    model = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "llama", requires_grad=False)
    ids = np.array(REFERENCE["decoder_prompts"], np.int64)
    mask = np.array(REFERENCE["decoder_mask"], np.int64)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=[])
    text = PairTokenizer.decode(greedy[0, ids.shape[1]:])
    for stop in (text[3:6], text[5:9]):  # the first ends inside a token (odd end), the second spans three tokens
        end = -(-(text.find(stop) + len(stop)) // 2)  # the new token in which its first occurrence ends
        got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=[],
                             stop_strings=[stop, "zzzzzz"], tokenizer=PairTokenizer(), pad_token_id=0)
        width = ids.shape[1] + end
        assert end < 8 and (got[0, width:] == 0).all(), (stop, end, got[0])
        np.testing.assert_array_equal(got[0, :width], greedy[0, :width])
        if stop not in PairTokenizer.decode(greedy[1]):
            np.testing.assert_array_equal(got[1], greedy[1])
    with pytest.raises(InputError, match="needs the tokenizer"):
        model.generate(ids, max_new_tokens=2, stop_strings=["ab"])
    seq2seq = AutoModelForSeq2SeqLM.from_pretrained(ROOT / "fixtures" / "seq2seq" / "bart", requires_grad=False)
    with pytest.raises(InputError, match="stop_strings with beam search"):
        seq2seq.generate(np.array(REFERENCE["seq2seq_prompt"], np.int64), max_new_tokens=2, num_beams=2,
                         stop_strings=["ab"], tokenizer=PairTokenizer())


def test_the_cutoff_warpers_come_from_the_generation_config_too(tmp_path):
    """typical_p, epsilon_cutoff and eta_cutoff set by generation_config.json warp as when the call gives them;
    out-of-range values are refused by name."""
    case = next(c for c in REFERENCE["outputs"] if c["name"] == "sampling_cutoffs")
    cutoffs = {k: case["kwargs"][k] for k in ("typical_p", "epsilon_cutoff", "eta_cutoff")}
    folder = fixture_copy(tmp_path, "llama", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **cutoffs})
    model = AutoModelForCausalLM.from_pretrained(folder, requires_grad=False)
    ids = np.array(REFERENCE["decoder_prompts"], np.int64)
    others = {k: v for k, v in case["kwargs"].items() if k not in cutoffs}
    out = model.generate(ids, attention_mask=np.array(REFERENCE["decoder_mask"], np.int64), seed=0,
                         return_dict_in_generate=True, output_scores=True, **others)
    same_scores(out.scores[0], case["scores"][0])
    for name, value in [("typical_p", 0.0), ("epsilon_cutoff", 1.0), ("eta_cutoff", -0.1)]:
        with pytest.raises(InputError, match=name):
            model.generate(ids, max_new_tokens=1, do_sample=True, **{name: value})


def test_the_callers_processing_is_checked_and_runs_before_the_warpers_when_sampling():
    model = AutoModelForCausalLM.from_pretrained(ROOT / "fixtures" / "llama", requires_grad=False)
    ids = np.array(REFERENCE["decoder_prompts"][1:], np.int64)
    seen = []

    def processor(tokens, scores):  # before top-k, as in transformers: every score reaches it; it bans the likeliest
        seen.append(int(np.isfinite(scores).sum()))
        scores[np.arange(len(scores)), scores.argmax(-1)] = -np.inf
        return scores
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    sampled = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=3, seed=1, logits_processor=[processor])
    assert seen == [model.config.vocab_size] * 6
    assert sampled[0, ids.shape[1]] != greedy[0, ids.shape[1]]  # the likeliest first token is never drawn
    with pytest.raises(InputError, match="prefix_allowed_tokens_fn must be a function"):
        model.generate(ids, max_new_tokens=2, prefix_allowed_tokens_fn=[1, 2])
    with pytest.raises(InputError, match="allowed no token for batch id 0"):
        model.generate(ids, max_new_tokens=2, prefix_allowed_tokens_fn=lambda batch_id, tokens: [])
    with pytest.raises(InputError, match="returned scores of shape"):
        model.generate(ids, max_new_tokens=2, logits_processor=[lambda tokens, scores: scores[:, :4]])
