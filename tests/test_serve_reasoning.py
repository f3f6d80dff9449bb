"""Thinking models on `vkformers serve --reasoning-parser` (models/reasoning.py) and the chat template's variables
(vLLM's ``chat_template_kwargs``, ``--default-chat-template-kwargs``).

The reasoning parsers split replies as vLLM's deepseek_r1 and qwen3 parsers do: the reasoning in the message's
``reasoning`` and ``reasoning_content`` (the openai client keeps both as extra fields), the answer in ``content``,
whole and streamed alike, tags split over pieces or not, a reply cut inside its thinking all reasoning; tool calls
and forced tool choices read from the answer after the reasoning; an output grammar kept to the answer; the
Responses route's reasoning item and its stream events; ``reasoning_tokens`` in the usage; bad input refused.

The replies are scripted (test_serve_tools' ScriptedScheduler answers each request with a fixed text in pieces, each
a token): what is tested is the splitting and the wire format, which a random model would never exercise. The
template variables reach a real tiny model's template, and an output grammar after an open thinking runs on its
scheduler."""
from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path

import pytest
from test_serve import (SERVED, error_of, free_port, openai, reference_tokens, request, serving,  # noqa: F401
                        uvicorn, wait_for, web, write_tiny_model)
from test_serve_tools import CALLING, CITY, TOOLS, ScriptedScheduler

from vkformers.cli import generate as cli_generate
from vkformers.cli import main
from vkformers.cli import serve as cli_serve
from vkformers.errors import VkformersError
from vkformers.models.batching import BatchScheduler
from vkformers.models.gguf import load_gguf_model
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.reasoning import (ANSWER, OPENING, THINKING, DeepSeekR1Reasoning, Qwen3Reasoning,
                                        ReasoningStream)
from vkformers.models.structured_output import (GrammarVocabulary, TokenConstraint, after_thinking,
                                                any_object_grammar, regex_grammar)

PIPELINE = Path(__file__).parent / "data" / "pipeline"
TOOL_LIST = ("{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|end|>"
             "{% endif %}")
