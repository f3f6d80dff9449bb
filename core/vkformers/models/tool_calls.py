"""Tool calls in a model's output, as the OpenAI API returns them (``vkformers serve --enable-auto-tool-choice
--tool-call-parser NAME``, vLLM's options).

A chat request's ``tools`` go to the chat template, which tells the model how to call them; the model then writes
its calls in its own format, which a parser turns into the API's ``tool_calls``:

- ``hermes`` (Hermes, Qwen 2.5 and Qwen 3 templates): each call a JSON object {"name": ..., "arguments": {...}}
  between ``<tool_call>`` and ``</tool_call>``, after any text;
- ``llama3_json`` (Llama 3.1 - 3.3 templates): the whole reply a JSON object {"name": ..., "parameters": {...}}, or
  several separated by ";", optionally after ``<|python_tag|>``;
- ``mistral`` (Mistral's templates): ``[TOOL_CALLS]`` then a JSON list of {"name": ..., "arguments": {...}}.

Output whose calls do not parse stays text, as vLLM leaves it. While a reply streams, :class:`ToolCallStream` holds
back the text from where a call may begin (``held_from``), so the calls never reach the client as text; the calls
come whole at the end.

A ``tool_choice`` that forces a call needs no parser and no call format of the model's: the output is constrained
(models/structured_output.py) to the JSON schema :func:`forced_call_schema` gives, as vLLM and OpenAI do. A named
function's output is its arguments (:class:`NamedToolCall`; streamed as they come, :class:`NamedCallStream`);
``"required"`` makes it a JSON list of one or more {"name": ..., "parameters": {...}} (:class:`RequiredToolCalls`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def api(self, index: int | None = None) -> dict:
        """The call as OpenAI's message field ``tool_calls`` holds it (arguments as a JSON string)."""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return call if index is None else {"index": index, **call}


def _call(value) -> ToolCall | None:
    """A {"name": ..., "arguments" or "parameters": {...}} object as a call, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


class TaggedToolCalls:
    """Calls after a start marker that may follow text: the stream holds the text back from the marker, or from a
    tail that may be its first characters."""

    start = ""
    finish_reason = "tool_calls"  # a choice's, when its calls parse

    def held_from(self, text: str, sent: int) -> int:
        found = text.find(self.start, sent)
        if found >= 0:
            return found
        for keep in range(min(len(self.start) - 1, len(text) - sent), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def first(self, text: str) -> int:
        return text.find(self.start)


class HermesToolCalls(TaggedToolCalls):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more, after the reply's text."""

    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text before the calls, or None when there is none; the calls), or (text, []) when it holds no
        call that parses."""
        first = text.find(self.start)
        if first < 0:
            return text, []
        calls = []
        for body in re.findall(re.escape(self.start) + r"(.*?)(?:" + re.escape(self.end) + r"|$)", text[first:],
                               flags=re.S):
            try:
                call = _call(json.loads(body.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:first].strip()
        return (content or None), calls


class MistralToolCalls(TaggedToolCalls):
    """``[TOOL_CALLS]`` then a JSON list of calls, after the reply's text."""

    start = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = text.find(self.start)
        if first < 0:
            return text, []
        try:
            values = json.loads(text[first + len(self.start):].strip())
        except json.JSONDecodeError:
            return text, []
        calls = [_call(v) for v in (values if isinstance(values, list) else [values])]
        if not calls or None in calls:
            return text, []
        return (text[:first].strip() or None), calls


class Llama3JsonToolCalls:
    """The whole reply one JSON call, or several separated by ";", optionally after ``<|python_tag|>``."""

    tag = "<|python_tag|>"
    finish_reason = "tool_calls"

    def held_from(self, text: str, sent: int) -> int:
        """All of it while the reply may still be a call (blank so far, the tag or its beginning, or JSON)."""
        if sent:  # text went out already: the reply is not a call
            return len(text)
        head = text.lstrip()
        if self.tag.startswith(head):
            return 0
        body = head[len(self.tag):].lstrip() if head.startswith(self.tag) else head
        return 0 if not body or body[0] == "{" else len(text)

    def first(self, text: str) -> int:
        return 0

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.tag):].strip() if body.startswith(self.tag) else body
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                value, at = decoder.raw_decode(body, at)
                calls.append(_call(value))
                at = len(body) - len(body[at:].lstrip().lstrip(";").lstrip())
        except json.JSONDecodeError:
            return text, []
        if None in calls:
            return text, []
        return None, calls


