"""The constraints a completions or chat completions request puts on its output, read into the grammar the output
keeps to (models/structured_output.py): OpenAI's ``response_format``, vLLM's guided decoding fields and
``structured_outputs`` object, and a ``tool_choice`` that forces a call (models/tool_calls.py).
"""
from __future__ import annotations

import json

from vkformers.cli.api_schema import ApiError
from vkformers.errors import VkformersError
from vkformers.models.structured_output import (ANY_OBJECT_SCHEMA, any_object_grammar, cfg_grammar, choice_grammar,
                                                 closed_objects, json_schema_grammar, regex_grammar)
from vkformers.models.tool_calls import ForcedToolCalls, forced_call_schema


def response_kind(body: dict) -> str:
    """The request's response_format type ("text" when it gives none)."""
    response_format = body.get("response_format")
    if response_format is None:
        return "text"
    return response_format.get("type") if isinstance(response_format, dict) else response_format


# vLLM's guided decoding request fields (before its 0.12) and the constraint each names; its newer
# "structured_outputs" object takes the constraints by these names, and the settings below
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_SETTINGS = ("whitespace_pattern", "disable_any_whitespace", "disable_additional_properties",
                       "disable_fallback")


def structured_outputs(body: dict) -> dict:
    """vLLM's ``structured_outputs`` object ({} when the request gives none), its keys checked."""
    value = body.get("structured_outputs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "'structured_outputs' must be an object such as {\"regex\": ...}",
                       param="structured_outputs")
    unknown = [key for key in value if key not in STRUCTURED_CONSTRAINTS + STRUCTURED_SETTINGS]
    if unknown:
        raise ApiError(400, f"'structured_outputs' does not take {', '.join(map(repr, unknown))}: it takes "
                            f"{', '.join(STRUCTURED_CONSTRAINTS + STRUCTURED_SETTINGS)}", param="structured_outputs")
    return value


def output_constraints(body: dict) -> list[tuple[str, str, object]]:
    """The constraints the request puts on its output, each (the parameter that gives it, its kind, its value):
    OpenAI's response_format (kind json_schema or json_object), vLLM's guided_* fields and structured_outputs."""
    found = []
    kind = response_kind(body)
    if kind != "text":
        found.append(("response_format", kind, body["response_format"]))
    found += [(name, kind, body[name]) for name, kind in GUIDED_FIELDS.items() if body.get(name) is not None]
    if body.get("structural_tag") is not None:
        found.append(("structural_tag", "structural_tag", body["structural_tag"]))
    structured = structured_outputs(body)
    found += [(f"structured_outputs.{key}", key, structured[key]) for key in STRUCTURED_CONSTRAINTS
              if structured.get(key) is not None and not (key == "json_object" and structured[key] is False)]
    return found


def json_settings(body: dict) -> dict:
    """vLLM's settings of JSON outputs (guided_whitespace_pattern, structured_outputs' whitespace_pattern,
    disable_any_whitespace and disable_additional_properties) as keyword arguments of json_schema_grammar, with
    ``closed`` for the last. disable_fallback and guided_decoding_backend are taken and do nothing: the one
    engine here has no fallback."""
    structured = structured_outputs(body)
    pattern = structured.get("whitespace_pattern")
    pattern = body.get("guided_whitespace_pattern") if pattern is None else pattern
    if pattern is not None and not isinstance(pattern, str):
        raise ApiError(400, f"the whitespace pattern must be a regex string, got {pattern!r}",
                       param="guided_whitespace_pattern")
    for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if not isinstance(structured.get(name) or False, bool):  # (null: false, as vLLM's defaults send it)
            raise ApiError(400, f"'structured_outputs.{name}' must be true or false", param="structured_outputs")
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise ApiError(400, "'guided_decoding_backend' must be a string (it is ignored: llguidance serves every "
                            "constraint here)", param="guided_decoding_backend")
    return {"whitespace_pattern": pattern, "compact": bool(structured.get("disable_any_whitespace")),
            "closed": bool(structured.get("disable_additional_properties"))}


def response_grammar(body: dict) -> str | None:
    """The grammar the output keeps to (models/structured_output.py), None for free text: OpenAI's response_format
    json_schema (the schema's, strict or not) or json_object (any JSON object), or vLLM's guided decoding: a JSON
    schema, a regex, a list of choices or a Lark or GBNF grammar, as guided_json, guided_regex, guided_choice and
    guided_grammar or the same keys of structured_outputs. More than one constraint is a 400 naming them."""
    constraints = output_constraints(body)
    settings = json_settings(body)
    if len(constraints) > 1:
        named = " and ".join(f"'{param}'" for param, _, _ in constraints)
        raise ApiError(400, f"{named} each constrain the output: give one", param=constraints[1][0])
    if not constraints:
        return None
    param, kind, value = constraints[0]
    closed = settings.pop("closed")
    try:
        if kind == "structural_tag":
            raise ApiError(400, f"'{param}' is not supported (no tags within free text): constrain the whole output "
                                "with json, regex, choice or grammar", param=param)
        if kind == "json_object":
            return any_object_grammar() if settings == {"whitespace_pattern": None, "compact": False} else \
                json_schema_grammar(ANY_OBJECT_SCHEMA, **settings)
        if kind == "json_schema":
            spec = value.get("json_schema") if isinstance(value, dict) else None
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ApiError(400, "'response_format' of type json_schema needs 'json_schema': {'name': ..., "
                                    "'schema': {a JSON schema object}, 'strict': true or false}", param=param)
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise ApiError(400, f"'response_format.json_schema.strict' must be true or false, got {strict!r}",
                               param=param)
            schema = closed_objects(spec["schema"]) if closed else spec["schema"]
            return json_schema_grammar(schema, strict=bool(strict), **settings)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ApiError(400, f"'{param}' is neither a JSON schema object nor its JSON text ({exc})",
                                   param=param) from None
            return json_schema_grammar(closed_objects(value) if closed else value, **settings)
        return {"regex": regex_grammar, "choice": choice_grammar, "grammar": cfg_grammar}[kind](value)
    except VkformersError as exc:  # one the grammar engine cannot compile, or no engine installed
        raise ApiError(400, str(exc) if param == "response_format" else f"{param}: {exc}", param=param) from None


def forced_tool_call(body: dict) -> tuple[dict, ForcedToolCalls] | None:
    """A chat request's tool_choice that forces a call ("required", or {"type": "function", "function": {"name":
    ...}}): the JSON schema its output keeps to and the parser of that output (models/tool_calls.py), as vLLM
    answers it with or without a tool-call parser; None for any other choice."""
    choice = body.get("tool_choice")
    if choice != "required" and not isinstance(choice, dict):
        return None
    tools = body.get("tools")
    if not tools:
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise ApiError(400, "'tools' must be a list of {'type': 'function', 'function': {'name': ..., "
                            "'parameters': {...}}}", param="tools")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ApiError(400, "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                           param="tool_choice")
        if name not in [t["function"]["name"] for t in tools]:
            raise ApiError(400, f"tool_choice names '{name}', which is not among 'tools'", param="tool_choice")
    try:
        return forced_call_schema(tools, choice, parallel=body.get("parallel_tool_calls") is not False)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tools") from None


def output_grammar(body: dict, chat: bool) -> str | None:
    """The grammar a request's output keeps to: response_grammar's, or a forced tool call's (the two together are
    a 400)."""
    grammar = response_grammar(body)
    forced = forced_tool_call(body) if chat else None
    if forced is None:
        return grammar
    if grammar is not None:
        raise ApiError(400, f"tool_choice {body['tool_choice']!r} and '{output_constraints(body)[0][0]}' each "
                            "constrain the output: give one", param="tool_choice")
    strict = all(t["function"].get("strict") is True for t in body["tools"])
    try:
        return json_schema_grammar(forced[0], strict=strict)
    except VkformersError as exc:  # a schema the engine cannot compile, or no engine installed
        raise ApiError(400, f"tools: {exc}", param="tools") from None
