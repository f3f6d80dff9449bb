"""``vkformers serve``'s Responses API (POST /v1/responses, cli/responses.py) through the ``openai`` client: greedy
output text equal to the chat route's for the same conversation and to ``generate`` on the templated prompt, usage
counted exactly, instructions, a cut output incomplete, the typed stream events in order (deltas making the text,
through ``responses.create(stream=True)`` and the ``responses.stream`` helper), previous_response_id over the
stored responses, structured outputs through ``text.format``, logprobs, errors, and a client leaving mid-stream.

On test_serve's tiny random GGUF llama (byte-level BPE, a chat template); tool calls on test_serve_tools' scripted
replies in Hermes' format (a random model never writes a call), where a function_call and its function_call_output
make a round trip through the chat template.

The engine is not shared across threads: every reference ``generate`` runs while the scheduler is idle.
"""
from __future__ import annotations

import json
from typing import Literal

import pytest
from structured_checks import PERSON, blank_tokens, schema_errors
from test_serve import (API_KEY, SERVED, error_of, leave_mid_stream, openai, reference_tokens, request,  # noqa: F401
                        serving, wait_for, web, write_tiny_model)
from test_serve_tools import CALLING, CITY, TWO_CALLS, served  # noqa: F401  (served, web: fixtures)

from vkformers.cli import responses as cli_responses
from vkformers.cli import serve as cli_serve
from vkformers.cli.api_schema import ApiError
from vkformers.models.batching import BatchScheduler
from vkformers.models.gguf import load_gguf_model
from vkformers.models.loading import AutoModelForCausalLM

ROUTE = "/v1/responses"
BRIEF = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather of a city", "parameters": CITY}]
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, web):  # noqa: F811 (the fixture)
    path, tokenizer, reference = write_tiny_model(tmp_path_factory.mktemp("responses"))
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    scheduler = BatchScheduler(model, tokenizer, max_batch=4, max_model_len=128,
                               eos=cli_serve.eos_ids(model, tokenizer)).start()
    with serving(scheduler, tokenizer) as running:
        # a bias of -100 on whitespace tokens keeps the random model's JSON short (as test_serve_structured's)
        yield {**running, "reference": reference, "eos": cli_serve.eos_ids(reference, tokenizer),
               "compact": {str(t): -100 for t in blank_tokens(tokenizer)}}


def templated(tokenizer, messages):
    return [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          return_tensors="np")["input_ids"][0]]


def greedy(server, messages, count, eos=None):
    """generate's greedy tokens for the templated ``messages`` and their text, as the server gives them."""
    ids = templated(server["tokenizer"], messages)
    tokens = reference_tokens(server["reference"], ids, count, server["eos"] if eos is None else eos).tolist()
    return ids, tokens


def text_of(server, tokens):
    return server["tokenizer"].decode(tokens, skip_special_tokens=True)


def stopping(server, messages, count):
    """(a token that ends the greedy output early, the output's tokens up to it): stop_token_ids gives a reply that
    completes before ``count`` tokens (the random model rarely writes its end token)."""
    ids, tokens = greedy(server, messages, count)
    stop = tokens[min(count // 2, len(tokens) - 1)]
    return ids, stop, tokens[:tokens.index(stop) + 1]


def test_greedy_output_text_equals_the_chat_routes_and_generates(server):
    client = server["client"]
    ids, tokens = greedy(server, BRIEF, 7)
    response = client.responses.create(model=SERVED, instructions="be brief", input="hello", max_output_tokens=7,
                                       temperature=0)
    chat = client.chat.completions.create(model=SERVED, messages=BRIEF, max_tokens=7, temperature=0)
    assert response.output_text == chat.choices[0].message.content == text_of(server, tokens)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == SERVED
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (len(ids), len(tokens),
                                                                             len(ids) + len(tokens))
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.status == ("completed" if tokens[-1] in server["eos"] else "incomplete")
    assert (response.instructions, response.max_output_tokens, response.temperature, response.top_p) == (
        "be brief", 7, 0, 1.0)
    assert response.tools == [] and response.tool_choice == "auto" and response.parallel_tool_calls
    # the same conversation as input items: a developer message (the system prompt), a message of text parts
    items = client.responses.create(model=SERVED, max_output_tokens=7, temperature=0, input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hel"},
                                                        {"type": "input_text", "text": "lo"}]}])
    assert items.output_text == response.output_text and items.usage.input_tokens == len(ids)


