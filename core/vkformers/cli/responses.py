"""OpenAI's Responses API on ``vkformers serve`` (``POST /v1/responses``): a request translated into the chat
completions request it amounts to, which the chat route's machinery runs (chat template, sampling settings, tool
calls, structured outputs), and that output translated back into a response object or its typed server-sent events.

- ``input`` (a string: one user message; or input items: messages of role user, system, developer or assistant
  with text content, and earlier ``function_call`` and ``function_call_output`` items) becomes chat messages: a
  function call joins the assistant message before it as one of its ``tool_calls``, a call's output is a ``tool``
  message. ``instructions`` is a system message before them.
- ``previous_response_id`` continues a response this server stored (:class:`ResponseStore`): its conversation,
  input and output, comes before the new input; its instructions do not, as OpenAI's do not.
- Function ``tools`` (Responses' flat shape) reach the chat template in chat's nested shape; ``text.format``
  becomes ``response_format``; ``max_output_tokens`` ``max_completion_tokens``; ``include:
  ["message.output_text.logprobs"]`` (with ``top_logprobs``) asks for log-probabilities.
- The output is a ``message`` item of ``output_text`` (none where the reply is tool calls and no text), then a
  ``function_call`` item per call; a reply cut by its token limit is ``incomplete`` (reason max_output_tokens).
  Where the server reads a thinking model's reasoning (--reasoning-parser), a ``reasoning`` item of
  ``reasoning_text`` comes first (and alone where the reply ended inside its thinking); earlier reasoning items in
  ``input`` become the reasoning of the assistant turn they belong to.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

from vkformers.cli.api_schema import ApiError, flag_field, number_field
from vkformers.models.tool_calls import ToolCall

RESPONSES_KEPT = 1024  # responses a server keeps for previous_response_id and GET /v1/responses/{id}
MAX_METADATA = 16      # OpenAI's bound on a request's metadata pairs
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# content part types read as text, and the field holding it (an assistant's earlier output comes back as output_text)
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
# fields a Responses request shares with chat completions (vLLM's sampling extras among them)
SHARED_FIELDS = ("model", "temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "logit_bias", "stop", "stop_token_ids", "ignore_eos", "tool_choice", "parallel_tool_calls",
                 "repetition_penalty", "min_tokens", "allowed_token_ids", "include_stop_str_in_output",
                 "chat_template_kwargs")
# the chat request's fields that an error may name, as the Responses request names them
RESPONSES_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- requests

def stores(body: dict) -> bool:
    """Whether the response is kept for previous_response_id (``store``, true by default as OpenAI's)."""
    return flag_field(body, "store", True)


def conversation(body: dict, history: list[dict]) -> list[dict]:
    """The chat messages of a request's ``input``, after ``history`` (those of the response it continues)."""
    value = body.get("input")
    if isinstance(value, str):
        return history + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty list of input items", param="input")
    return history + chat_messages(value)


def chat_messages(items: list) -> list[dict]:
    """Input items, or a response's output items, as chat messages: a message's text parts joined; a reasoning
    item's text the ``reasoning_content`` of the assistant message after it; a function call one of the
    ``tool_calls`` of the assistant message before it (or of an assistant message of its own); a call's output a
    ``tool`` message."""
    messages = []
    for item in items:
        if not isinstance(item, dict):
            raise ApiError(400, "each input item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item)
            last = messages[-1] if messages else {}
            if message["role"] == "assistant" and last.get("role") == "assistant" and last["content"] is None \
                    and "tool_calls" not in last:  # the answer after its reasoning
                last["content"] = message["content"]
            else:
                messages.append(message)
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": None, "reasoning_content": _reasoning_text(item)})
        elif kind == "function_call":
            call = _tool_call(item)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id"),
                             "content": _text(item.get("output"), "a function_call_output item's 'output'")})
        else:
            raise ApiError(400, f"input items of type {kind!r} are not supported: give messages, reasoning, "
                                "function_call and function_call_output items", param="input")
    return messages


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text parts (a summary alone is no reasoning to give back)."""
    content = item.get("content") or []
    if not isinstance(content, list) or not all(isinstance(part, dict) and isinstance(part.get("text"), str)
                                                for part in content):
        raise ApiError(400, "a reasoning item's 'content' must be a list of {'type': 'reasoning_text', 'text': ...}",
                       param="input")
    return "".join(part["text"] for part in content)


def _message(item: dict) -> dict:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise ApiError(400, f"a message's role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
                       param="input")
    return {"role": role, "content": _text(item.get("content"), "a message's 'content'")}


def _text(content, what: str) -> str:
    """A string, or the text of a list of text parts; parts of images, files or audio are refused."""
    if isinstance(content, list):
        return "".join(_part_text(part) for part in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{what} must be a string or a list of text parts", param="input")
    return content


def _part_text(part) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = TEXT_PARTS.get(kind)
    if key is None:
        raise ApiError(400, f"content parts of type {kind!r} are not supported: this server reads text (input_text "
                            "parts)", param="input")
    if not isinstance(part.get(key), str):
        raise ApiError(400, f"a content part of type {kind!r} needs its '{key}' as a string", param="input")
    return part[key]


def _text_field(item: dict, name: str) -> str:
    if not isinstance(item.get(name), str):
        raise ApiError(400, f"a {item.get('type')} item needs '{name}' as a string", param="input")
    return item[name]


def _tool_call(item: dict) -> dict:
    """A function_call item as a chat message's tool call (its arguments the JSON text they are)."""
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise ApiError(400, "a function_call item's 'arguments' must be a string of JSON", param="input")
    return {"id": _text_field(item, "call_id"), "type": "function",
            "function": {"name": _text_field(item, "name"), "arguments": arguments}}


