"""The prompts of completions and chat completions requests as token ids: a completion's text or token ids (one
prompt or a batch; with a ``suffix``, a fill-in-the-middle prompt: models/fill_in_middle.py), a chat's messages (and
tools) rendered by the model's chat template with the request's ``chat_template_kwargs``.
"""
from __future__ import annotations

import json

import numpy as np

from vkformers.cli import generate as cli_generate
from vkformers.cli.api_schema import ApiError
from vkformers.cli.options import template_variables_problem
from vkformers.errors import VkformersError
from vkformers.models.fill_in_middle import FillInMiddleTokens, fill_in_middle_prompt, no_fill_in_middle_tokens

# the roles a chat message may take, as the chat template gets them (OpenAI's "developer" is the system prompt)
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def completion_prompts(body: dict, tokenizer, fill_in_middle: FillInMiddleTokens | None = None) -> list[list[int]]:
    """A completions request's prompts as token ids: a string or a list of token ids is one prompt; a list of
    strings or of token id lists is a batch (OpenAI's), whose choices come prompt by prompt, ``n`` each. With a
    ``suffix`` each prompt is a string, the code before the cursor, laid out with the suffix around the model's
    fill-in-the-middle tokens (``fill_in_middle``: the tokenizer's, None where it has none: a 400)."""
    suffix = completion_suffix(body)
    if suffix is None:
        return [completion_prompt(p, tokenizer) for p in _given_prompts(body)]
    if fill_in_middle is None:
        raise ApiError(400, f"{no_fill_in_middle_tokens()}; or leave 'suffix' out", param="suffix")
    prompts = _given_prompts(body)
    if not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "with a 'suffix', 'prompt' must be a string (the code before the cursor) or a list of "
                            "strings: token ids cannot be laid out around the fill-in-the-middle tokens",
                       param="prompt")
    return [fill_in_middle_prompt(tokenizer, p, suffix, fill_in_middle) for p in prompts]


def completion_suffix(body: dict) -> str | None:
    """A completions request's ``suffix``, the text after the one to generate (fill-in-the-middle); None where it
    gives none or an empty one (a plain completion)."""
    suffix = body.get("suffix")
    if suffix is None or suffix == "":
        return None
    if not isinstance(suffix, str):
        raise ApiError(400, f"'suffix' must be a string, got {type(suffix).__name__}", param="suffix")
    return suffix


def echoed_prompts(body: dict, tokenizer, prompts: list[list[int]]) -> list[str]:
    """The text echo gives back for each of ``prompts`` (completion_prompts'): a string prompt as sent, token ids
    decoded (special tokens kept), as vLLM echoes them."""
    return [given if isinstance(given, str) else tokenizer.decode(ids, skip_special_tokens=False)
            for given, ids in zip(_given_prompts(body), prompts)]


def _given_prompts(body: dict) -> list:
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    return prompt if batch else [prompt]


def completion_prompt(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="np")["input_ids"]
        return [int(t) for t in cli_generate.start_from_bos(tokenizer, ids)[0]]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of those (a batch)",
                   param="prompt")


def chat_prompt(body: dict, tokenizer, template_defaults: dict | None = None) -> list[int]:
    """A chat request's prompt as token ids (chat_text's, tokenized as apply_chat_template tokenizes it)."""
    return prompt_ids(tokenizer, chat_text(body, tokenizer, template_defaults))


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A rendered chat's token ids: its text already holds the template's special tokens, none is added."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="np")["input_ids"]
    return [int(t) for t in np.asarray(ids)[0]]


def chat_text(body: dict, tokenizer, template_defaults: dict | None = None, *, generation_prompt: bool = True) -> str:
    """A chat request's messages through the model's chat template, ending with the assistant's turn (none without
    ``generation_prompt``); its ``tools`` go to the template too (as vLLM passes them, also with tool_choice
    'none'), an assistant message's ``tool_calls`` with their arguments as objects and its reasoning (as
    ``reasoning_content``, which thinking models' templates read), a tool message with its ``tool_call_id``; its
    ``chat_template_kwargs`` (over ``template_defaults``) as further variables of the template, as vLLM passes
    them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    conversation = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message must be an object with a 'role'", param="messages")
        role = CHAT_ROLES.get(message["role"])
        if role is None:
            raise ApiError(400, f"a message's role must be one of {', '.join(CHAT_ROLES)}, got {message['role']!r}",
                           param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, "a message's 'content' must be a string or a list of text parts", param="messages")
        entry = {"role": role, "content": content or ""}
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
        if role == "assistant":  # vLLM's field and the one DeepSeek's API and vLLM's older versions named
            reasoning = next((message[key] for key in ("reasoning", "reasoning_content") if message.get(key)), None)
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise ApiError(400, "an assistant message's 'reasoning' must be a string", param="messages")
                entry["reasoning_content"] = reasoning
        if role == "tool" and message.get("tool_call_id") is not None:
            entry["tool_call_id"] = message["tool_call_id"]
        conversation.append(entry)
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "'tools' must be a list of tool objects", param="tools")
    variables = template_kwargs(body, template_defaults)
    try:
        return tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=generation_prompt,
                                             tokenize=False, **variables)
    except VkformersError as exc:  # no chat template, or one that fails on these messages
        raise ApiError(400, f"the chat template cannot render these messages: {exc} (vkformers serve --chat-template "
                            "gives one)", param="messages") from None


def template_kwargs(body: dict, defaults: dict | None = None) -> dict:
    """The variables a chat request gives its template (vLLM's chat_template_kwargs), over the server's
    ``defaults`` (--default-chat-template-kwargs)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return dict(defaults or {})
    problem = template_variables_problem(value)
    if problem is not None:
        raise ApiError(400, f"'chat_template_kwargs' {problem}", param="chat_template_kwargs")
    return {**(defaults or {}), **value}


def generation_prompt(body: dict, tokenizer, template_defaults: dict | None, text: str) -> str:
    """The text the chat template adds for the assistant's turn to ``text`` (chat_text's): what ``text`` holds past
    the conversation rendered without it; ``text`` whole where the template adds nothing there or renders the
    conversation otherwise."""
    try:
        bare = chat_text(body, tokenizer, template_defaults, generation_prompt=False)
    except ApiError:
        return text
    return (text[len(bare):] if text.startswith(bare) else "") or text


def _template_tool_call(call) -> dict:
    """An assistant message's tool call as chat templates read it: the function, its arguments an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "each tool call must hold a 'function' with a 'name'", param="messages")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ApiError(400, f"the arguments of the call to {function['name']!r} are not JSON",
                           param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