# DeepSeek-R1's way: the generation prompt opens the thinking; an earlier turn's reasoning shown as it comes back
R1_TEMPLATE = (TOOL_LIST + "{% for m in messages %}<|{{ m['role'] }}|>{% if m.get('reasoning_content') %}"
               "(thought: {{ m['reasoning_content'] }}){% endif %}{{ m['content'] }}<|end|>{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
# Qwen3's way: the reply opens its thinking itself; enable_thinking false closes it in the prompt; earlier turns
# keep their thinking between the tags; a variable of the server's defaults in the header
QWEN_TEMPLATE = ("<|system|>for {{ name }}<|end|>" + TOOL_LIST + "{% for m in messages %}<|{{ m['role'] }}|>"
                 "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
                 "{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                 "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "Two and two: <tool_call> is no call here, and 4 < 5.\n"
ANSWERED = THOUGHT + "</think>\n\nThe answer is 4."


# ---------------------------------------------------------------- the parsers

SPLITS = [  # (parser, where the reply starts, reply, (reasoning, answer) or None where the reply never thought)
    (DeepSeekR1Reasoning, THINKING, ANSWERED, (THOUGHT, "\n\nThe answer is 4.")),
    (DeepSeekR1Reasoning, THINKING, "<think>\nhmm</think>x", ("\nhmm", "x")),  # R1-0528 writes the tag again
    (DeepSeekR1Reasoning, THINKING, "</think>x", ("", "x")),
    (DeepSeekR1Reasoning, THINKING, "cut before the end </thi", ("cut before the end </thi", "")),
    (DeepSeekR1Reasoning, ANSWER, "<think>x</think>y", None),  # the template closed the thinking: all answer
    (Qwen3Reasoning, OPENING, "<think>\nabc\n</think>\n\nAnswer", ("\nabc\n", "\n\nAnswer")),
    (Qwen3Reasoning, OPENING, "\n <think>x</think>y", ("x", "y")),
    (Qwen3Reasoning, OPENING, "<think>cut", ("cut", "")),
    (Qwen3Reasoning, OPENING, "Plain answer", None),
    (Qwen3Reasoning, OPENING, "An answer about <think> tags", None),  # the thinking opens at the start only
    (Qwen3Reasoning, OPENING, " <thi", None),
    (Qwen3Reasoning, OPENING, "", None),
    (Qwen3Reasoning, THINKING, "abc</think>def", ("abc", "def")),  # opened by the template (Qwen3-Thinking-2507)
]


def split(parser, start, reply, size):
    """``reply`` through a ReasoningStream in pieces of ``size`` characters, each a token: (what feed and finish
    gave, joined, as (reasoning, answer)), and the stream."""
    stream = ReasoningStream(parser(), start)
    given = [stream.feed(reply[i:i + size], i // size + 1) for i in range(0, len(reply), size)] + [stream.finish()]
    return ("".join(r for r, _ in given), "".join(c for _, c in given)), stream


@pytest.mark.parametrize("parser, start, reply, expected", SPLITS)
def test_replies_split_as_vllms_parsers_split_them_whatever_their_pieces(parser, start, reply, expected):
    for size in (1, 2, 3, 5, len(reply) or 1):
        given, stream = split(parser, start, reply, size)
        assert given == (stream.reasoning, stream.content)
        assert stream.thought == (expected is not None)
        assert given == (expected if expected is not None else ("", reply)), size
        if size == 1 and expected is not None:  # a token a character: the reasoning's tokens exactly
            assert stream.reasoning_tokens == len(expected[0])
        if expected is None:
            assert stream.reasoning_tokens == 0


def test_where_a_reply_starts_is_read_from_the_generation_prompt():
    r1, qwen3 = DeepSeekR1Reasoning(), Qwen3Reasoning()
    assert r1.reply_start("<|assistant|><think>\n") == r1.reply_start("<|assistant|>") == THINKING
    assert qwen3.reply_start("<|assistant|>") == OPENING and qwen3.reply_start("<|assistant|><think>\n") == THINKING
    assert qwen3.reply_start("<|assistant|><think>\n\n</think>\n\n") == r1.reply_start("<think></think>") == ANSWER


def constrained(grammar, *parts, tokenizer=None):
    """Whether the grammar engine lets ``parts`` (texts, as the tiny tokenizer's tokens, and token ids) through
    ("refused" where it does not), and accepts them whole ("whole") or so far."""
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(PIPELINE)
    constraint = TokenConstraint(GrammarVocabulary.of(tokenizer, len(tokenizer)), grammar, [tokenizer.eos_token_id])
    for part in parts:
        for token in [part] if isinstance(part, int) else tokenizer(part, add_special_tokens=False)["input_ids"]:
            if not constraint.allowed()[token]:
                return "refused"
            constraint.advance(token)
    return "whole" if constraint.matcher.is_accepting() else "so far"


TAGS = ("<think>", "</think>")


def test_an_output_grammar_after_the_thinking_leaves_the_thinking_free():
    answer = regex_grammar("yes|no")
    opened = after_thinking(answer, TAGS)
    assert constrained(opened, "x <think> y </thin k> {}</think>\n\nno") == "whole"
    assert constrained(opened, "still thinking") == "so far"  # no end token inside the thinking
    assert constrained(opened, "ok</think>maybe") == "refused" == constrained(opened, "a</think>b</think>no")
    assert constrained(opened, "ok</think>" + "\n" * 9 + "no") == "refused"  # at most THINKING_GAP blanks
    may_open = after_thinking(answer, TAGS, opened=False)  # qwen3's reply that opens no thinking answers at once
    assert constrained(may_open, "yes") == constrained(may_open, "\n<think>hmm</think>\nno") == "whole"
    assert constrained(may_open, "hmm</think>no") == "refused"
    as_json = after_thinking(any_object_grammar(), TAGS)  # the JSON schema grammar of llguidance's list
    assert constrained(as_json, 'a {"b"</think>\n{"c": 1}') == "whole"
    assert constrained(as_json, "a</think>[1]") == "refused"


def test_tags_that_are_tokens_of_their_own_close_and_open_the_thinking():
    """Thinking models' vocabularies add <think> and </think> as tokens (not special: decoding keeps them), which
    the grammar engine sees apart from the text: the grammar names them, and they are text tokens to the mask."""
    tokenizer = AutoTokenizer.from_pretrained(PIPELINE)
    tokenizer.add_tokens(list(TAGS))
    tokens = DeepSeekR1Reasoning().tag_tokens(tokenizer)
    assert tokens == (len(tokenizer) - 2, len(tokenizer) - 1) and Qwen3Reasoning().tag_tokens(
        AutoTokenizer.from_pretrained(PIPELINE)) == (None, None)
    assert GrammarVocabulary.of(tokenizer, len(tokenizer)).text_tokens[list(tokens)].all()
    opening, closing = tokens
    opened, may_open = (after_thinking(regex_grammar("yes|no"), TAGS, tokens, opened=o) for o in (True, False))
    for grammar in (opened, may_open):
        assert constrained(grammar, opening, "\nhmm", closing, "\n\nno", tokenizer=tokenizer) == "whole"
        assert constrained(grammar, opening, "x</think>yes", tokenizer=tokenizer) == "whole"  # written out too
        assert constrained(grammar, opening, "x", closing, "maybe", tokenizer=tokenizer) == "refused"
    assert constrained(opened, "hmm", closing, "yes", tokenizer=tokenizer) == "whole"
    assert constrained(opened, "hmm", opening, tokenizer=tokenizer) == "refused"  # opened once, at the start
    assert constrained(may_open, "hmm", closing, tokenizer=tokenizer) == "refused"
    assert constrained(may_open, closing, tokenizer=tokenizer) == "refused"


# ---------------------------------------------------------------- scripted servers

@contextlib.contextmanager
def scripted(template, **options):
    """A ScriptedScheduler served with ``template`` and build_app's ``options``: (scheduler, tokenizer, client)."""
    tokenizer = AutoTokenizer.from_pretrained(PIPELINE)
    tokenizer.chat_template = template
    scheduler = ScriptedScheduler()
    app = cli_serve.build_app(scheduler, tokenizer, "tiny", **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30)
    try:
        yield scheduler, tokenizer, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                                  max_retries=0), port
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def r1(web):  # noqa: F811 (the fixture)
    with scripted(R1_TEMPLATE, reasoning_parser="deepseek_r1", tool_call_parser="hermes") as served:
        yield served


@pytest.fixture(scope="module")
def qwen3(web):  # noqa: F811 (the fixture)
    with scripted(QWEN_TEMPLATE, reasoning_parser="qwen3", tool_call_parser="hermes",
                  chat_template_kwargs={"name": "vk"}) as served:
        yield served


def script(scheduler, reply, *, size=5, finish="stop"):
    scheduler.reply, scheduler.size, scheduler.finish = reply, size, finish


def ask(client, messages=QUESTION, **extra):
    return client.chat.completions.create(model="tiny", messages=messages, **extra)


def streamed(client, messages=QUESTION, **extra):
    """A streamed reply: (its chunks, the reasoning joined, the answer joined)."""
    chunks = list(ask(client, messages, stream=True, **extra))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    for delta in deltas:  # vLLM's field and its older one (and DeepSeek's), the same text
        assert delta.model_extra.get("reasoning") == delta.model_extra.get("reasoning_content")
    reasoning = "".join(d.model_extra.get("reasoning") or "" for d in deltas)
    return chunks, reasoning, "".join(d.content or "" for d in deltas)


def reasoning_of(message):
    assert message.model_extra["reasoning"] == message.reasoning_content  # (an extra field: attribute access too)
    return message.reasoning_content


def test_deepseek_r1_replies_give_their_reasoning_apart_whole_and_streamed(r1):
    scheduler, tokenizer, client, _ = r1
    script(scheduler, ANSWERED, size=1)  # a token a character: reasoning_tokens counted exactly
    out = ask(client)
    message = out.choices[0].message
    assert reasoning_of(message) == THOUGHT and message.content == "\n\nThe answer is 4."
    assert out.choices[0].finish_reason == "stop" and message.tool_calls is None
    assert out.usage.completion_tokens == len(ANSWERED)
    assert out.usage.completion_tokens_details.reasoning_tokens == len(THOUGHT)
    assert tokenizer.decode(scheduler.prompts[-1]).endswith("<|user|>What is 2 + 2?<|end|><|assistant|><think>\n")
    for size in (1, 3, 5, 8):  # "</think>" whole in a piece, or split over two or more
        script(scheduler, ANSWERED, size=size)
        chunks, reasoning, content = streamed(client, stream_options={"include_usage": True})
        assert (reasoning, content) == (THOUGHT, "\n\nThe answer is 4."), size
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].usage.completion_tokens == -(-len(ANSWERED) // size)
        if size == 1:
            assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == len(THOUGHT)
        firsts = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content]
        lasts = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.model_extra.get("reasoning")]
        assert max(lasts) < min(firsts)  # the reasoning comes first, in chunks of its own


def test_a_reply_cut_inside_its_thinking_is_all_reasoning(r1):
    scheduler, _, client, _ = r1
    for reply in ("Still weighing whether 2 + 2", "Still weighing </thi"):  # a tag's beginning stays text
        script(scheduler, reply, size=1, finish="length")
        out = ask(client, max_tokens=len(reply))
        message = out.choices[0].message
        assert reasoning_of(message) == reply and message.content is None
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens_details.reasoning_tokens == len(reply) == out.usage.completion_tokens
        chunks, reasoning, content = streamed(client)
        assert (reasoning, content) == (reply, "") and chunks[-1].choices[0].finish_reason == "length"


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(r1):
    scheduler, _, client, _ = r1
    script(scheduler, THOUGHT + "</think>\n\n" + CALLING)  # the reasoning's own "<tool_call>" is no call
    out = ask(client, tools=TOOLS)
    message = out.choices[0].message
    assert reasoning_of(message) == THOUGHT and message.content == "Let me check."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert out.choices[0].finish_reason == "tool_calls"
    chunks, reasoning, content = streamed(client, tools=TOOLS)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert reasoning == THOUGHT and content.strip() == "Let me check." and "<tool" not in content
    assert [t.function.name for t in calls if t.id] == ["get_weather"] and len(calls) > 2  # streamed in pieces
    assert "".join(t.function.arguments for t in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_forced_call_and_a_response_format_constrain_the_answer_only(r1):
    scheduler, _, client, _ = r1
    script(scheduler, 'The user asks about Paris.</think>\n{"city": "Paris"}')
    out = ask(client, tools=TOOLS, tool_choice=NAMED)
    message = out.choices[0].message
    (call,) = message.tool_calls
    assert reasoning_of(message) == "The user asks about Paris." and message.content is None
    assert json.loads(call.function.arguments) == {"city": "Paris"} and out.choices[0].finish_reason == "stop"
    grammar = json.loads(scheduler.params[-1].grammar)["grammars"]
    assert grammar[0]["lark_grammar"].startswith("start: thinking ")  # the reply starts inside the thinking
    assert grammar[1]["json_schema"]["properties"] == CITY["properties"]
    chunks, reasoning, _ = streamed(client, tools=TOOLS, tool_choice=NAMED)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert reasoning == "The user asks about Paris." and calls[0].function.name == "get_weather"
    assert "".join(t.function.arguments for t in calls) == '{"city": "Paris"}'  # (the blank before it dropped)
    script(scheduler, 'Some JSON, then.</think>\n\n{"city": "Rome"}')
    schema = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY, "strict": True}}
    out = ask(client, response_format=schema)
    assert json.loads(out.choices[0].message.content) == {"city": "Rome"}
    assert reasoning_of(out.choices[0].message) == "Some JSON, then."
    assert json.loads(scheduler.params[-1].grammar)["grammars"][1]["json_schema"]["properties"] == CITY["properties"]


