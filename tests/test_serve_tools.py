"""Tool calls in `vkformers serve` (models/tool_calls.py, --enable-auto-tool-choice --tool-call-parser hermes): the
request's tools and earlier calls reach the chat template; a reply holding calls in Hermes' format comes back as
OpenAI's tool_calls through the real openai client, whole and streamed (no tag text leaking into the content);
replies without calls, or whose calls do not parse, stay text; a forced tool choice ("required", a named function)
reads the constrained output back as calls; tool choices the server cannot honour are 400s.

The replies are scripted (a scheduler that answers each request with a fixed text in pieces): what is tested is
the parsing and the wire format, which a random model would never exercise."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from test_serve import free_port, openai, uvicorn, wait_for, web  # noqa: F401  (web: a fixture)

from vkformers.cli import serve as cli_serve
from vkformers.cli.api_schema import ApiError
from vkformers.cli.completion_request import refuse_unsupported
from vkformers.models.batching import Update
from vkformers.models.loading import AutoTokenizer
from vkformers.models.tool_calls import (HermesToolCalls, Llama3JsonToolCalls, MistralToolCalls, NamedToolCall,
                                         RequiredToolCalls, ToolCall, ToolCallStream, forced_call_schema)
from vkformers.models.tool_calls import FirstCallOnly

TEMPLATE = ("{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|end|>"
            "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% for c in m.get('tool_calls', []) %}call {{ c['function']['name'] }} {{ c['function']['arguments'] "
            "| tojson }}{% endfor %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city",
                                           "parameters": CITY}}]
CALLING = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


def test_the_hermes_parser_and_the_stream_holder():
    parser = HermesToolCalls()
    assert parser.parse(CALLING) == ("Let me check.", [ToolCall("get_weather", {"city": "Paris"})])
    assert parser.parse(TWO_CALLS)[1] == [ToolCall("get_weather", {"city": "Paris"}),
                                          ToolCall("get_weather", {"city": "Rome"})]
    assert parser.parse("no call here") == ("no call here", [])
    assert parser.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert parser.parse('<tool_call>{"name": "f", "arguments": {}}')[1] == [ToolCall("f", {})]  # cut at the end
    stream = ToolCallStream(parser)
    pieces = ["Let me ", "check.\n<to", "ol_call>\n{\"name\": ", "\"get_weather\", \"arguments\": {\"city\": ",
              "\"Paris\"}}\n</tool_call>"]
    sent = "".join(stream.feed(p)[0] for p in pieces)
    assert sent == "Let me check.\n"
    assert stream.finish() == ("", [ToolCall("get_weather", {"city": "Paris"})], True)
    plain = ToolCallStream(parser)
    assert plain.feed("a <b")[0] + plain.feed("> c <")[0] == "a <b> c " and plain.finish() == ("<", [], False)


def test_the_llama3_json_and_mistral_parsers():
    llama = Llama3JsonToolCalls()
    weather = ToolCall("get_weather", {"city": "Paris"})
    assert llama.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}') == (None, [weather])
    assert llama.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                       '{"name": "get_weather", "parameters": {"city": "Rome"}}')[1] == [
        weather, ToolCall("get_weather", {"city": "Rome"})]
    assert llama.parse("It is sunny.") == ("It is sunny.", [])
    assert llama.parse('{"not": "a call"}') == ('{"not": "a call"}', [])
    stream = ToolCallStream(llama)
    assert stream.feed(" <|py")[0] + stream.feed('thon_tag|>{"name": "get_weather", ')[0] == ""
    assert stream.feed('"parameters": {"city": "Paris"}}')[0] == "" and stream.finish() == ("", [weather], True)
    prose = ToolCallStream(llama)
    assert prose.feed("It is")[0] + prose.feed(" {sunny}")[0] == "It is {sunny}" and prose.finish() == ("", [], False)
    mistral = MistralToolCalls()
    assert mistral.parse('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]') == (
        "Sure.", [weather])
    assert mistral.parse("[TOOL_CALLS] [broken") == ("[TOOL_CALLS] [broken", [])
    stream = ToolCallStream(mistral)
    assert stream.feed("Sure. [TOOL")[0] + stream.feed('_CALLS] [{"name": "get_weather", "arguments": {}}]')[0] == \
        "Sure. "
    assert stream.finish() == ("", [ToolCall("get_weather", {})], True)


def streamed(parser, reply: str, size: int) -> tuple[str, list[list[dict]], bool]:
    """``reply`` through an incremental ToolCallStream in pieces of ``size``: (the text sent, each feed's deltas
    and the finish's, whether it ended in calls)."""
    stream, text, deltas = ToolCallStream(parser, incremental=True), "", []
    for at in range(0, len(reply), size):
        out, more = stream.feed(reply[at:at + size])
        text, deltas = text + out, deltas + [more]
    rest, last, called = stream.finish()
    return text + rest, deltas + [last], called


def joined(deltas: list[list[dict]]) -> list[tuple[str, str, str]]:
    """The calls the deltas make, as a client joins them: (id, name, arguments) per index."""
    calls = {}
    for delta in (d for chunk in deltas for d in chunk):
        if "id" in delta:
            assert delta["index"] not in calls and delta["type"] == "function"
            calls[delta["index"]] = [delta["id"], delta["function"]["name"], ""]
        assert set(delta["function"]) <= {"name", "arguments"}
        calls[delta["index"]][2] += delta["function"]["arguments"]
    return [tuple(calls[i]) for i in range(len(calls))]


@pytest.mark.parametrize("parser, reply", [
    (HermesToolCalls(), 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",\n"days":[1,2.50],'
                        '"note":"a \\"b\\"\\u00e9\\ud83d\\ude00"}}\n</tool_call>\n'
                        '<tool_call>{"arguments": {}, "name": "now"}</tool_call>'),
    (Llama3JsonToolCalls(), '<|python_tag|>{"name": "get_weather", "parameters": {"city":"Paris", "n": -1e3}} ; '
                            '{"name": "now", "parameters": {}}'),
    (MistralToolCalls(), 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par\u00eds"}}, '
                         '{"name": "now"}]'),
    (RequiredToolCalls(), '\n[{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}},'
                          '{"name": "now", "parameters": {}}]')])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_calls_stream_as_they_come_and_join_to_the_whole_replys(parser, reply, size):
    text, deltas, called = streamed(parser, reply, size)
    content, calls = parser.parse(reply)
    assert called and text.strip() == (content or "")
    made = joined(deltas)
    assert [(name, arguments) for _, name, arguments in made] == [
        (call.name, json.dumps(call.arguments, ensure_ascii=False)) for call in calls]
    assert all(call_id.startswith("call_") for call_id, _, _ in made) and len({i for i, _, _ in made}) == 2
    first = [d for chunk in deltas for d in chunk if d["index"] == 0]
    assert len(first) > 2  # the arguments in pieces, as they came
    assert not any(deltas[-1])  # all went out as it came
    _, deltas, _ = streamed(FirstCallOnly(parser), reply, size)
    assert [name for _, name, _ in joined(deltas)] == ["get_weather"]


def test_text_that_is_no_call_stays_text_when_streamed():
    for parser, reply in ((HermesToolCalls(), "Hi <tool_call>{not json"), (HermesToolCalls(), "<tool_call> no"),
                          (HermesToolCalls(), '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
                          (Llama3JsonToolCalls(), '{"not": "a call"}'), (MistralToolCalls(), "[TOOL_CALLS] [broken")):
        for size in (1, 4):
            assert streamed(parser, reply, size) == (reply, [[]] * (len(range(0, len(reply), size)) + 1), False)
    # a call that went out stays out: what follows the last whole one comes as text
    reply = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"a'
    text, deltas, called = streamed(HermesToolCalls(), reply, 4)
    assert called and [(n, a) for _, n, a in joined(deltas)] == [("f", "{}"), ("g", '{"a')]
    assert text == reply[reply.index("</tool_call>"):]


class ScriptedScheduler:
    """Stands in for BatchScheduler: each request gets ``reply`` in pieces of ``size`` characters (a token each),
    then its end, of reason ``finish`` ("length": a reply its token limit cut)."""

    max_model_len, eos, adapters, error, last_error = 4096, [], None, None, None

    def __init__(self):
        self.reply, self.prompts, self.params = "", [], []
        self.size, self.finish = 5, "stop"

    def submit(self, request):
        self.prompts.append(request.prompt)
        self.params.append(request.params)
        size, finish = self.size, self.finish
        pieces = [self.reply[i:i + size] for i in range(0, len(self.reply), size)] or [""]

        def answer():
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                request.on_update(Update(piece, [], finish if last else None, i + 1))
        threading.Thread(target=answer, daemon=True).start()
        return request

    def submit_all(self, requests):
        return [self.submit(request) for request in requests]


@pytest.fixture(scope="module")
def served(web):  # noqa: F811 (the fixture)
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).parent / "data" / "pipeline")
    tokenizer.chat_template = TEMPLATE
    scheduler = ScriptedScheduler()
    app = cli_serve.build_app(scheduler, tokenizer, "tiny", tool_call_parser="hermes")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30)
    yield scheduler, tokenizer, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    server.should_exit = True
    thread.join(30)