TOOL_CALL_PARSERS = {"hermes": HermesToolCalls, "llama3_json": Llama3JsonToolCalls, "mistral": MistralToolCalls}


class ForcedToolCalls:
    """Output constrained to calls (tool_choice "required" or a named function): all of it held while it streams,
    the calls parsed at its end. ``finish_reason``: the choice's finish reason when the calls parse."""

    finish_reason = "tool_calls"

    def held_from(self, text: str, sent: int) -> int:
        return sent

    def first(self, text: str) -> int:
        return 0

    def values(self, text: str):
        """The JSON value the output holds (None where it does not parse: cut by max_tokens, say)."""
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return None


class NamedToolCall(ForcedToolCalls):
    """The output is the named function's arguments; OpenAI ends such a choice with "stop", not "tool_calls"."""

    finish_reason = "stop"

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        arguments = self.values(text)
        return (None, [ToolCall(self.name, arguments)]) if isinstance(arguments, dict) else (text, [])


class NamedCallStream:
    """A named function's arguments streamed as they come, as OpenAI streams a forced call: the first delta holds
    the call's id, type and name, each later one a piece of its arguments (blanks before them dropped: after a
    thinking model's reasoning the constrained output may start with a line break)."""

    def __init__(self, parser: NamedToolCall):
        self.parser, self.started, self.leading = parser, False, True

    def feed(self, piece: str) -> list[dict]:
        """The ``tool_calls`` entries of the chunk that carries ``piece`` of the arguments (none for no piece)."""
        if self.leading:
            piece = piece.lstrip()
            self.leading = not piece
        if not self.started:
            self.started = True
            call = ToolCall(self.parser.name, {}).api(0)
            return [{**call, "function": {"name": self.parser.name, "arguments": piece}}]
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []


class RequiredToolCalls(ForcedToolCalls):
    """The output is a JSON list of {"name": ..., "parameters": {...}}, one call each."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        values = self.values(text)
        calls = [_call(v) for v in values] if isinstance(values, list) else []
        return (None, calls) if calls and None not in calls else (text, [])


DEFINITION_KEYS = ("$defs", "definitions")  # where a schema keeps what its "$ref"s name


def tool_parameters(tool: dict) -> dict:
    """A function tool's parameters schema (an object of no properties where it gives none, as vLLM takes it)."""
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def forced_call_schema(tools: list[dict], choice, parallel: bool = True) -> tuple[dict, ForcedToolCalls]:
    """The JSON schema a forced tool choice constrains the output to, and the parser of that output: ``choice``
    {"type": "function", "function": {"name": ...}} (the function's parameters) or "required" (a list of one call
    or more, of any of ``tools``; of one only when not ``parallel``, OpenAI's parallel_tool_calls false). The tools
    and the choice are checked by the caller."""
    if choice == "required":
        calls, shared = [], {}
        for tool in tools:
            parameters = dict(tool_parameters(tool))
            for key in DEFINITION_KEYS:  # references are to the root: the definitions go there
                for name, definition in (parameters.pop(key, None) or {}).items():
                    if shared.setdefault(key, {}).setdefault(name, definition) != definition:
                        raise ValueError(f"two tools define '{name}' in their {key} differently: rename one")
            calls.append({"type": "object", "properties": {"name": {"type": "string",
                                                                    "enum": [tool["function"]["name"]]},
                                                           "parameters": parameters},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}, **shared}
        return (schema if parallel else {**schema, "maxItems": 1}), RequiredToolCalls()
    name = choice["function"]["name"]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return tool_parameters(tool), NamedToolCall(name)


class FirstCallOnly:
    """A parser whose replies keep their first call only (OpenAI's ``parallel_tool_calls: false``)."""

    def __init__(self, parser):
        self.parser = parser

    def __getattr__(self, name):
        return getattr(self.parser, name)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.parser.parse(text)
        return content, calls[:1]


class ToolCallStream:
    """A streamed reply's text through a parser: ``feed`` returns what may be sent now (the text before any
    possible start of a call), ``finish`` the rest as (text, calls)."""

    def __init__(self, parser):
        self.parser, self.text, self.sent = parser, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        start = max(self.parser.held_from(self.text, self.sent), self.sent)
        out, self.sent = self.text[self.sent:start], start
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the text not sent yet, the calls): the calls when the held text parses as calls, else all as text."""
        _, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        first = self.parser.first(self.text)
        return (self.text[self.sent:first].rstrip() if first > self.sent else ""), calls
