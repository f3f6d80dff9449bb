"""Tool calls in a model's output, as the OpenAI API returns them (``vkformers serve --enable-auto-tool-choice
--tool-call-parser NAME``, vLLM's options).

A chat request's ``tools`` go to the chat template, which tells the model how to call them; the model then writes
its calls in its own format, which a parser turns into the API's ``tool_calls``. ``hermes`` is the format of Hermes,
Qwen 2.5 and Qwen 3 templates: each call a JSON object {"name": ..., "arguments": {...}} between ``<tool_call>`` and
``</tool_call>``, after any text. Output whose calls do not parse stays text, as vLLM leaves it.

While a reply streams, :class:`ToolCallStream` holds back the text from where a call may begin (the start tag, or
what may be its first characters), so the calls never reach the client as text; the calls come whole at the end.
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


class HermesToolCalls:
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
                value = json.loads(body.strip())
            except json.JSONDecodeError:
                return text, []
            arguments = value.get("arguments", value.get("parameters", {})) if isinstance(value, dict) else None
            if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments,
                                                                                                      dict):
                return text, []
            calls.append(ToolCall(value["name"], arguments))
        content = text[:first].strip()
        return (content or None), calls


TOOL_CALL_PARSERS = {"hermes": HermesToolCalls}


class ToolCallStream:
    """A streamed reply's text through a parser: ``feed`` returns what may be sent now (the text before any
    possible start of a call), ``finish`` the rest as (text, calls)."""

    def __init__(self, parser):
        self.parser, self.text, self.sent = parser, "", 0

    def feed(self, piece: str) -> str:
        self.text += piece
        start = self.text.find(self.parser.start, self.sent)
        if start < 0:  # hold back a tail that may be the start tag's beginning
            start = len(self.text)
            for keep in range(min(len(self.parser.start) - 1, len(self.text) - self.sent), 0, -1):
                if self.parser.start.startswith(self.text[-keep:]):
                    start = len(self.text) - keep
                    break
        out, self.sent = self.text[self.sent:start], max(self.sent, start)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the text not sent yet, the calls): the calls when the held text parses as calls, else all as text."""
        _, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        first = self.text.find(self.parser.start)
        return (self.text[self.sent:first].rstrip() if first > self.sent else ""), calls
