"""The output of completions and chat completions requests shaped as OpenAI and vLLM answer it: the logprobs
objects, usage, the error a refused request gets, a request's whole output gathered from its updates (Output),
and the updates of a streamed call with its reasoning and tool calls told apart (held_updates).
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

from vkformers.cli.api_schema import ApiError
from vkformers.errors import InputError
from vkformers.models.batching import SchedulerStopped, Update
from vkformers.models.paged_cache import KVBlocksExhausted
from vkformers.models.reasoning import ReasoningStream
from vkformers.models.tool_calls import ToolCallStream

LOWEST_LOGPROB = -9999.0        # what a log-probability of -inf is sent as (JSON has no infinity), as vLLM sends it


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def token_names(tokenizer):
    """token id -> token_text, each token decoded once: an echoed prompt's entries name the same tokens many times."""
    return functools.lru_cache(maxsize=None)(functools.partial(token_text, tokenizer))


def sent_logprob(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, LOWEST_LOGPROB)


def completion_logprobs(tokenizer, entries, offset: int, top: int) -> dict:
    """/v1/completions' logprobs object for ``entries`` (TokenLogprob), text offsets counted from ``offset``: each
    position's ``top`` likeliest tokens and the token itself (OpenAI's "up to logprobs + 1"). An echoed prompt's
    first token, which no position predicts (logprob None), has null in token_logprobs and top_logprobs, as OpenAI
    and vLLM send it."""
    name = token_names(tokenizer)
    tokens = [name(e.token) for e in entries]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)

    def likeliest(entry):
        shown = {name(t): sent_logprob(lp) for t, lp in entry.top[:top]}
        shown.setdefault(name(entry.token), sent_logprob(entry.logprob))
        return shown
    return {"tokens": tokens, "token_logprobs": [sent_logprob(e.logprob) for e in entries],
            "top_logprobs": [None if e.logprob is None else likeliest(e) for e in entries], "text_offset": offsets}


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two completion_logprobs objects as one: ``first``'s tokens, then ``then``'s."""
    return {key: first[key] + then[key] for key in first}


def vllm_prompt_logprobs(tokenizer, entries, top: int) -> list:
    """vLLM's prompt_logprobs of a prompt's ``entries`` (TokenLogprob, the first of no logprob): null for the first
    token, then per token the token itself and the ``top`` likeliest, each token id (a string, as JSON keys are) ->
    {"logprob", "rank" (1: the likeliest), "decoded_token"}."""
    name = token_names(tokenizer)
    listed = []
    for e in entries:
        if e.logprob is None:
            listed.append(None)
            continue
        item = {str(e.token): {"logprob": sent_logprob(e.logprob), "rank": e.rank, "decoded_token": name(e.token)}}
        for rank, (token, logprob) in enumerate(e.top[:top], 1):
            item.setdefault(str(token), {"logprob": sent_logprob(logprob), "rank": rank, "decoded_token": name(token)})
        listed.append(item)
    return listed


def chat_logprobs(tokenizer, entries) -> dict:
    def item(token, logprob):
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """A response's usage; ``reasoning_tokens`` (those of the completion's reasoning, where the server reads it) in
    completion_tokens_details, as OpenAI and vLLM give them."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
              "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


def refusal(exc: Exception) -> ApiError:
    """The answer to a request refused before it runs: an ApiError as it is; the scheduler's InputError (a prompt
    too long, a token outside the vocabulary) a 400; KVBlocksExhausted (the request alone exceeds the paged cache)
    and SchedulerStopped (nothing runs requests any more, as /health says) a 503."""
    if isinstance(exc, KVBlocksExhausted):
        return ApiError(503, str(exc), kind="server_error", code="kv_cache_full")
    if isinstance(exc, SchedulerStopped):
        return ApiError(503, str(exc), kind="server_error")
    if isinstance(exc, InputError):
        return ApiError(400, str(exc))
    return exc


@dataclass
class Output:
    """A request's whole output, gathered from its updates; ``reasoning``, where the server reads reasoning, splits
    its text as a streamed one is split."""
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    tokens: int = 0
    prompt_logprobs: list = field(default_factory=list)  # (SamplingParams.prompt_logprobs)
    reasoning: ReasoningStream | None = None

    def add(self, update: Update) -> None:
        self.text += update.text
        self.logprobs += update.logprobs
        self.prompt_logprobs += update.prompt_logprobs or []
        self.finish_reason, self.tokens = update.finish_reason, update.completion_tokens
        if self.reasoning is not None:
            self.reasoning.feed(update.text, update.completion_tokens)
            if update.finish_reason:
                self.reasoning.finish()

    def answer(self) -> tuple[str | None, str | None]:
        """(the answer's text, the reasoning): the text and None where the server reads no reasoning or the reply
        had none; else the answer None where it is empty (a reply cut inside its thinking), as vLLM gives them."""
        split = self.reasoning
        if split is None or not split.thought:
            return (self.text if split is None else split.content), None
        return split.content or None, split.reasoning


async def held_updates(updates: asyncio.Queue, count: int, parser=None, splits: list[ReasoningStream] | None = None,
                       incremental: bool = False):
    """The updates of a streamed call's ``count`` requests as they come, as (index, reasoning to send, text to send,
    tool calls, update, whether the reply ended in calls). With ``splits`` (one per request), each request's
    reasoning is told apart from its answer (models/reasoning.py), the answer alone read for calls. With ``parser``,
    each request's text is held back from where a call may begin (ToolCallStream); its calls come whole (ToolCall)
    with its last update, or with ``incremental`` as ``tool_calls`` deltas while they come. Ends after every
    request's last update, or after the update of a failed batch (finish_reason "error")."""
    held = [ToolCallStream(parser, incremental) for _ in range(count)] if parser is not None else None
    running = count
    while running:
        index, update = await updates.get()
        if update.finish_reason == "error":
            yield index, "", update.text, [], update, False
            return
        reasoning, text, calls, called = "", update.text, [], False
        if splits is not None:
            reasoning, text = splits[index].feed(text, update.completion_tokens)
            if update.finish_reason:
                more, rest = splits[index].finish()
                reasoning, text = reasoning + more, text + rest
        if held is not None:
            text, calls = held[index].feed(text)
            if update.finish_reason:
                rest, last, called = held[index].finish()
                text, calls = text + rest, calls + last
        yield index, reasoning, text, calls, update, called
        running -= update.finish_reason is not None
