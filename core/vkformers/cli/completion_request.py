"""The body of a completions or chat completions request (OpenAI's fields and vLLM's extras) read into the
SamplingParams of its choices, and the fields this server refuses rather than answer otherwise than vLLM. The
output's constraints are read in cli/output_constraints.py, the prompts in cli/request_prompts.py.
"""
from __future__ import annotations

from dataclasses import replace

from vkformers.cli.api_schema import ApiError, number_field
from vkformers.cli.output_constraints import output_grammar, response_kind
from vkformers.models.batching import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_PROMPT_LOGPROBS = 20        # vLLM's default bound (max_logprobs) on prompt_logprobs
SAMPLING_DEFAULT_NAMES = ("temperature", "top_p", "top_k", "min_p")


def model_sampling_defaults(model) -> dict:
    """The sampling settings of the model's generation config that stand in for what a request leaves out
    (``temperature``, ``top_p``, ``top_k``, ``min_p``), as vLLM takes them: Qwen's recommended temperature rather
    than OpenAI's 1.0."""
    generation = getattr(model, "generation_config", None) or {}
    return {name: generation[name] for name in SAMPLING_DEFAULT_NAMES if generation.get(name) is not None}


def sampling_params(body: dict, *, chat: bool, prompt_tokens: int, max_model_len: int,
                    defaults: dict | None = None, tools: bool = False) -> SamplingParams:
    """The generation settings of a completions (``chat`` False) or chat completions request; ``defaults``
    (model_sampling_defaults) stand in for sampling settings the request leaves out, else OpenAI's."""
    defaults = defaults or {}
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "best_of is not supported", param="best_of")
    echo = echoes(body, chat)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = next((name for name in names if body.get(name) is not None), None)
    room = max(max_model_len - prompt_tokens, 1)  # (a prompt that leaves none is refused by the scheduler)
    default = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
    max_tokens = default if given is None else number_field(body, given, None, int, low=0)
    if max_tokens == 0 and not echo:  # (0 is vLLM's echo of the prompt alone)
        hint = "" if chat else " (0, no completion, goes with 'echo': true: the prompt alone)"
        raise ApiError(400, f"'{given}' must be >= 1, got 0{hint}", param=given)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", param="stop")
    if chat:
        logprobs = number_field(body, "top_logprobs", 0, int, 0, 20) if body.get("logprobs") else None
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        logprobs = number_field(body, "logprobs", None, int, 0, 5)
    # the prompt's own entries: those shown in prompt_logprobs, and an echoed prompt's in logprobs
    prompt_logprobs = max((k for k in (shown_prompt_logprobs(body, chat), logprobs if echo else None)
                           if k is not None), default=None)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    refuse_unsupported(body, chat, tools)
    top_k = number_field(body, "top_k", int(defaults.get("top_k", 0)), int, -1)  # vLLM's extra field; -1, 0: off
    temperature = number_field(body, "temperature", float(defaults.get("temperature", 1.0)), float, 0, 2)
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          top_p=number_field(body, "top_p", float(defaults.get("top_p", 1.0)), float, 0, 1),
                          top_k=max(top_k, 0), seed=seed,
                          min_p=number_field(body, "min_p", float(defaults.get("min_p", 0.0)), float, 0, 1),
                          stop=tuple(s for s in stop if s), logprobs=logprobs,
                          repetition_penalty=number_field(body, "repetition_penalty", 1.0, float, low=0),
                          min_tokens=number_field(body, "min_tokens", 0, int, low=0),
                          allowed_token_ids=token_ids(body, "allowed_token_ids"),
                          include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
                          presence_penalty=number_field(body, "presence_penalty", 0.0, float, -2, 2),
                          frequency_penalty=number_field(body, "frequency_penalty", 0.0, float, -2, 2),
                          logit_bias=logit_bias(body), json_mode=response_kind(body) == "json_object",
                          grammar=output_grammar(body, chat), prompt_logprobs=prompt_logprobs)


def echoes(body: dict, chat: bool) -> bool:
    """Whether a completions request gives its prompt back before the completion (OpenAI's echo); a 400 on chat
    completions, which have no prompt text to echo."""
    echo = body.get("echo")
    if echo is None or echo is False:
        return False
    if chat:
        raise ApiError(400, "'echo' is a /v1/completions parameter (the prompt given back before its completion); "
                            "chat completions take none: leave it out", param="echo")
    if not isinstance(echo, bool):
        raise ApiError(400, f"'echo' must be true or false, got {echo!r}", param="echo")
    return True