def test_a_reply_cut_by_max_output_tokens_is_incomplete_and_a_stopped_one_completed(server):
    client = server["client"]
    messages = [{"role": "user", "content": "once upon a time"}]
    _, tokens = greedy(server, messages, 5, eos=())
    cut = client.responses.create(model=SERVED, input="once upon a time", max_output_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.usage.output_tokens == 5
    assert cut.output_text == text_of(server, tokens)
    _, stop, tokens = stopping(server, messages, 10)
    done = client.responses.create(model=SERVED, input="once upon a time", max_output_tokens=10, temperature=0,
                                   extra_body={"stop_token_ids": [stop]})
    assert done.status == "completed" and done.incomplete_details is None and done.output[0].status == "completed"
    assert done.usage.output_tokens == len(tokens) and done.output_text == text_of(server, tokens[:-1])


def test_streamed_events_come_in_order_and_their_deltas_make_the_text(server):
    client = server["client"]
    _, stop, tokens = stopping(server, [{"role": "user", "content": "the quick brown fox"}], 12)
    options = dict(model=SERVED, input="the quick brown fox", max_output_tokens=12, temperature=0,
                   extra_body={"stop_token_ids": [stop]})
    whole = client.responses.create(**options)
    assert whole.status == "completed" and whole.usage.output_tokens == len(tokens)
    events = list(client.responses.create(stream=True, **options))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                        *["response.output_text.delta"] * len(deltas), *TEXT_END,
                                        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text == events[-4].text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    assert final.status == "completed" and final.output_text == whole.output_text and final.usage == whole.usage
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events) and final.output[0].id == item_id
    with client.responses.stream(**options) as stream:
        pieces = [e.delta for e in stream if e.type == "response.output_text.delta"]
        response = stream.get_final_response()
    assert "".join(pieces) == response.output_text == whole.output_text
    # cut by max_output_tokens: the stream ends with response.incomplete
    events = list(client.responses.create(model=SERVED, input="hi", max_output_tokens=4, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 4


def test_logprobs_come_with_include(server):
    client = server["client"]
    options = dict(model=SERVED, input="gpu", max_output_tokens=5, temperature=0, top_logprobs=2,
                   include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})
    response = client.responses.create(**options)
    entries = response.output[0].content[0].logprobs
    assert len(entries) == 5 and response.top_logprobs == 2
    for entry in entries:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert abs(max(top.logprob for top in entry.top_logprobs) - entry.logprob) < 1e-6
    streamed = list(client.responses.create(stream=True, **options))[-1].response.output[0].content[0].logprobs
    # the same tokens; their log-probabilities within float32 rounding (the forwards' shapes differ run to run)
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in entries]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(streamed, entries))
    plain = client.responses.create(model=SERVED, input="gpu", max_output_tokens=2, temperature=0)
    assert plain.output[0].content[0].logprobs == []


