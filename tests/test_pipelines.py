"""``pipeline`` (models/pipelines.py) against transformers' pipelines. text-generation on the same tiny random Llama
and tokenizer (tests/data/pipeline, tools/make_pipeline_reference.py): strings, a padded batch, chats (a new
assistant turn and a continued one), new text only, token ids, beams, a stop sequence and a prefix, all greedy; then
the pipeline's own generation defaults and its refusals, on vkformers' terms. text-classification, fill-mask,
feature-extraction, token-classification and zero-shot-classification on tiny random BERTs with a WordPiece tokenizer
(tests/data/pipeline_encoder, tools/make_encoder_pipeline_reference.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import vkformers as vkf
from vkformers.errors import InputError
from vkformers.models.pipelines import TextGenerationPipeline

DATA = Path(__file__).parent / "data" / "pipeline"
REFERENCE = json.loads((DATA / "outputs.json").read_text())


@pytest.fixture(scope="module")
def pipe():
    return vkf.pipeline("text-generation", model=str(DATA), dtype="float32")


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=[c["name"] for c in REFERENCE["cases"]])
def test_the_outputs_are_transformers(pipe, case):
    assert pipe(case["inputs"], do_sample=False, **case["kwargs"]) == case["output"]


def test_the_pipelines_defaults_fill_what_the_call_and_the_model_leave_out(pipe, monkeypatch):
    """256 new tokens, sampling at temperature 0.7 and the tokenizer's pad token, as transformers' pipeline adds
    them; a greedy call gets no temperature; the call's own settings win."""
    seen = []

    def generate(ids, **kwargs):
        seen.append(kwargs)
        return np.concatenate([ids, np.zeros((ids.shape[0], 1), np.int64)], axis=1)
    monkeypatch.setattr(pipe.model, "generate", generate)
    pipe("Hello")
    pipe("Hello", do_sample=False)
    pipe("Hello", max_new_tokens=3, temperature=0.2)
    pipe("Hello", max_length=9)
    pad = pipe.tokenizer.pad_token_id
    drop = {"attention_mask"}
    assert [{k: v for k, v in s.items() if k not in drop} for s in seen] == [
        {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7},
        {"do_sample": False, "max_new_tokens": 256},
        {"max_new_tokens": 3, "temperature": 0.2, "do_sample": True},
        {"max_length": 9, "do_sample": True, "temperature": 0.7}]
    assert pipe.model.config.pad_token_id == pad  # set by the model's config: not added again


def test_a_loaded_model_and_bad_requests(pipe):
    loaded = TextGenerationPipeline(pipe.model, pipe.tokenizer)
    assert loaded("Paris is the", do_sample=False, max_new_tokens=3) == \
        pipe("Paris is the", do_sample=False, max_new_tokens=3)
    with pytest.raises(InputError, match="the task 'summarization' is not offered"):
        vkf.pipeline("summarization", model=str(DATA))
    with pytest.raises(InputError, match="return_full_text excludes return_tensors"):
        pipe("Hello", return_full_text=False, return_tensors=True)
    with pytest.raises(InputError, match="give a string, a chat"):
        pipe([1, 2, 3])
    with pytest.raises(InputError, match="handle_long_generation='cut'"):
        pipe("Hello", handle_long_generation="cut", max_new_tokens=2)
    long = " ".join(["Paris is the capital of France."] * 20)  # past the tokenizer's model_max_length, 128
    out = pipe(long, do_sample=False, max_new_tokens=8, handle_long_generation="hole", return_tensors=True)
    ids = pipe.tokenizer(long)["input_ids"]
    assert out[0]["generated_token_ids"][:120] == ids[-120:] and len(out[0]["generated_token_ids"]) == 128


ENCODER = Path(__file__).parent / "data" / "pipeline_encoder"
ENCODER_REFERENCE = json.loads((ENCODER / "outputs.json").read_text())
# float32 scores and hidden states of the tiny BERTs against transformers' on the CPU
ENCODER_TOLERANCE = 1e-5