def chat_tools(body: dict) -> list[dict] | None:
    """The request's function tools in chat's shape; any other kind of tool (OpenAI's built-in ones) is refused."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of tool objects", param="tools")
    chat = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(400, f"tools of type {kind!r} are not supported: this server calls function tools only "
                                "(OpenAI's built-in tools, such as web_search, file_search or computer use, run on "
                                "its own servers)", param="tools")
        if not isinstance(tool.get("name"), str):
            raise ApiError(400, "a function tool needs a 'name'", param="tools")
        chat.append({"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters",
                                                                                 "strict") if key in tool}})
    return chat


def response_format(body: dict) -> dict | None:
    """``text.format`` as chat's response_format (None for text)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(400, "'text' must be an object such as {\"format\": {\"type\": \"json_schema\", ...}}",
                       param="text")
    form = text.get("format")
    kind = form.get("type") if isinstance(form, dict) else form
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ApiError(400, f"'text.format' of type {kind!r} is not supported: give text, json_object or json_schema",
                       param="text.format")
    if not isinstance(form.get("schema"), dict):
        raise ApiError(400, "'text.format' of type json_schema needs 'schema': a JSON schema object (and 'name', "
                            "'strict')", param="text.format")
    if form.get("strict") is not None and not isinstance(form["strict"], bool):
        raise ApiError(400, f"'text.format.strict' must be true or false, got {form['strict']!r}", param="text.format")
    return {"type": "json_schema", "json_schema": {key: form[key] for key in ("name", "description", "schema", "strict")
                                                   if key in form}}


def wants_logprobs(body: dict) -> bool:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(name, str) for name in include):
        raise ApiError(400, "'include' must be a list of strings", param="include")
    return LOGPROBS_INCLUDE in include