def test_previous_response_id_continues_the_stored_conversation(server):
    client = server["client"]
    first = client.responses.create(model=SERVED, instructions="be brief", input="hello", max_output_tokens=4,
                                    temperature=0)
    second = client.responses.create(model=SERVED, previous_response_id=first.id, input="more", max_output_tokens=4,
                                     temperature=0)
    # the earlier turn, its output, and not its instructions (as OpenAI's)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "more"}]
    chat = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=4, temperature=0)
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens == len(templated(server["tokenizer"], messages))
    # a streamed response is stored too
    streamed = list(client.responses.create(model=SERVED, previous_response_id=second.id, input="again",
                                            max_output_tokens=3, temperature=0, stream=True))[-1].response
    third = client.responses.create(model=SERVED, previous_response_id=streamed.id, input="end", max_output_tokens=3,
                                    temperature=0)
    messages += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "again"},
                 {"role": "assistant", "content": streamed.output_text}, {"role": "user", "content": "end"}]
    assert third.usage.input_tokens == len(templated(server["tokenizer"], messages))
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    status, error = error_of(request(server, "POST", ROUTE, {"model": SERVED, "input": "x",
                                                             "previous_response_id": first.id}))
    assert status == 400 and error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    unstored = client.responses.create(model=SERVED, input="hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=SERVED, input="x", previous_response_id=unstored.id)


def test_the_store_keeps_the_last_responses():
    store = cli_responses.ResponseStore(size=2)
    for ident in ("a", "b"):
        store.keep({"id": ident, "output": [cli_responses.message_item(ident, [], "completed")]},
                   [{"role": "user", "content": f"to {ident}"}])
    assert store.history({"previous_response_id": "a"}) == [{"role": "user", "content": "to a"},
                                                            {"role": "assistant", "content": "a"}]
    store.keep({"id": "c", "output": []}, [])  # "b" goes: "a" was continued since
    assert store.history({}) == [] and store.get("a")["id"] == "a" and store.get("c")["id"] == "c"
    with pytest.raises(ApiError, match="keeps the last 2") as missing:
        store.history({"previous_response_id": "b"})
    assert missing.value.status == 400 and missing.value.code == "previous_response_not_found"


def test_a_function_call_round_trip_through_the_chat_template(served):  # noqa: F811 (the fixture)
    scheduler, tokenizer, client = served
    scheduler.reply = CALLING
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS)
    message, call = first.output
    assert message.type == "message" and first.output_text == "Let me check." and first.status == "completed"
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert tokenizer.decode(scheduler.prompts[-1]) == ("<|system|>tools: get_weather<|end|><|user|>Weather in "
                                                       "Paris?<|end|><|assistant|>")
    scheduler.reply = "It is sunny."
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    earlier = [item.model_dump(exclude_none=True) for item in first.output]  # as a client sends its output back
    again = client.responses.create(model="tiny", tools=TOOLS,
                                    input=[{"role": "user", "content": "Weather in Paris?"}, *earlier, result])
    assert again.output_text == "It is sunny." and [item.type for item in again.output] == ["message"]
    rendered = tokenizer.decode(scheduler.prompts[-1])
    assert rendered.endswith('<|assistant|>Let me check.call get_weather {"city": "Paris"}<|end|><|tool|>sunny'
                             '<|end|><|assistant|>')
    # the same through previous_response_id: the stored conversation, then the call's output alone
    client.responses.create(model="tiny", previous_response_id=first.id, input=[result], tools=TOOLS)
    assert tokenizer.decode(scheduler.prompts[-1]) == rendered


def call_events(events) -> list[list]:
    """A stream's events of each function call item: added, its argument deltas, done (checked in that shape,
    each naming its item), in the order the items came."""
    items, open_ = [], None
    for event in events:
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            open_ = [event]
            items.append(open_)
        elif open_ is not None and event.type.startswith("response.function_call_arguments."):
            assert event.item_id == open_[0].item.id and event.output_index == open_[0].output_index
            open_.append(event)
        elif open_ is not None and event.type == "response.output_item.done":
            assert event.item.id == open_[0].item.id and event.output_index == open_[0].output_index
            open_.append(event)
            open_ = None
        else:
            assert open_ is None, f"{event.type} while a call item is open"
    for added, *deltas, done, closed in items:
        assert added.item.arguments == "" and added.item.status == "in_progress"
        assert [e.type for e in deltas] == ["response.function_call_arguments.delta"] * len(deltas)
        assert done.type == "response.function_call_arguments.done" and closed.item.status == "completed"
        assert "".join(e.delta for e in deltas) == done.arguments == closed.item.arguments
        assert (closed.item.call_id, closed.item.name) == (added.item.call_id, added.item.name) == (
            added.item.call_id, done.name)
    return items


