"""``vkformers serve``'s structured outputs through the ``openai`` client: ``response_format`` json_schema on
/v1/chat/completions and /v1/completions, streamed and not, greedy and seeded, strict or not, a pydantic model
through ``client.beta.chat.completions.parse``; a schema the engine cannot compile is a 400 and the server goes on;
a schema request and a plain one in one running batch each come out right; a forced tool call keeps to its tool's
schema. On the tiny random GGUF llama of
test_serve (byte-level BPE, a chat template); a bias of -100 on whitespace tokens keeps its JSON short."""
from __future__ import annotations

import contextlib
import json
import sys
import threading
from typing import Literal

import pytest
from structured_checks import PERSON, blank_tokens, schema_errors
from test_serve import SERVED, error_of, request, serving, write_tiny_model

from vkformers.cli import serve as cli_serve
from vkformers.models.batching import BatchScheduler

try:  # the [serve] extra and the openai client of the [test] extra (CI installs both)
    import openai
    import uvicorn
except ImportError:
    openai = uvicorn = None

MESSAGES = [{"role": "user", "content": "json"}]  # (max_tokens left out: what the context leaves)


@contextlib.contextmanager
def grammar_server(folder):
    """test_serve's tiny GGUF llama written into ``folder``, served (serving()); "compact": a logit_bias of -100 on
    its whitespace tokens, which keeps the random model's JSON short."""
    if uvicorn is None or openai is None:
        pytest.fail("the serve tests need pip install 'vkformers[serve,test]' (Starlette, uvicorn, openai)",
                    pytrace=False)
    _, tokenizer, model = write_tiny_model(folder)
    scheduler = BatchScheduler(model, tokenizer, max_batch=4, max_model_len=128,
                               eos=cli_serve.eos_ids(model, tokenizer)).start()
    with serving(scheduler, tokenizer) as served:
        yield {**served, "compact": {str(t): -100 for t in blank_tokens(tokenizer)}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with grammar_server(tmp_path_factory.mktemp("structured")) as served:
        yield served


def schema_format(schema, strict=True, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def valid(text, schema=PERSON):
    value = json.loads(text)
    assert schema_errors(value, schema) == [], text
    return value


@pytest.mark.parametrize("strict", [True, False])
def test_chat_outputs_follow_the_schema_greedy_and_seeded_streamed_or_not(server, strict):
    client = server["client"]
    options = dict(model=SERVED, messages=MESSAGES, response_format=schema_format(PERSON, strict),
                   logit_bias=server["compact"])
    greedy = client.chat.completions.create(temperature=0, **options)
    assert greedy.choices[0].finish_reason == "stop"
    valid(greedy.choices[0].message.content)
    chunks = list(client.chat.completions.create(temperature=0, stream=True, **options))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy.choices[0].message.content
    seeded = client.chat.completions.create(temperature=1.0, seed=7, n=2, **options)
    again = client.chat.completions.create(temperature=1.0, seed=7, n=2, **options)
    texts = [c.message.content for c in seeded.choices]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]
    for choice in seeded.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content)


def test_completions_take_a_schema_too_streamed_or_not(server):
    client = server["client"]
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "number",
                                                                                          "minimum": 0, "maximum": 1},
                                                "reasons": {"type": "array", "minItems": 1, "maxItems": 2,
                                                            "items": {"enum": ["a", "b"]}}},
              "required": ["answer", "score", "reasons"], "additionalProperties": False}
    options = dict(model=SERVED, prompt="the capital of france is", max_tokens=90, temperature=0,
                   logit_bias=server["compact"], extra_body={"response_format": schema_format(schema)})
    whole = client.completions.create(**options)
    assert whole.choices[0].finish_reason == "stop"
    valid(whole.choices[0].text, schema)
    chunks = list(client.completions.create(stream=True, **options))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_a_pydantic_model_through_the_parse_helper(server):
    pydantic = pytest.importorskip("pydantic")  # (the openai client depends on it)

    class Home(pydantic.BaseModel):
        city: str = pydantic.Field(pattern=r"^[a-z]{1,5}$")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(pattern=r"^[a-z]{1,6}$")
        pet: Literal["cat", "dog"]
        age: int = pydantic.Field(ge=0, le=99)
        home: Home
        likes: list[bool] = pydantic.Field(max_length=2)

    completion = server["client"].beta.chat.completions.parse(model=SERVED, messages=MESSAGES,
                                                              temperature=0, response_format=Person,
                                                              logit_bias=server["compact"])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person) and isinstance(parsed.home, Home) and parsed.pet in ("cat", "dog")
    assert Person.model_validate_json(completion.choices[0].message.content) == parsed