def close(ours, theirs, path="output"):
    """Equal structure and strings, numbers within ENCODER_TOLERANCE."""
    if isinstance(theirs, float):
        assert isinstance(ours, float) and abs(ours - theirs) <= ENCODER_TOLERANCE, (path, ours, theirs)
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), (path, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            close(a, b, f"{path}[{i}]")
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), (path, ours, theirs)
        for key in theirs:
            close(ours[key], theirs[key], f"{path}.{key}")
    else:
        assert ours == theirs, (path, ours, theirs)


@pytest.fixture(scope="module")
def encoder_pipes():
    return {(task, folder): vkf.pipeline(task, model=str(ENCODER / folder), dtype="float32")
            for task, folder in {(c["task"], c["folder"]) for c in ENCODER_REFERENCE["cases"]}}


@pytest.mark.parametrize("case", ENCODER_REFERENCE["cases"],
                         ids=[f"{c['task']}-{i}" for i, c in enumerate(ENCODER_REFERENCE["cases"])])
def test_the_encoder_tasks_give_transformers_outputs(encoder_pipes, case):
    """text-classification (one text, a list, every label, top 2, a pair, sigmoid, a padded batch), fill-mask (one
    mask, two, a list, targets), feature-extraction and token-classification (per token, every label kept, each
    aggregation strategy over words split into subwords) and zero-shot-classification (labels against one another,
    multi_label, a template), as transformers' pipelines return them."""
    out = encoder_pipes[case["task"], case["folder"]](case["inputs"], **case["kwargs"])
    close(out, case["output"])


def test_the_encoder_tasks_pad_a_batch_on_the_right_whatever_the_tokenizers_side():
    """A batch's inputs give what each gives alone (scores and hidden states within 1e-5) where the tokenizer pads on
    the left, as a decoder's embedding tokenizer does: the encoder tasks pad on the right, where the outputs they
    read of each row (mask positions, the first token's state, the tokens' states before the padding) stay put."""
    texts = {"fill-mask": ["the [MASK] sat on the mat today", "a [MASK]"],
             "feature-extraction": ["the cat sat on the mat today", "a dog"],
             "text-classification": ["the cat sat on the mat today", "a dog"]}
    for task, folder in (("fill-mask", "masked"), ("feature-extraction", "base"),
                         ("text-classification", "classifier")):
        pipe = vkf.pipeline(task, model=str(ENCODER / folder), dtype="float32")
        alone = [pipe(text) for text in texts[task]]
        pipe.tokenizer.padding_side = "left"
        batch = pipe(texts[task], batch_size=2)
        for ours, theirs in zip(batch, alone):
            if task == "feature-extraction":
                assert np.shape(ours) == np.shape(theirs)
                np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
            else:
                theirs = theirs[0] if task == "text-classification" else theirs
                ours, theirs = (ours, theirs) if isinstance(ours, list) else ([ours], [theirs])
                assert [r.get("token", r.get("label")) for r in ours] == \
                    [r.get("token", r.get("label")) for r in theirs]
                np.testing.assert_allclose([r["score"] for r in ours], [r["score"] for r in theirs], atol=1e-5)
        assert pipe.tokenizer.padding_side == "left"  # the caller's tokenizer as it was


def test_the_encoder_tasks_refuse_what_they_cannot_do(encoder_pipes):
    fill = encoder_pipes["fill-mask", "masked"]
    with pytest.raises(InputError, match=r"no mask token \(\[MASK\]\)"):
        fill("paris is the capital of france")
    with pytest.raises(InputError, match="function_to_apply='tanh'"):
        encoder_pipes["text-classification", "classifier"]("a text", function_to_apply="tanh")
    with pytest.raises(InputError, match="text-classification takes texts"):
        encoder_pipes["text-classification", "classifier"]([["a", "b"]])