def test_streamed_calls_come_as_function_call_items_and_no_tag_leaks(served):  # noqa: F811 (the fixture)
    """As OpenAI streams a function call: its item added (name and call id, no arguments), its arguments in
    deltas as they come, their done event, the item done; the client's accumulation the non-streamed output."""
    scheduler, _, client = served
    scheduler.reply = CALLING
    whole = client.responses.create(model="tiny", input="Weather?", tools=TOOLS)
    events = list(client.responses.create(model="tiny", input="Weather?", tools=TOOLS, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    (call,) = call_events(events)
    assert [e.type for e in events] == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                        *["response.output_text.delta"] * len(deltas), *TEXT_END,
                                        *[e.type for e in call], "response.completed"]
    assert "".join(deltas).strip() == "Let me check." and "<tool" not in "".join(deltas)
    assert len(call) > 4 and call[0].output_index == 1  # the arguments in more than one delta
    done = call[-1].item
    assert (done.name, done.arguments) == (whole.output[1].name, whole.output[1].arguments)
    assert done.call_id.startswith("call_") and done.id.startswith("fc_") and events[-1].response.output[1] == done
    scheduler.reply = "\n " + TWO_CALLS  # blank text before the calls: no message item, as a whole response
    whole = client.responses.create(model="tiny", input="Weather?", tools=TOOLS)
    with client.responses.stream(model="tiny", input="Weather?", tools=TOOLS) as stream:
        events = list(stream)
        response = stream.get_final_response()
    calls = call_events(events)
    assert [e.type for e in events] == ["response.created", "response.in_progress",
                                        *[e.type for c in calls for e in c], "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [c[0].output_index for c in calls] == [0, 1] and all(len(c) > 4 for c in calls)
    assert [(item.type, item.name, item.arguments, item.status) for item in response.output] == [
        (item.type, item.name, item.arguments, item.status) for item in whole.output]
    assert [json.loads(item.arguments) for item in response.output] == [{"city": "Paris"}, {"city": "Rome"}]
    assert response.output_text == "" and len({item.call_id for item in response.output}) == 2
    scheduler.reply = TWO_CALLS
    one = client.responses.create(model="tiny", input="Weather?", tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(item.arguments) for item in one.output] == [{"city": "Paris"}]
    assert one.parallel_tool_calls is False
    with client.responses.stream(model="tiny", input="Weather?", tools=TOOLS, parallel_tool_calls=False) as stream:
        assert [item.arguments for item in stream.get_final_response().output] == [one.output[0].arguments]
    scheduler.reply, scheduler.finish = TWO_CALLS[:-18], "length"  # cut in the second call: the text after the first
    try:
        events = list(client.responses.create(model="tiny", input="Weather?", tools=TOOLS, stream=True))
    finally:
        scheduler.finish = "stop"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [c[-1].item.arguments for c in call_events(events)] == ['{"city": "Paris"}', '{"city": "R']
    final = events[-1].response
    assert final.status == "incomplete" and [item.type for item in final.output] == ["function_call"] * 2 + ["message"]
    assert final.output_text == TWO_CALLS[TWO_CALLS.index("</tool_call>"):-18]


def test_a_forced_tool_choice_gives_function_call_items(served):  # noqa: F811 (the fixture)
    """tool_choice "required" or a named function ({"type": "function", "name": ...}, Responses' flat shape): the
    output constrained to calls (as on the chat route) comes back as function_call items."""
    scheduler, _, client = served
    scheduler.reply = '{"city": "Paris"}'
    named = client.responses.create(model="tiny", input="hi", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Paris"}
    assert named.status == "completed" and scheduler.params[-1].grammar is not None
    with client.responses.stream(model="tiny", input="hi", tools=TOOLS,  # streamed: its arguments as they come
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        (streamed,) = call_events(list(stream))
        final = stream.get_final_response()
    assert len(streamed) > 4 and [(c.name, c.arguments) for c in final.output] == [(call.name, call.arguments)]
    scheduler.reply = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    required = client.responses.create(model="tiny", input="hi", tools=TOOLS, tool_choice="required")
    assert [(c.type, json.loads(c.arguments)) for c in required.output] == [("function_call", {"city": "Rome"})]
    with client.responses.stream(model="tiny", input="hi", tools=TOOLS, tool_choice="required") as stream:
        (streamed,) = call_events(list(stream))
        final = stream.get_final_response()
    assert len(streamed) > 4 and [(c.type, c.name, c.arguments) for c in final.output] == [
        (c.type, c.name, c.arguments) for c in required.output]


def test_tools_and_tool_choices_the_server_cannot_honour_are_refused(served):  # noqa: F811 (the fixture)
    _, _, client = served
    with pytest.raises(openai.BadRequestError, match="not among 'tools'") as refused:
        client.responses.create(model="tiny", input="hi", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_time"})
    assert refused.value.body["param"] == "tool_choice"
    for tool in ({"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}):
        with pytest.raises(openai.BadRequestError, match=repr(tool["type"])) as refused:
            client.responses.create(model="tiny", input="hi", tools=[*TOOLS, tool])
        assert refused.value.body["param"] == "tools"


def test_json_schema_text_format_gives_json_matching_the_schema(server):
    client = server["client"]
    form = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    options = dict(model=SERVED, input="json", temperature=0, text={"format": form},
                   extra_body={"logit_bias": server["compact"]})
    response = client.responses.create(**options)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    assert schema_errors(json.loads(response.output_text), PERSON) == []
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "json"}],
                                          temperature=0, logit_bias=server["compact"], response_format={
                                              "type": "json_schema", "json_schema": {"name": "person",
                                                                                     "schema": PERSON, "strict": True}})
    assert response.output_text == chat.choices[0].message.content
    events = list(client.responses.create(stream=True, **options))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    closing = server["tokenizer"].convert_tokens_to_ids("}")
    json_object = client.responses.create(model=SERVED, input="json", max_output_tokens=10, temperature=0,
                                          text={"format": {"type": "json_object"}},
                                          extra_body={"logit_bias": {str(closing): 100}})
    assert json_object.output_text == "{}" and json_object.status == "completed"


def test_a_pydantic_model_through_the_parse_helper(server):
    pydantic = pytest.importorskip("pydantic")  # (the openai client depends on it)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(pattern=r"^[a-z]{1,6}$")
        pet: Literal["cat", "dog"]
        age: int = pydantic.Field(ge=0, le=99)

    response = server["client"].responses.parse(model=SERVED, input="json", temperature=0, text_format=Person,
                                                extra_body={"logit_bias": server["compact"]})
    assert isinstance(response.output_parsed, Person)
    assert Person.model_validate_json(response.output_text) == response.output_parsed


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    status, error = error_of(request(server, "POST", ROUTE, raw="{not json"))
    assert status == 400 and error["type"] == "invalid_request_error" and "JSON" in error["message"]
    status, error = error_of(request(server, "POST", ROUTE, {"model": "gpt-4", "input": "hi"}))
    assert status == 404 and error["code"] == "model_not_found"
    status, error = error_of(request(server, "POST", ROUTE, {"model": SERVED, "input": "hi " * 200}))
    assert status == 400 and "maximum context length of 128" in error["message"]
    for key in ("wrong", None):
        status, error = error_of(request(server, "POST", ROUTE, {"model": SERVED, "input": "hi"}, key=key))
        assert status == 401 and error["code"] == "invalid_api_key"
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    refused = [({"background": True}, "background", "background"),
               ({"input": [{"role": "user", "content": [image]}]}, "input", "input_image"),
               ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
               ({"input": []}, "input", "non-empty"), ({"input": None}, "input", "non-empty"),
               ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
               ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input",
                "not JSON"),
               ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
               ({"temperature": 3}, "temperature", "[0, 2]"),
               ({"text": {"format": {"type": "regex"}}}, "text.format", "'regex'"),
               ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
               ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nothing"}}}},
                "text.format", "Invalid type"),
               ({"tools": TOOLS}, "tools", "--enable-auto-tool-choice"),
               ({"include": "message.output_text.logprobs"}, "include", "list"),
               ({"top_logprobs": 30}, "top_logprobs", "[0, 20]"),
               ({"metadata": {"a": 1}}, "metadata", "string values"),
               ({"store": "yes"}, "store", "true or false"),
               ({"previous_response_id": "resp_missing"}, "previous_response_id", "not found")]
    for fields, param, words in refused:
        status, error = error_of(request(server, "POST", ROUTE, {"model": SERVED, "input": "hi", **fields}))
        assert status == 400 and error["param"] == param and words in error["message"], (fields, error)
        assert "\n" not in error["message"]
    status, error = error_of(request(server, "GET", f"{ROUTE}/resp_missing"))
    assert status == 404 and error["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError):
        server["client"].responses.create(model=SERVED, input="hi", background=True)
    after = server["client"].responses.create(model=SERVED, input="hi", max_output_tokens=2)
    assert after.usage.output_tokens >= 1 and server["scheduler"].error is None


def test_a_failed_batch_answers_500_or_a_failed_response_and_the_server_goes_on(server, monkeypatch):
    scheduler = server["scheduler"]
    prefill = scheduler.model.prefill

    def broken(*args):
        raise RuntimeError("device lost")
    monkeypatch.setattr(scheduler.model, "prefill", broken)
    status, error = error_of(request(server, "POST", ROUTE, {"model": SERVED, "input": "hi", "max_output_tokens": 3}))
    assert status == 500 and error["type"] == "server_error" and "device lost" in error["message"]
    events = list(server["client"].responses.create(model=SERVED, input="hi", max_output_tokens=3, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failure = events[-1].response
    assert failure.status == "failed" and failure.error.code == "server_error"
    assert "device lost" in failure.error.message
    monkeypatch.setattr(scheduler.model, "prefill", prefill)
    assert server["client"].responses.create(model=SERVED, input="hi", max_output_tokens=2).usage.output_tokens >= 1


def test_a_client_leaving_mid_stream_frees_its_row(server, monkeypatch):
    first = leave_mid_stream(server, monkeypatch, ROUTE, {"model": SERVED, "input": "a", "max_output_tokens": 95,
                                                          "temperature": 0.5, "seed": 1, "ignore_eos": True})
    assert first == b"event: response.created\n"
    assert server["client"].responses.create(model=SERVED, input="hi", max_output_tokens=2).output_text is not None