def refuse_unsupported(body: dict) -> None:
    """A 400 for what this server would otherwise ignore and answer wrongly."""
    if body.get("background"):
        raise ApiError(400, "background responses are not supported: leave 'background' out and wait for the "
                            "response, or stream it", param="background")
    if body.get("conversation") is not None:
        raise ApiError(400, "conversations are not supported: continue a response with 'previous_response_id', or "
                            "send the whole conversation as 'input'", param="conversation")
    if body.get("prompt") is not None:
        raise ApiError(400, "prompt templates are not supported: send the 'input' and 'instructions' themselves",
                       param="prompt")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", param="instructions")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise ApiError(400, f"'metadata' must be an object of at most {MAX_METADATA} string values", param="metadata")


def chat_request(body: dict, messages: list[dict]) -> dict:
    """The chat completions request a Responses request amounts to: ``messages`` (its conversation) after its
    instructions as a system message, its function tools in chat's shape, ``text.format`` as response_format,
    ``max_output_tokens`` as max_completion_tokens, logprobs where ``include`` asks, and the fields both share."""
    refuse_unsupported(body)
    chat = {key: body[key] for key in SHARED_FIELDS if body.get(key) is not None}
    instructions = body.get("instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + messages
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}  # chat's shape
    form = response_format(body)
    if form is not None:
        chat["response_format"] = form
    limit = number_field(body, "max_output_tokens", None, int, low=1)
    if limit is not None:
        chat["max_completion_tokens"] = limit
    top = number_field(body, "top_logprobs", 0, int, 0, 20)
    if wants_logprobs(body):
        chat.update(logprobs=True, top_logprobs=top)
    return chat


def renamed(error: ApiError) -> ApiError:
    """An error of the chat machinery, naming the field as the Responses request names it."""
    error.param = RESPONSES_PARAMS.get(error.param, error.param)
    return error


# ---------------------------------------------------------------- responses