def test_json_object_mode_through_the_client(server):
    closing = server["tokenizer"].convert_tokens_to_ids("}")
    response = server["client"].chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10,
                                                        temperature=0, response_format={"type": "json_object"},
                                                        logit_bias={str(closing): 100})
    assert response.choices[0].message.content == "{}" and response.choices[0].finish_reason == "stop"


BAD_SCHEMAS = [({"type": "string", "pattern": "(("}, "regex parse error"), ({"type": "nothing"}, "Invalid type"),
               ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not exist")]


def test_a_schema_that_cannot_compile_is_a_400_and_the_server_goes_on(server):
    route, chat = "/v1/chat/completions", {"model": SERVED, "messages": MESSAGES, "max_tokens": 4}
    for schema, words in BAD_SCHEMAS:
        status, error = error_of(request(server, "POST", route, {**chat, "response_format": schema_format(schema)}))
        assert status == 400 and error["param"] == "response_format" and error["type"] == "invalid_request_error"
        assert words in error["message"] and "\n" not in error["message"], error
    for malformed in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                      {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, {"type": "yaml"}):
        status, error = error_of(request(server, "POST", route, {**chat, "response_format": malformed}))
        assert status == 400 and error["param"] == "response_format", (malformed, error)
    with pytest.raises(openai.BadRequestError):
        server["client"].completions.create(model=SERVED, prompt="hi", max_tokens=4,
                                            extra_body={"response_format": schema_format({"type": "nothing"})})
    after = server["client"].chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3)
    assert after.usage.completion_tokens >= 1 and server["scheduler"].error is None


def test_a_schema_request_and_a_plain_one_share_a_running_batch(server):
    """The plain request streams; the schema request joins its batch after its first token: the schema output is
    valid, and the plain one equals what it gives alone."""
    client = server["client"]
    plain = dict(model=SERVED, prompt="once upon a time there was a", max_tokens=80, temperature=0,
                 extra_body={"ignore_eos": True})
    alone = client.completions.create(**plain).choices[0].text
    server["scheduler"].metrics.peak_live_rows = 0
    done = {}

    def constrained():
        done["response"] = client.chat.completions.create(
            model=SERVED, messages=MESSAGES, temperature=0, response_format=schema_format(PERSON),
            logit_bias=server["compact"])
    pieces, worker = [], threading.Thread(target=constrained)
    for chunk in client.completions.create(stream=True, **plain):
        if chunk.choices and worker.ident is None:  # (once, at the first token)
            worker.start()
        pieces.extend(c.text for c in chunk.choices)
    worker.join(120)
    assert "".join(pieces) == alone
    valid(done["response"].choices[0].message.content)
    assert server["scheduler"].metrics.peak_live_rows >= 2


def test_without_llguidance_a_schema_request_is_a_400_naming_the_extra(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # (an import of it raises ImportError)
    status, error = error_of(request(server, "POST", "/v1/chat/completions",
                                     {"model": SERVED, "messages": MESSAGES, "response_format": schema_format(PERSON)}))
    assert status == 400 and "pip install 'vkformers[serve]'" in error["message"]
    assert server["client"].chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=2).choices


def test_a_forced_tool_call_keeps_to_the_tools_schemas_without_a_parser(server):
    """tool_choice "required" or a named function on a server without a tool-call parser (vLLM answers both so):
    the random model's output is constrained to the call, so its arguments are valid against the tool's schema."""
    place = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
             "additionalProperties": False}
    pet = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 20}},
           "required": ["pet", "age"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "register", "parameters": pet}},
             {"type": "function", "function": {"name": "visit", "parameters": {
                 "$defs": {"Place": place}, "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}},
                 "required": ["at"], "additionalProperties": False}}}]
    options = dict(model=SERVED, messages=MESSAGES, tools=tools, temperature=0, logit_bias=server["compact"])
    named = server["client"].chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "register"}}, **options)
    (call,) = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "stop" and call.function.name == "register"
    valid(call.function.arguments, pet)
    names = set()
    for seed in range(4):  # (one call each: a random model's list of calls may run past max_model_len)
        required = server["client"].chat.completions.create(tool_choice="required", parallel_tool_calls=False,
                                                            seed=seed, **{**options, "temperature": 1.0})
        (call,) = required.choices[0].message.tool_calls
        assert required.choices[0].finish_reason == "tool_calls" and call.function.name in ("register", "visit")
        valid(call.function.arguments, tools[call.function.name == "visit"]["function"]["parameters"])
        names.add(call.function.name)
    assert names == {"register", "visit"}, names