def test_include_reasoning_false_leaves_the_reasoning_out(r1):
    scheduler, _, client, _ = r1
    script(scheduler, ANSWERED, size=1)
    out = ask(client, extra_body={"include_reasoning": False})
    assert reasoning_of(out.choices[0].message) is None and out.choices[0].message.content == "\n\nThe answer is 4."
    assert out.usage.completion_tokens_details.reasoning_tokens == len(THOUGHT)  # (generated all the same)
    _, reasoning, content = streamed(client, extra_body={"include_reasoning": False})
    assert (reasoning, content) == ("", "\n\nThe answer is 4.")


def test_earlier_reasoning_goes_back_to_the_template(r1):
    scheduler, tokenizer, client, _ = r1
    script(scheduler, "ok</think>4")
    turns = QUESTION + [{"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
                        {"role": "user", "content": "Sure?"}]
    ask(client, turns)
    assert "<|assistant|>(thought: simple sum)4<|end|>" in tokenizer.decode(scheduler.prompts[-1])
    turns[1] = {"role": "assistant", "content": "4", "reasoning": "vLLM's name"}
    ask(client, turns)
    assert "(thought: vLLM's name)4" in tokenizer.decode(scheduler.prompts[-1])


def test_qwen3_replies_think_only_where_the_thinking_opens(qwen3):
    scheduler, tokenizer, client, _ = qwen3
    script(scheduler, "<think>\nabc\n</think>\n\nAnswer", size=1)
    out = ask(client)
    assert reasoning_of(out.choices[0].message) == "\nabc\n" and out.choices[0].message.content == "\n\nAnswer"
    assert out.usage.completion_tokens_details.reasoning_tokens == len("\nabc\n")  # the tags not counted
    script(scheduler, "Plain answer")
    out = ask(client)
    assert reasoning_of(out.choices[0].message) is None and out.choices[0].message.content == "Plain answer"
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
    assert streamed(client)[1:] == ("", "Plain answer")
    # thinking off: the template closes it in the prompt, the reply is all answer
    script(scheduler, "No thought <think> here")
    out = ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(out.choices[0].message) is None and out.choices[0].message.content == "No thought <think> here"
    assert tokenizer.decode(scheduler.prompts[-1]).endswith("<|assistant|><think>\n\n</think>\n\n")
    # an earlier turn's thinking in the prompt does not close the new reply's
    script(scheduler, "<think>new</think>done")
    turns = QUESTION + [{"role": "assistant", "content": "4", "reasoning_content": "old"},
                        {"role": "user", "content": "Sure?"}]
    out = ask(client, turns)
    assert "<|assistant|><think>old</think>4<|end|>" in tokenizer.decode(scheduler.prompts[-1])
    assert reasoning_of(out.choices[0].message) == "new" and out.choices[0].message.content == "done"


def test_the_server_default_template_variables_and_a_request_over_them(qwen3):
    scheduler, tokenizer, client, port = qwen3
    script(scheduler, "hi")
    ask(client)
    assert tokenizer.decode(scheduler.prompts[-1]).startswith("<|system|>for vk<|end|>")
    ask(client, extra_body={"chat_template_kwargs": {"name": "you"}})
    assert tokenizer.decode(scheduler.prompts[-1]).startswith("<|system|>for you<|end|>")
    server = {"port": port}
    status, text = request(server, "POST", "/tokenize", {"messages": QUESTION, "chat_template_kwargs": {"name": "x"}},
                           key=None)
    assert status == 200 and tokenizer.decode(json.loads(text)["tokens"]).startswith("<|system|>for x<|end|>")
    # a grammar where the template closed the thinking is the answer's alone
    schema = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    script(scheduler, '{"city": "Oslo"}')
    ask(client, response_format=schema, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoned" not in scheduler.params[-1].grammar
    ask(client, response_format=schema)  # a reply that may open its thinking, or answer at once
    assert json.loads(scheduler.params[-1].grammar)["grammars"][0]["lark_grammar"].startswith(
        "start: @json_schema | opening thinking ")


def test_bad_template_variables_and_reasoning_fields_are_refused(qwen3):
    _, _, client, port = qwen3
    server = {"port": port}
    for value, match in (("enable_thinking=false", "must be a JSON object"),
                         ({"messages": []}, "may not set 'messages'"),
                         ({"add_generation_prompt": False, "tools": []}, "'add_generation_prompt', 'tools'")):
        for route, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/responses", {"input": "hi"}),
                            ("/tokenize", {"messages": QUESTION})):
            status, error = error_of(request(server, "POST", route, {**body, "chat_template_kwargs": value},
                                             key=None))
            assert status == 400 and match in error["message"] and error["param"] == "chat_template_kwargs", route
    with pytest.raises(openai.BadRequestError, match="'include_reasoning' must be true or false"):
        ask(client, extra_body={"include_reasoning": "yes"})
    with pytest.raises(openai.BadRequestError, match="'reasoning' must be a string"):
        ask(client, QUESTION + [{"role": "assistant", "content": "4", "reasoning_content": ["no"]}])


# ---------------------------------------------------------------- the Responses route

REASONING_EVENTS = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
REASONING_END = ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]