def response_head(body: dict, params, model: str, store: bool) -> dict:
    """A response object before its output: the request's settings echoed (temperature and top_p as it runs with
    them, ``params``: its SamplingParams)."""
    text = body.get("text") or {}
    return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
            "metadata": body.get("metadata") or {}, "model": model, "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"), "reasoning": None, "store": store,
            "temperature": params.temperature, "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_logprobs": body.get("top_logprobs") or 0, "top_p": params.top_p,
            "truncation": body.get("truncation") or "disabled", "usage": None, "user": body.get("user")}


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def finished(head: dict, output: list[dict], finish_reason: str, input_tokens: int, output_tokens: int,
             reasoning_tokens: int = 0) -> dict:
    """The response once its output is whole: completed, or incomplete where the token limit cut it."""
    cut = finish_reason == "length"
    usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
             "total_tokens": input_tokens + output_tokens}
    return {**head, "status": item_status(finish_reason), "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "usage": usage}


def message_item(text: str, logprobs: list, status: str, ident: str | None = None) -> dict:
    return {"id": ident or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def reasoning_item(text: str, status: str, ident: str | None = None) -> dict:
    """A reasoning item as OpenAI's Responses give a model's raw reasoning (no summary of it here)."""
    return {"id": ident or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def function_call_item(call: ToolCall) -> dict:
    api = call.api()
    return {"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": api["id"],
            "name": call.name, "arguments": api["function"]["arguments"]}


def output_items(text: str | None, calls: list[ToolCall], logprobs: list, finish_reason: str,
                 reasoning: str | None = None) -> list[dict]:
    """A whole reply's output items: its reasoning, where it has some, as a reasoning item (incomplete where the
    token limit cut the reply inside it); its text as a message (none where the reply is reasoning or calls and no
    text); then a function_call item per call."""
    answered = bool(text or calls)
    thought = [reasoning_item(reasoning, "completed" if answered else item_status(finish_reason))] \
        if reasoning else []
    message = [] if (calls or reasoning) and not text else [message_item(text or "", logprobs,
                                                                          item_status(finish_reason))]
    return thought + message + [function_call_item(call) for call in calls]


class ResponseEvents:
    """The server-sent events of a streamed response, in OpenAI's order, each numbered: response.created and
    response.in_progress; the reasoning item where the reply has reasoning, its reasoning_text deltas and its
    closing events (once the answer starts); the message item, opened at the reply's first text that is not blank
    (blank text before tool calls is dropped, as a whole response drops it), its text deltas, and its closing
    events; a function call item per call as it comes (the ``tool_calls`` deltas of ToolCallStream's incremental
    mode): opened with its name and call id, its arguments in deltas as they come, closed once the next item opens
    or the reply ends; response.completed, or response.incomplete where the token limit cut the reply
    (response.failed where the batch failed). One item is open at a time: each is numbered as it opens."""

    def __init__(self, head: dict):
        self.head, self.sequence, self.output = head, 0, []
        self.thinking: dict | None = None  # the reasoning item while it is open
        self.reasoning, self.thought = "", False  # its text so far; whether the reply had a reasoning item
        self.message: dict | None = None  # the message item while it is open
        self.text, self.logprobs = "", []  # its text and log-probabilities sent so far
        self.unsent, self.unsent_logprobs = "", []
        self.call: dict | None = None  # the function call item while it is open
        self.called = False  # whether the reply had a function call item
        self.response: dict | None = None  # the whole response, once finished

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> str:
        return self.event("response.created", response=self.head) + \
            self.event("response.in_progress", response=self.head)

    def add_reasoning(self, text: str) -> str:
        """The events of a piece of the reply's reasoning (the reasoning item opened at the first)."""
        if not text:
            return ""
        events = ""
        if self.thinking is None:
            self.thinking, self.thought = reasoning_item("", "in_progress"), True
            index = len(self.output)
            events = self.event("response.output_item.added", output_index=index,
                                item={**self.thinking, "content": []}) + \
                self.event("response.content_part.added", item_id=self.thinking["id"], output_index=index,
                           content_index=0, part={"type": "reasoning_text", "text": ""})
        self.reasoning += text
        return events + self.event("response.reasoning_text.delta", item_id=self.thinking["id"],
                                   output_index=len(self.output), content_index=0, delta=text)

    def _close_reasoning(self, status: str) -> str:
        if self.thinking is None:
            return ""
        item = reasoning_item(self.reasoning, status, self.thinking["id"])
        part, index = item["content"][0], len(self.output)
        self.output.append(item)
        self.thinking = None
        return self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=self.reasoning) + \
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=part) + \
            self.event("response.output_item.done", output_index=index, item=item)

    def add_text(self, text: str, logprobs: list) -> str:
        self.unsent += text
        self.unsent_logprobs += logprobs
        if not self.unsent or (self.message is None and not self.unsent.strip()):
            return ""
        events = self._open() if self.message is None else ""
        return events + self._send()

    def add_calls(self, deltas: list[dict]) -> str:
        """The events of ``tool_calls`` deltas (models/tool_calls.py CallDeltas): one with an id opens its call's
        item (closing the item open before it), each carries the next piece of the open call's arguments."""
        events = ""
        for delta in deltas:
            if "id" in delta:
                events += self._close_reasoning("completed") + self._close_call()
                if self.message is not None:
                    events += self._close("completed")
                self.unsent, self.unsent_logprobs = "", []  # (blank text before the call: dropped)
                self.call, self.called = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                          "call_id": delta["id"], "name": delta["function"]["name"],
                                          "arguments": ""}, True
                events += self.event("response.output_item.added", output_index=len(self.output), item=self.call)
            piece = delta["function"]["arguments"]  # (of the open call: a call is whole before the next opens)
            if piece:
                self.call = {**self.call, "arguments": self.call["arguments"] + piece}
                events += self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                                     output_index=len(self.output), delta=piece)
        return events

    def _close_call(self) -> str:
        if self.call is None:
            return ""
        item, index = {**self.call, "status": "completed"}, len(self.output)
        self.output.append(item)
        self.call = None
        return self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]) + \
            self.event("response.output_item.done", output_index=index, item=item)

    def _open(self) -> str:
        # the answer starts: the reasoning is whole (and text after calls follows the last)
        events = self._close_reasoning("completed") + self._close_call()
        self.message = message_item("", [], "in_progress")
        index = len(self.output)
        return events + \
            self.event("response.output_item.added", output_index=index, item={**self.message, "content": []}) + \
            self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                       content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _send(self) -> str:
        text, logprobs = self.unsent, self.unsent_logprobs
        self.unsent, self.unsent_logprobs = "", []
        self.text += text
        self.logprobs += logprobs
        return self.event("response.output_text.delta", item_id=self.message["id"], output_index=len(self.output),
                          content_index=0, delta=text, logprobs=logprobs)

    def finish(self, finish_reason: str, input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> str:
        """The events that end the response (which ``self.response`` then holds); a call item still open closes
        whole, as a whole response gives it, the response's status telling where the token limit cut it."""
        answered = bool(self.called or self.unsent) or self.message is not None
        events = self._close_reasoning("completed" if answered else item_status(finish_reason))
        if self.message is None and not self.called and (self.unsent or not self.thought):
            events += self._open()  # a reply of no text, or blank text only: a message all the same
        if self.message is not None:
            if self.unsent:
                events += self._send()
            self.logprobs += self.unsent_logprobs  # (of tokens whose text was held back, a stop string's)
            events += self._close(item_status(finish_reason))
        events += self._close_call()
        self.response = finished(self.head, self.output, finish_reason, input_tokens, output_tokens, reasoning_tokens)
        last = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return events + self.event(last, response=self.response)

    def _close(self, status: str) -> str:
        item = message_item(self.text, self.logprobs, status, self.message["id"])
        part, index = item["content"][0], len(self.output)
        self.output.append(item)
        self.message = None
        return self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=self.text, logprobs=self.logprobs) + \
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=part) + \
            self.event("response.output_item.done", output_index=index, item=item)

    def fail(self, message: str) -> str:
        response = {**self.head, "status": "failed", "output": self.output,
                    "error": {"code": "server_error", "message": message}}
        return self.event("response.failed", response=response)