def ask(client, **extra):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=TOOLS, **extra)


def test_a_call_comes_back_as_tool_calls_and_the_tools_reach_the_template(served):
    scheduler, tokenizer, client = served
    scheduler.reply = CALLING
    out = ask(client)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert tokenizer.decode(scheduler.prompts[-1]).startswith("<|system|>tools: get_weather<|end|><|user|>")
    scheduler.reply = "It is sunny."
    followup = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    out = client.chat.completions.create(model="tiny", messages=followup, tools=TOOLS)
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    rendered = tokenizer.decode(scheduler.prompts[-1])
    assert 'call get_weather {"city": "Paris"}<|end|><|tool|>sunny<|end|><|assistant|>' in rendered


def test_streamed_calls_come_as_they_are_written_and_no_tag_leaks(served):
    """vLLM's streaming: text before a call as content, then each call's id and name, then its arguments in
    pieces; joined (as the openai client joins them), the non-streamed reply's calls."""
    scheduler, _, client = served
    scheduler.reply = "Let me check.\n" + TWO_CALLS
    whole = ask(client).choices[0].message
    chunks = list(ask(client, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert "<tool" not in content and content == "Let me check.\n"
    first_call = next(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:first_call]) == "Let me check.\n"
    assert [t.index for t in calls if t.id] == [0, 1] and all(t.function.name is None for t in calls if not t.id)
    assert sum(t.index == 0 for t in calls) > 2  # the arguments in pieces
    assert [(t.function.name, "".join(p.function.arguments for p in calls if p.index == t.index)) for t in calls
            if t.id] == [(w.function.name, w.function.arguments) for w in whole.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None] * (len(chunks) - 1) + ["tool_calls"]
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                        tools=TOOLS) as stream:  # the client's own accumulation
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check.\n"
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == [
        (w.function.name, w.function.arguments) for w in whole.tool_calls]
    ids = [t.id for t in final.message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    chunks = list(ask(client, stream=True, parallel_tool_calls=False))  # OpenAI's option: the first call only
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert {t.index for t in calls} == {0} and "".join(t.function.arguments for t in calls) == '{"city": "Paris"}'
    scheduler.reply = TWO_CALLS
    out = ask(client, parallel_tool_calls=False)
    assert [t.function.name for t in out.choices[0].message.tool_calls] == ["get_weather"]
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    for reply in ("<tool_call>{broken</tool_call> so text", "Hi <tool_call>{not json"):  # text, as when whole
        scheduler.reply = reply
        chunks = list(ask(client, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop" and ask(client).choices[0].message.content == reply


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_constrains_the_output_to_its_arguments(served):
    """OpenAI's and vLLM's forced function: the output is the function's arguments (constrained to its parameters'
    schema), returned as the call, the choice ending with "stop"; streamed, the arguments come in pieces."""
    scheduler, _, client = served
    scheduler.reply = '{"city": "Paris"}'
    out = ask(client, tool_choice=NAMED)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert scheduler.params[-1].grammar is not None  # the output was constrained
    chunks = list(ask(client, tool_choice=NAMED, stream=True))  # the arguments stream as they come, as OpenAI's
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 4 and {t.index for t in calls} == {0} and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and all(t.function.name is None for t in calls[1:])
    assert "".join(t.function.arguments for t in calls) == '{"city": "Paris"}'
    assert chunks[-1].choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                        tools=TOOLS, tool_choice=NAMED) as stream:  # the client's own accumulation
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    scheduler.reply = '{"city": "Par'  # cut by max_tokens: no call, the text as it is
    out = ask(client, tool_choice=NAMED)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content == '{"city": "Par'


def test_a_required_tool_choice_gives_one_call_or_more(served):
    """Streamed, the calls come as the auto ones do: each one's id and name, then its arguments in pieces, joined
    (as the openai client joins them) the non-streamed reply's."""
    scheduler, _, client = served
    scheduler.reply = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                       '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    out = ask(client, tool_choice="required")
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    whole = out.choices[0].message.tool_calls
    assert [json.loads(t.function.arguments)["city"] for t in whole] == ["Paris", "Rome"]
    chunks = list(ask(client, tool_choice="required", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name) for t in calls if t.id] == [(0, "get_weather"), (1, "get_weather")]
    assert all(t.function.name is None for t in calls if not t.id)
    assert sum(t.index == 0 for t in calls) > 2 and sum(t.index == 1 for t in calls) > 2  # the arguments in pieces
    assert ["".join(t.function.arguments for t in calls if t.index == i) for i in (0, 1)] == [
        w.function.arguments for w in whole]
    first_of_rome = next(i for i, c in enumerate(chunks) if c.choices and any(
        t.index == 1 for t in c.choices[0].delta.tool_calls or []))
    assert first_of_rome < len(chunks) - 1  # not all in the last chunk
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None] * (len(chunks) - 1) + ["tool_calls"]
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                        tools=TOOLS, tool_choice="required") as stream:  # the client's accumulation
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == [
        (w.function.name, w.function.arguments) for w in whole]


