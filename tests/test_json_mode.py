"""JSON mode (models/json_mode.py; OpenAI's response_format json_object in `vkformers serve`): the prefix reader
accepts exactly the texts that begin (or are) one JSON object, and a served request in JSON mode, greedy or sampled,
on the tiny random Llama of tests/data/pipeline, writes a valid beginning of one, a whole one when it stops, and
the object that scores best among the valid tokens (biased towards closing it: "{}")."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_serve import wait_for

from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.json_mode import JsonPrefix
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer

MODEL = Path(__file__).parent / "data" / "pipeline"
VALID = ['{}', '{"a": 1}', '{"a": [1, -2.5e+3, 0.25, true, false, null, "x"], "b": {"c": {}}}',
         '{"s": "quote \\" slash \\\\ \\u00e9 \\n tab"}', '{ "k" : [ ] , "m" : [ [ ] ] }\n ', '{"n": 0}',
         '{"n": -0.0E-1}']
INVALID = ['[]', '"x"', '1', '{"a" 1}', '{"a": 1,}', '{"a": 01}', '{"a": 1.}', '{"a": tru}', '{a: 1}', '{"a": "\\x"}',
           '{"a": "\\u12G4"}', '{"a": [1 2]}', '{} {}', '{"a": "line\nbreak"}', '{"a": -}']


def complete(text):
    state = JsonPrefix().feed(text)
    return state is not None and state.complete


@pytest.mark.parametrize("text", VALID)
def test_json_objects_and_every_beginning_of_them_are_accepted(text):
    assert complete(text) and json.loads(text) is not None
    for end in range(len(text)):
        assert JsonPrefix().feed(text[:end]) is not None, text[:end]


# JSON that JSON mode refuses all the same: blanks before the object, or more in a row than MAX_BLANK_RUN
REFUSED = [' {}', '{' + ' ' * 65 + '}']


@pytest.mark.parametrize("text", REFUSED)
def test_blanks_first_or_past_the_run_limit_are_refused(text):
    assert isinstance(json.loads(text), dict) and not complete(text)


@pytest.mark.parametrize("text", INVALID)
def test_texts_that_no_json_object_begins_with_are_refused(text):
    assert not complete(text)
    with pytest.raises(json.JSONDecodeError):
        if not isinstance(json.loads(text), dict):
            raise json.JSONDecodeError("not an object", text, 0)


@pytest.fixture(scope="module")
def tiny():
    return (AutoModelForCausalLM.from_pretrained(MODEL, dtype="float32", requires_grad=False),
            AutoTokenizer.from_pretrained(MODEL))


def served(tiny, params_list):
    model, tokenizer = tiny
    scheduler = BatchScheduler(model, tokenizer, max_batch=4).start()
    try:
        prompt = [int(t) for t in tokenizer("Answer in JSON: the capital of France")["input_ids"]]
        requests = [scheduler.submit(Request(prompt, params, lambda update: None, [tokenizer.eos_token_id]))
                    for params in params_list]
        wait_for(lambda: all(r.finished for r in requests))
    finally:
        scheduler.close()
    return [(tokenizer.decode(r.generated, skip_special_tokens=True), r.finish_reason, r) for r in requests]


def test_served_json_mode_writes_a_json_object(tiny):
    model, tokenizer = tiny
    closing = tokenizer.convert_tokens_to_ids("}")
    params = [SamplingParams(max_tokens=24, temperature=0, json_mode=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, json_mode=True),
              SamplingParams(max_tokens=24, temperature=0, json_mode=True, logit_bias=((closing, 100.0),)),
              SamplingParams(max_tokens=24, temperature=0)]  # beside them, a row of plain text
    out = served(tiny, params)
    for text, reason, _ in out[:3]:
        assert JsonPrefix().feed(text) is not None, text
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
    assert out[2][0] == "{}" and out[2][1] == "stop"
    assert JsonPrefix().feed(out[3][0]) is None  # the random model's own text is no JSON