def test_responses_give_a_reasoning_item_before_the_message(r1):
    scheduler, tokenizer, client, _ = r1
    script(scheduler, ANSWERED, size=1)
    response = client.responses.create(model="tiny", input="What is 2 + 2?")
    thought, message = response.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
    assert [(part.type, part.text) for part in thought.content] == [("reasoning_text", THOUGHT)]
    assert thought.status == "completed" and message.type == "message"
    assert response.output_text == "\n\nThe answer is 4." and response.status == "completed"
    assert response.usage.output_tokens_details.reasoning_tokens == len(THOUGHT)
    assert response.usage.output_tokens == len(ANSWERED)
    # the stored response goes on with its reasoning back in the template
    script(scheduler, "sure</think>Yes.")
    client.responses.create(model="tiny", input="Sure?", previous_response_id=response.id)
    assert "<|assistant|>(thought: " + THOUGHT + ")\n\nThe answer is 4.<|end|><|user|>Sure?" in tokenizer.decode(
        scheduler.prompts[-1])
    # a reasoning item in the input joins the assistant message after it
    client.responses.create(model="tiny", input=[
        {"role": "user", "content": "hi"}, {"type": "reasoning", "id": "rs_1", "summary": [],
                                            "content": [{"type": "reasoning_text", "text": "greet back"}]},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again"}])
    assert "<|assistant|>(thought: greet back)Hello<|end|><|user|>again" in tokenizer.decode(scheduler.prompts[-1])


def test_streamed_responses_send_the_reasoning_events_first(r1):
    scheduler, _, client, _ = r1
    script(scheduler, ANSWERED, size=3)
    events = list(client.responses.create(model="tiny", input="What is 2 + 2?", stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    texts = [e for e in events if e.type == "response.output_text.delta"]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:5] == ["response.created", "response.in_progress"] + REASONING_EVENTS
    assert kinds[first_text - 5:first_text] == REASONING_END + ["response.output_item.added",
                                                                "response.content_part.added"]
    assert "".join(e.delta for e in deltas) == THOUGHT and "".join(e.delta for e in texts) == "\n\nThe answer is 4."
    assert {e.output_index for e in deltas} == {0} and {e.output_index for e in texts} == {1}
    assert events[kinds.index("response.reasoning_text.done")].text == THOUGHT
    assert events[kinds.index("response.content_part.added")].part.type == "reasoning_text"
    final = events[-1].response
    assert events[-1].type == "response.completed" and [item.type for item in final.output] == ["reasoning",
                                                                                                "message"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # cut inside the thinking: the reasoning item alone, incomplete
    script(scheduler, "Still weighing", size=1, finish="length")
    cut = client.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=14)
    assert cut.status == "incomplete" and [(i.type, i.status) for i in cut.output] == [("reasoning", "incomplete")]
    assert cut.usage.output_tokens_details.reasoning_tokens == 14
    events = list(client.responses.create(model="tiny", input="What is 2 + 2?", max_output_tokens=14, stream=True))
    assert events[-1].type == "response.incomplete"
    assert [(i.type, i.status, i.content[0].text) for i in events[-1].response.output] == [
        ("reasoning", "incomplete", "Still weighing")]
    assert "response.output_text.delta" not in [e.type for e in events]


def test_a_function_call_after_the_reasoning_in_the_responses_route(r1):
    scheduler, _, client, _ = r1
    script(scheduler, "Need the weather.</think>" + CALLING.split("\n", 1)[1])  # the call alone, no text
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=tools)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert json.loads(response.output[1].arguments) == {"city": "Paris"}
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=tools, stream=True))
    assert [item.type for item in events[-1].response.output] == ["reasoning", "function_call"]
    assert "response.output_text.delta" not in [e.type for e in events]