def shown_prompt_logprobs(body: dict, chat: bool) -> int | None:
    """How many likeliest tokens each prompt token's entry of vLLM's ``prompt_logprobs`` lists (None: no such field
    in the response): the request's prompt_logprobs, else with echo its logprobs, as vLLM takes them. Streamed,
    vLLM has no prompt_logprobs to send and refuses them, but for 0 (it sends nothing): so does this server."""
    shown = number_field(body, "prompt_logprobs", None, int, 0, MAX_PROMPT_LOGPROBS)
    if shown is not None and body.get("stream"):
        if shown:
            raise ApiError(400, "'prompt_logprobs' are not sent when streaming ('stream': true): leave it out, or "
                                "echo the prompt with its logprobs ('echo': true and 'logprobs' on /v1/completions)",
                           param="prompt_logprobs")
        return None
    if shown is None and not chat and echoes(body, chat):
        shown = number_field(body, "logprobs", None, int, 0, 5)
    return shown


def token_ids(body: dict, name: str) -> tuple[int, ...]:
    """A request's list of token ids (vLLM's allowed_token_ids; () when absent)."""
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"'{name}' must be a list of token ids", param=name)
    return tuple(value)


def flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value


# vLLM's sampling extras this server does not honour, each with the value that changes nothing: any other value is
# a 400 rather than an answer that silently differs from vLLM's
UNHONOURED_EXTRAS = {"use_beam_search": False, "bad_words": [], "skip_special_tokens": True,
                     "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
                     "return_tokens_as_token_ids": False, "logits_processors": [], "continue_final_message": False,
                     "add_generation_prompt": True}


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (as JSON object keys) to a bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, "'logit_bias' must be an object of token ids to biases", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}",
                           param="logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def stop_token_ids(body: dict) -> list[int]:
    """vLLM's stop_token_ids: token ids that end the output as the end-of-sequence token does (not in the text)."""
    value = body.get("stop_token_ids")
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise ApiError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    return value


def stream_usage(body: dict) -> bool:
    """Whether a streamed response ends with a chunk of usage (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object such as {\"include_usage\": true}",
                       param="stream_options")
    return bool(options.get("include_usage"))


def refuse_unsupported(body: dict, chat: bool, tools: bool = False) -> None:
    """A 400 for what this server would otherwise ignore and answer wrongly: a response format it does not know,
    echo of a fill-in-the-middle prompt, tool calls that no parser reads (``tools``: the server has one), a tool
    choice that would need constrained decoding."""
    kind = response_kind(body)
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, f"'response_format' of type {kind!r} is not supported: give text, json_object or "
                            "json_schema", param="response_format")
    if not chat and body.get("suffix") and echoes(body, chat):
        raise ApiError(400, "'echo' with a 'suffix' is not supported: the model reads the prompt and the suffix "
                            "around its fill-in-the-middle tokens, not the prompt as sent; leave 'echo' out",
                       param="echo")
    for name, default in UNHONOURED_EXTRAS.items():
        if body.get(name) is not None and body[name] != default:
            raise ApiError(400, f"'{name}' is not supported here: leave it out (or at {default!r})", param=name)
    choice = body.get("tool_choice")
    if chat and body.get("tools") and choice not in ("none", "required") and not isinstance(choice, dict):
        if not tools:
            raise ApiError(400, "tool calls are not enabled: start vkformers serve with --enable-auto-tool-choice "
                                "--tool-call-parser NAME, or force a call (tool_choice 'required' or a named "
                                "function), or leave 'tools' out (or set tool_choice 'none')", param="tools")
        if choice not in (None, "auto"):
            raise ApiError(400, f"tool_choice {choice!r} is none of 'auto', 'none', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The settings of each of a request's ``n`` choices: choice i samples with seed + i (choice 0 as the request
    alone would), so that a seeded request repeats; without a seed each choice draws its own."""
    return [replace(params, seed=None if params.seed is None else params.seed + index) for index in range(n)]
