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
back the text from where a call may begin (``held_from``), so the calls never reach the client as text; each call
then streams as vLLM streams it: its id, type and name once the name is whole, then its arguments in pieces as they
come (:class:`JsonStream` writes them as ``json.dumps`` does, so the pieces join to the whole reply's arguments).

A ``tool_choice`` that forces a call needs no parser and no call format of the model's: the output is constrained
(models/structured_output.py) to the JSON schema :func:`forced_call_schema` gives, as vLLM and OpenAI do. A named
function's output is its arguments (:class:`NamedToolCall`; streamed as they come, :class:`NamedCallStream`);
``"required"`` makes it a JSON list of one or more {"name": ..., "parameters": {...}} (:class:`RequiredToolCalls`;
streamed each as it comes, as a parser's calls are).
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
        call = {"id": new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(value) -> ToolCall | None:
    """A {"name": ..., "arguments" or "parameters": {...}} object as a call, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


_BLANKS = " \t\n\r"


def _skip_blanks(text: str, at: int) -> int:
    while at < len(text) and text[at] in _BLANKS:
        at += 1
    return at


def _object_at(text: str, at: int) -> int | None:
    """``at`` past blanks where a JSON object opens there, None where the text ends first, -1 where something else
    comes."""
    at = _skip_blanks(text, at)
    return None if at == len(text) else at if text[at] == "{" else -1


def _listed_call_at(text: str, at: int, index: int) -> int | None:
    """Where call ``index`` of a JSON list of calls opens (the first: after ``[``, or a lone object; the next: after
    ``,``), reading from ``at`` (after the list's start, or the call before); None: not known yet; -1: none."""
    at = _skip_blanks(text, at)
    if at == len(text):
        return None
    if index == 0:
        return _object_at(text, at + 1) if text[at] == "[" else at if text[at] == "{" else -1
    return _object_at(text, at + 1) if text[at] == "," else -1


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

    def call_at(self, text: str, at: int, index: int) -> int | None:
        """Where call ``index``'s JSON object opens, searching from ``at`` (0, or the end of the call before): None
        while that is not known yet, -1 where no call can open there."""
        found = text.find(self.start, at)
        return None if found < 0 else _object_at(text, found + len(self.start))

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

    def call_at(self, text: str, at: int, index: int) -> int | None:
        if index == 0:
            found = text.find(self.start)
            return None if found < 0 else _listed_call_at(text, found + len(self.start), 0)
        return _listed_call_at(text, at, index)

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

    def call_at(self, text: str, at: int, index: int) -> int | None:
        at = _skip_blanks(text, at)
        if index == 0:
            if self.tag.startswith(text[at:]):
                return None
            return _object_at(text, at + len(self.tag)) if text.startswith(self.tag, at) else _object_at(text, at)
        while at < len(text) and text[at] == ";":
            at += 1
        return _object_at(text, at)

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
    """Output constrained to calls (tool_choice "required" or a named function): none of it streams as text; the
    calls are read as they come (``call_at``) or at its end. ``finish_reason``: the choice's finish reason when the
    calls parse."""

    finish_reason = "tool_calls"

    def held_from(self, text: str, sent: int) -> int:
        return sent

    def first(self, text: str) -> int:
        return 0

    def call_at(self, text: str, at: int, index: int) -> int | None:
        return -1  # (a named function's arguments stream through NamedCallStream)

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


class CallDeltas:
    """The ``tool_calls`` deltas of one streamed call, as OpenAI and vLLM stream it: the first holds the call's id,
    type, name and its arguments so far, each later one the next piece of its arguments."""

    def __init__(self, index: int):
        self.index, self.id, self.arguments = index, None, ""

    def next(self, name: str, arguments: str) -> list[dict]:
        """The deltas that bring the client from what went out to ``arguments`` (which go on from it)."""
        piece, self.arguments = arguments[len(self.arguments):], arguments
        if self.id is None:
            self.id = new_call_id()
            return [{"index": self.index, "id": self.id, "type": "function",
                     "function": {"name": name, "arguments": piece}}]
        return [{"index": self.index, "function": {"arguments": piece}}] if piece else []


class NamedCallStream:
    """A named function's arguments streamed as they come, as OpenAI streams a forced call: the first delta holds
    the call's id, type and name, each later one a piece of its arguments, written as the whole reply's are."""

    def __init__(self, parser: NamedToolCall):
        self.parser, self.json, self.deltas = parser, JsonStream(), CallDeltas(0)

    def feed(self, piece: str) -> list[dict]:
        """The ``tool_calls`` entries of the chunk that carries ``piece`` of the arguments."""
        self.json.feed(piece)
        return self.deltas.next(self.parser.name, self.json.shown)


class RequiredToolCalls(ForcedToolCalls):
    """The output is a JSON list of {"name": ..., "parameters": {...}}, one call each, which streams as an auto
    call does: each as it comes (ToolCallStream)."""

    def call_at(self, text: str, at: int, index: int) -> int | None:
        return _listed_call_at(text, at, index)

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

    most_calls = 1

    def __init__(self, parser):
        self.parser = parser

    def __getattr__(self, name):
        return getattr(self.parser, name)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.parser.parse(text)
        return content, calls[:1]


class ToolCallStream:
    """A streamed reply's text through a parser: ``feed`` returns what may be sent now, as (the text before any
    possible start of a call, ``tool_calls`` deltas), ``finish`` the rest. With ``incremental`` each call streams
    as it comes (:class:`StreamedCall`); else the calls come whole at the end."""

    def __init__(self, parser, incremental: bool = False):
        self.parser, self.text, self.sent, self.incremental = parser, "", 0, incremental
        self.calls: list[StreamedCall] = []
        self.stopped = False  # no (further) call can stream: what is left is settled at the end
        self.most = getattr(parser, "most_calls", None)

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        out = ""
        if not self.calls:
            start = max(self.parser.held_from(self.text, self.sent), self.sent)
            out, self.sent = self.text[self.sent:start], start
        return out, (self._advance() if self.incremental else [])

    def _advance(self) -> list[dict]:
        deltas = []
        while not self.stopped:
            call = self.calls[-1] if self.calls else None
            if call is None or call.json.done:
                opens = self.parser.call_at(self.text, call.end if call else 0, len(self.calls))
                if opens is None or opens < 0:
                    self.stopped = opens is not None
                    break
                call = StreamedCall(len(self.calls), opens)
                self.calls.append(call)
            call.read(self.text)
            self.stopped = call.json.broken
            if self.most is None or call.deltas.index < self.most:
                deltas += call.next()
            if not call.json.done:
                break
        return deltas

    def finish(self) -> tuple[str, list, bool]:
        """(the text not sent yet, the calls, whether the reply ends in calls). Whole: the calls (ToolCall) when
        the held text parses as calls, else all of it text. Incremental: the last ``tool_calls`` deltas; a reply
        whose calls went out in part but end up not parsing keeps them, the text after the last whole one text."""
        _, calls = self.parser.parse(self.text)
        started = [call for call in self.calls if call.deltas.id is not None][:self.most]
        if not started:
            if not calls:
                return self.text[self.sent:], [], False
            first = self.parser.first(self.text)
            rest = self.text[self.sent:first].rstrip() if first > self.sent else ""
            return rest, ([call.api(i) for i, call in enumerate(calls)] if self.incremental else calls), True
        finals = [json.dumps(call.arguments, ensure_ascii=False) for call in calls]
        if len(calls) >= len(started) and all(
                streamed.name == call.name and final.startswith(streamed.deltas.arguments)
                for streamed, call, final in zip(started, calls, finals)):
            deltas = [d for streamed, call, final in zip(started, calls, finals)
                      for d in streamed.deltas.next(call.name, final)]
            return "", deltas + [call.api(i) for i, call in enumerate(calls) if i >= len(started)], True
        kept = max((call.end for call in started if call.json.done), default=self.sent)
        return self.text[kept:], [], True


class StreamedCall:
    """One call of a streamed reply, its JSON object read from ``start`` as the text comes: once its name is whole
    its deltas (CallDeltas) carry its arguments as far as they are known."""

    def __init__(self, index: int, start: int):
        self.json, self.deltas, self.end, self.name, self.key = JsonStream(), CallDeltas(index), start, None, None

    def read(self, text: str) -> None:
        self.end += self.json.feed(text[self.end:])

    def next(self) -> list[dict]:
        fields = self.json.fields
        if self.json.broken or "name" not in self.json.complete:
            return []
        self.name = json.loads(fields["name"])
        if not isinstance(self.name, str):
            return []
        self.key = self.key or next((key for key in ("arguments", "parameters") if key in fields), None)
        arguments = fields[self.key] if self.key else "{}" if self.json.done else ""
        if arguments and arguments[0] != "{":  # not a call: the end says so
            return []
        return self.deltas.next(self.name, arguments)


def _encoded(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]  # (character by character: pieces join)


class JsonStream:
    """One JSON value's text fed in pieces, given back (``shown``) as ``json.dumps(json.loads(text),
    ensure_ascii=False)`` writes it, as far as the text so far fixes it; a string's characters as they come, a
    number or literal once it ends. ``fields``: that of each value of a top-level object's keys, ``complete`` the
    keys whose value has ended. ``broken`` once the text is no JSON (a repeated top-level key counts)."""

    def __init__(self):
        self.shown, self.fields, self.complete = "", {}, set()
        self.done = self.broken = False
        self._stack, self._expect = [], "value"
        self._raw = None  # a string's text so far, while one is read
        self._is_key, self._safe, self._escape, self._given = False, 0, 0, 0
        self._scalar = None  # a number's or literal's text so far
        self._key = self._field = None  # the top-level key last read; the one whose value is being read

    def feed(self, piece: str) -> int:
        """Reads ``piece``; returns how much of it belongs to the value (all but what follows its end)."""
        for at, char in enumerate(piece):
            try:
                if self.done or self.broken or not self._read(char):
                    return at
            except ValueError:
                self.broken = True
                return at
        if self._raw is not None:
            try:
                self._show_string()
            except ValueError:
                self.broken = True
        return len(piece)

    def _show(self, text: str) -> None:
        self.shown += text
        if self._field is not None:
            self.fields[self._field] += text

    def _show_string(self) -> None:
        text = json.loads('"' + self._raw[:self._safe] + '"')
        if text and "\ud800" <= text[-1] <= "\udbff":  # half of a pair whose other half may follow
            text = text[:-1]
        self._show(_encoded(text[self._given:]))
        self._given = len(text)

    def _ended(self) -> None:
        if not self._stack:
            self.done = True
        elif len(self._stack) == 1 and self._field is not None:
            self.complete.add(self._field)
            self._field = None
        if self._stack:
            self._expect = "comma"

    def _read(self, char: str) -> bool:
        """Reads ``char``: False where the value ended before it."""
        if self._raw is not None:
            self._read_string(char)
            return True
        if self._scalar is not None:
            if char.isalnum() or char in "+-.":
                self._scalar += char
                return True
            self._show(json.dumps(json.loads(self._scalar)))
            self._scalar = None
            self._ended()
            if self.done:
                return False
        if char in _BLANKS:
            return True
        expect = self._expect
        if expect in ("value", "item") and char in "{[":
            self._show(char)
            self._stack.append(char)
            self._expect = "member" if char == "{" else "item"
        elif expect in ("value", "item") and char != '"' and (char.isalnum() or char == "-"):
            self._scalar = char
        elif char == '"' and expect in ("value", "item", "key", "member"):
            self._raw, self._is_key, self._safe, self._escape, self._given = "", expect in ("key", "member"), 0, 0, 0
            self._show('"')
        elif char in "}]" and (expect, char) in (("member", "}"), ("item", "]"), ("comma", self._closer())):
            self._show(char)
            self._stack.pop()
            self._ended()
        elif expect == "colon" and char == ":":
            self._show(": ")
            if len(self._stack) == 1:
                if self._key in self.fields:
                    raise ValueError(f"the key {self._key!r} comes twice")
                self._field, self.fields[self._key] = self._key, ""
            self._expect = "value"
        elif expect == "comma" and char == ",":
            self._show(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        else:
            raise ValueError(f"{char!r} where JSON has none")
        return True

    def _closer(self) -> str:
        return {"{": "}", "[": "]"}[self._stack[-1]] if self._stack else ""

    def _read_string(self, char: str) -> None:
        if self._escape == -1:  # the letter after a backslash
            self._escape = 4 if char == "u" else 0
        elif self._escape:
            self._escape -= 1
        elif char == "\\":
            self._escape = -1
        elif char == '"':
            text = json.loads('"' + self._raw + '"')
            self._raw = None
            self._show(_encoded(text[self._given:]) + '"')
            if self._is_key:
                self._key = text if len(self._stack) == 1 else self._key
                self._expect = "colon"
            else:
                self._ended()
            return
        self._raw += char
        if not self._escape:
            self._safe = len(self._raw)