# ---------------------------------------------------------------- a real model, the command line

THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>about {{ topic }}: {% if think %}<think>\n{% endif %}"
                     "{% endif %}")


def test_template_variables_reach_a_real_models_template_and_a_grammar_runs_after_its_thinking(
        tmp_path_factory, web):  # noqa: F811 (the fixture)
    path, tokenizer, model = write_tiny_model(tmp_path_factory.mktemp("reasoning"))
    tokenizer.chat_template = THINKING_TEMPLATE
    # the scheduler runs a model of its own (the engine is not shared across threads): ``model`` is generate's
    served = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    scheduler = BatchScheduler(served, tokenizer, max_batch=2, max_model_len=128,
                               eos=cli_serve.eos_ids(served, tokenizer)).start()
    with serving(scheduler, tokenizer, reasoning_parser="qwen3", chat_template_kwargs={"topic": "cats"}) as server:
        client = server["client"]

        def templated(**variables):
            return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, **variables)
        dogs = tokenizer(templated(topic="dogs"), add_special_tokens=False)["input_ids"]
        status, text = request(server, "POST", "/tokenize", {"messages": QUESTION,
                                                            "chat_template_kwargs": {"topic": "dogs"}})
        assert status == 200 and json.loads(text)["tokens"] == dogs and "about dogs: " in tokenizer.decode(dogs)
        status, text = request(server, "POST", "/tokenize", {"messages": QUESTION})  # the server's default
        assert json.loads(text)["tokens"] == tokenizer(templated(topic="cats"), add_special_tokens=False)["input_ids"]
        out = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=6, temperature=0,
                                             extra_body={"chat_template_kwargs": {"topic": "dogs"}})
        tokens = reference_tokens(model, dogs, 6, cli_serve.eos_ids(model, tokenizer)).tolist()
        assert out.usage.prompt_tokens == len(dogs) and out.usage.completion_tokens == len(tokens)
        assert out.choices[0].message.content == tokenizer.decode(tokens, skip_special_tokens=True)
        # the template opens the thinking: a JSON object is kept to the answer, the thinking runs free (and cannot
        # end the reply): cut at max_tokens, the reply is all reasoning
        out = client.chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=8, temperature=0,
                                             response_format={"type": "json_object"},
                                             extra_body={"chat_template_kwargs": {"think": True}})
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "length" and message.content is None
        assert message.reasoning_content and out.usage.completion_tokens_details.reasoning_tokens == 8