def test_the_schema_of_a_forced_call():
    tools = TOOLS + [{"type": "function", "function": {"name": "now"}}]  # (no parameters: an empty object)
    schema, parser = forced_call_schema(tools, NAMED)
    assert schema == CITY and isinstance(parser, NamedToolCall)
    schema, parser = forced_call_schema(tools, "required", parallel=False)
    assert isinstance(parser, RequiredToolCalls) and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    # definitions that references name go to the root, where "#/$defs/..." points
    place = {"$defs": {"Place": CITY}, "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}}
    schema, _ = forced_call_schema([{"type": "function", "function": {"name": "go", "parameters": place}}],
                                   "required")
    assert schema["$defs"] == {"Place": CITY} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    clash = {"$defs": {"Place": {"type": "string"}}, "type": "object"}
    with pytest.raises(ValueError, match="Place"):
        forced_call_schema([{"type": "function", "function": {"name": "go", "parameters": place}},
                            {"type": "function", "function": {"name": "stay", "parameters": clash}}], "required")
    assert RequiredToolCalls().parse('[{"name": "now", "parameters": {}}]') == (None, [ToolCall("now", {})])
    assert RequiredToolCalls().parse("[]") == ("[]", []) and NamedToolCall("now").parse("[1]") == ("[1]", [])


def test_tool_choices_the_server_cannot_honour_are_refused(served):
    _, _, client = served
    for choice, match in (("any", "tool_choice 'any' is none of"),
                          ({"type": "function", "function": {"name": "get_time"}}, "not among 'tools'"),
                          ({"type": "function"}, "a named tool_choice is")):
        with pytest.raises(openai.BadRequestError, match=match):
            ask(client, tool_choice=choice)
    with pytest.raises(openai.BadRequestError, match="each constrain the output"):
        ask(client, tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="only allowed when 'tools' are given"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       tool_choice="required")
    with pytest.raises(ApiError, match="tool calls are not enabled") as refused:  # a server without parser
        refuse_unsupported({"tools": TOOLS}, chat=True)
    assert refused.value.status == 400
    refuse_unsupported({"tools": TOOLS, "tool_choice": "none"}, chat=True)  # the tools only rendered
    refuse_unsupported({"tools": TOOLS, "tool_choice": NAMED}, chat=True)  # forced: no parser needed


def test_the_two_options_go_together(web, capsys):  # noqa: F811 (the fixture)
    from vkformers.cli import main
    model = str(Path(__file__).parent / "data" / "pipeline")
    assert main(["serve", model, "--port", str(free_port()), "--enable-auto-tool-choice"]) == 1
    assert "--enable-auto-tool-choice and --tool-call-parser go together" in capsys.readouterr().err