class ResponseStore:
    """The responses a server gave with ``store`` on (OpenAI's default), each with its conversation (the chat
    messages of its input, earlier turns included, and of its output): what ``previous_response_id`` continues and
    GET /v1/responses/{id} answers. In memory, at most ``size``; the one least recently stored or continued goes
    first. Used from the event loop's thread only."""

    def __init__(self, size: int = RESPONSES_KEPT):
        self.size = size
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def keep(self, response: dict, messages: list[dict]) -> None:
        """``response``, whose conversation up to its output is ``messages``."""
        self.entries[response["id"]] = (response, messages + chat_messages(response["output"]))
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def history(self, body: dict) -> list[dict]:
        """The conversation a request's ``previous_response_id`` continues ([] without one)."""
        ident = body.get("previous_response_id")
        if ident is None:
            return []
        if not isinstance(ident, str):
            raise ApiError(400, "'previous_response_id' must be a string", param="previous_response_id")
        if ident not in self.entries:
            raise ApiError(400, f"previous response with id {ident!r} not found: it was not stored (store false), was "
                                f"deleted, or was dropped (this server keeps the last {self.size}); send the whole "
                                "conversation as 'input'", param="previous_response_id",
                           code="previous_response_not_found")
        self.entries.move_to_end(ident)
        return list(self.entries[ident][1])

    def get(self, ident: str) -> dict:
        if ident not in self.entries:
            raise self.missing(ident)
        return self.entries[ident][0]

    def delete(self, ident: str) -> None:
        if self.entries.pop(ident, None) is None:
            raise self.missing(ident)

    def missing(self, ident: str) -> ApiError:
        return ApiError(404, f"no response with id {ident!r} is stored here (one given with store false, deleted, or "
                             f"older than the last {self.size})", param="response_id", code="response_not_found")