def test_the_command_line_options(tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(PIPELINE)
    tokenizer.add_tokens(["<think>", "</think>"])  # text tokens, as Qwen3's and DeepSeek-R1's: served
    assert len(tokenizer("</think>", add_special_tokens=False)["input_ids"]) == 1
    cli_serve.check_reasoning_tags(tokenizer, "qwen3")
    special = AutoTokenizer.from_pretrained(PIPELINE)
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    with pytest.raises(VkformersError, match="makes <think> a special token"):
        cli_serve.check_reasoning_tags(special, "deepseek_r1")
    with pytest.raises(SystemExit):
        main(["serve", str(PIPELINE), "--default-chat-template-kwargs", '{"tools": []}'])
    assert "may not set 'tools'" in capsys.readouterr().err
    assert main(["generate", "--model", str(PIPELINE), "--prompt", "hi", "--chat-template-kwargs", "{}"]) == 1
    assert "--chat-template-kwargs sets variables of the chat template: add --chat" in capsys.readouterr().err
    tokenizer.chat_template = THINKING_TEMPLATE
    ids = cli_generate.prompt_ids(tokenizer, "hi", chat=True, system=None, template_kwargs={"topic": "owls"})
    assert tokenizer.decode(ids[0].tolist()) == "<|user|>hi<|end|><|assistant|>about owls: "
