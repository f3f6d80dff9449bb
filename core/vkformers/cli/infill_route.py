"""llama.cpp's ``POST /infill`` on ``vkformers serve``, for the editor plugins written for llama.cpp's server
(llama.vscode, llama.vim): the code before and after the cursor (``input_prefix``, ``input_suffix``), chunks of other
files (``input_extra``: ``{"filename", "text"}`` objects) and the text typed on the cursor's line (``prompt``) laid
out as llama.cpp lays them out (models/fill_in_middle.py's infill_prompt), run on the scheduler as a completion is,
and answered as llama.cpp's /completion answers: one object (``content``, ``stop``, ``tokens_predicted``,
``tokens_evaluated``, ``stop_type``, ``timings``, ...; only the ``response_fields`` asked for where a request names
them), or streamed as ``data: {...}`` lines, one per piece of text, then the whole object (``"stop": true``, its
content sent already), with no ``[DONE]``. Errors are llama.cpp's: ``{"error": {"code", "message", "type"}}``.

llama.cpp's sampling fields are read with its defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05; a
``samplers`` list leaves out those it does not name); ``n_predict`` (or ``max_tokens``) -1 generates until an end
token or the context is full, 0 evaluates the prompt (its blocks kept for prefix caching, as llama.cpp fills its
cache) and generates nothing; ``n_indent`` ends the output before a line indented less. Fields that only steer
llama.cpp's slots, caches and clocks are taken and change nothing; sampling fields this server does not implement
are a 400 unless neutral (UNHONOURED).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace

from vkformers.cli.api_schema import ApiError, flag_field, number_field, while_connected
from vkformers.cli.completion_output import refusal
from vkformers.errors import InputError
from vkformers.models.batching import Request, SamplingParams, SchedulerStopped
from vkformers.models.fill_in_middle import FillInMiddleTokens, infill_prompt, no_fill_in_middle_tokens
from vkformers.models.paged_cache import KVBlocksExhausted

ROUTE = "/infill"
# llama.cpp's default n_batch: its /infill keeps the prefix's last 3/4 and the suffix's first 1/4 of it; here at most
# half the context, so that a short --max-model-len keeps room for the repository-level context and the output
INFILL_BATCH = 2048
LLAMA_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama.cpp's server defaults
SAMPLER_LETTERS = {"k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature"}  # llama.cpp's --sampling-seq
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's "a random seed"
# llama.cpp's sampling fields not implemented here, with the values that leave its sampling as this server's: any
# other is a 400 rather than an answer that silently differs
UNHONOURED = {"repeat_penalty": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "dry_multiplier": (0,),
              "xtc_probability": (0,), "typical_p": (1,), "mirostat": (0,), "dynatemp_range": (0,),
              "top_n_sigma": (-1,), "n_probs": (0,), "grammar": ("",), "logit_bias": ([], {}), "lora": ([],),
              "n_cmpl": (1,)}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}
OWN_ERROR_TYPES = ("not_supported_error", "exceed_context_size_error")


class ContextExceeded(ApiError):
    """llama.cpp's error for a prompt that leaves no room in the context, with its counts."""

    def __init__(self, prompt_tokens: int, context: int):
        super().__init__(400, f"the request's prompt ({prompt_tokens} tokens) exceeds the available context size "
                              f"({context} tokens, --max-model-len); send less code around the cursor or serve with "
                              "a longer --max-model-len", kind="exceed_context_size_error")
        self.counts = {"n_prompt_tokens": prompt_tokens, "n_ctx": context}


def llama_error(exc: ApiError) -> dict:
    """An ApiError as llama.cpp's server answers errors: ``{"error": {"code", "message", "type"}}``, the type from
    the HTTP status as llama.cpp names it."""
    kind = exc.kind if exc.kind in OWN_ERROR_TYPES else ERROR_TYPES.get(exc.status, exc.kind)
    return {"error": {"code": exc.status, "message": exc.message, "type": kind, **getattr(exc, "counts", {})}}


@dataclass
class InfillRequest:
    """An /infill request read: its prompt ids, SamplingParams and what shapes its answer. ``predict``: n_predict
    as asked (< 0: until the end); ``warm``: n_predict 0, the prompt evaluated and nothing generated;
    ``to_context``: the output may run into the end of the context (llama.cpp's ``truncated`` when it does)."""
    prompt: list[int]
    params: SamplingParams
    predict: int
    warm: bool
    to_context: bool
    n_indent: int
    stream: bool
    fields: list[str] | None
    return_tokens: bool
    settings: dict


def read_infill(body: dict, tokenizer, tokens: FillInMiddleTokens, max_model_len: int) -> InfillRequest:
    """An /infill request's body read as llama.cpp reads it (ApiError 400 for a malformed one)."""
    prefix, suffix = (_required_text(body, name) for name in ("input_prefix", "input_suffix"))
    typed = body.get("prompt") or ""
    if not isinstance(typed, str):
        raise ApiError(400, "'prompt' must be a string (the text typed before the cursor on its line)", param="prompt")
    extra = _chunks(body)
    predict = number_field(body, "n_predict", None, int)
    predict = number_field(body, "max_tokens", -1, int) if predict is None else predict
    refuse_unhonoured(body)
    batch = max(min(INFILL_BATCH, max_model_len // 2), 4)
    prompt = infill_prompt(tokenizer, prefix, suffix, extra, typed, tokens, batch=batch, context=max_model_len,
                           reserve=max(predict, 0))
    room = max_model_len - len(prompt)
    if room < 1:
        raise ContextExceeded(len(prompt), max_model_len)
    # n_predict 0: one token run and not shown, which prefills the prompt as llama.cpp evaluates it into its cache
    max_tokens = 1 if predict == 0 else room if predict < 0 else min(predict, room)
    params, settings = _sampling(body, max_tokens)
    return_tokens = flag_field(body, "return_tokens", False)
    if return_tokens:  # (the token ids come with their log-probabilities)
        params = replace(params, logprobs=0)
    return InfillRequest(prompt, params, predict, predict == 0, predict < 0 or predict > room,
                         number_field(body, "n_indent", 0, int), flag_field(body, "stream", False),
                         _response_fields(body), return_tokens, {"n_predict": predict, **settings})


def refuse_unhonoured(body: dict) -> None:
    for name, neutral in UNHONOURED.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value not in neutral):
            raise ApiError(400, f"'{name}' is not supported on /infill: leave it out (or at {neutral[0]!r})",
                           param=name)


def _required_text(body: dict, name: str) -> str:
    if name not in body:
        raise ApiError(400, f"'{name}' is required", param=name)
    if not isinstance(body[name], str):
        raise ApiError(400, f"'{name}' must be a string, got {type(body[name]).__name__}", param=name)
    return body[name]


def _chunks(body: dict) -> list[tuple[str | None, str]]:
    """``input_extra``: a list of {"filename": string (or none), "text": string} objects (others keys ignored)."""
    chunks = body.get("input_extra")
    if chunks is None:
        return []
    shape = "'input_extra' must be an array of {\"filename\": string, \"text\": string} objects"
    if not isinstance(chunks, list):
        raise ApiError(400, shape, param="input_extra")
    read = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) or \
                not isinstance(chunk.get("filename", ""), (str, type(None))):
            raise ApiError(400, f"{shape}; got {json.dumps(chunk)[:80]}", param="input_extra")
        read.append((chunk.get("filename"), chunk["text"]))
    return read


def _sampling(body: dict, max_tokens: int) -> tuple[SamplingParams, dict]:
    """SamplingParams from llama.cpp's fields and defaults (a ``samplers`` list or string: those it leaves out are
    off; temperature <= 0 or top_p 0: greedy), and the settings as the answer reports them."""
    temperature = number_field(body, "temperature", LLAMA_SAMPLING["temperature"], float)
    top_k = number_field(body, "top_k", LLAMA_SAMPLING["top_k"], int)
    top_p = number_field(body, "top_p", LLAMA_SAMPLING["top_p"], float, 0, 1)
    min_p = number_field(body, "min_p", LLAMA_SAMPLING["min_p"], float, 0, 1)
    applied = _samplers(body)
    if applied is not None:
        top_k = top_k if "top_k" in applied else 0
        top_p = top_p if "top_p" in applied else 1.0
        min_p = min_p if "min_p" in applied else 0.0
        temperature = temperature if "temperature" in applied else 1.0
    seed = number_field(body, "seed", -1, int)
    if seed < 0 and seed not in RANDOM_SEEDS:
        raise ApiError(400, f"'seed' must be -1 (a random seed) or a non-negative integer, got {seed}", param="seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be an array of strings", param="stop")
    greedy = temperature <= 0 or top_p <= 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else temperature,
                            top_p=1.0 if greedy else top_p, top_k=max(top_k, 0), min_p=min_p,
                            seed=None if seed in RANDOM_SEEDS else seed, stop=tuple(s for s in stop if s),
                            include_stop_str_in_output=True)  # (cut here, to tell a stop word from an end token)
    settings = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                "seed": -1 if params.seed is None else seed, "stop": list(params.stop),
                "samplers": applied if applied is not None else list(LLAMA_SAMPLING),
                "ignore_eos": bool(body.get("ignore_eos"))}
    return params, settings


def _samplers(body: dict) -> list[str] | None:
    """The samplers a request names (llama.cpp's names, or its letters), of those this server has; None: all."""
    value = body.get("samplers")
    if value is None:
        return None
    if isinstance(value, str):
        value = [SAMPLER_LETTERS.get(letter, "") for letter in value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ApiError(400, "'samplers' must be an array of sampler names or a string of their letters",
                       param="samplers")
    return list(dict.fromkeys(s for s in value if s in LLAMA_SAMPLING))


def _response_fields(body: dict) -> list[str] | None:
    value = body.get("response_fields")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ApiError(400, "'response_fields' must be an array of field names", param="response_fields")
    return value


def picked_fields(answer: dict, paths: list[str] | None) -> dict:
    """llama.cpp's response_fields: only the fields named, a path "a/b" giving answer["a"]["b"] under the key
    "a/b"; those missing left out. None or none named: the whole answer."""
    if not paths:
        return answer
    picked, missing = {}, object()
    for path in paths:
        value = answer
        for key in path.split("/"):
            value = value.get(key, missing) if isinstance(value, dict) else missing
        if value is not missing:
            picked[path] = value
    return picked


@dataclass
class Middle:
    """An infill's output as its text comes: kept whole up to a stop string (stop_type "word"; the scheduler keeps
    it in the text, include_stop_str_in_output, to tell it from an end token) or to the first character of a line,
    after the first, indented by fewer than ``n_indent`` spaces and tabs (llama.cpp's n_indent: "limit"; the line's
    indentation kept). ``cut``: one of those ended it (the request is then cancelled)."""
    stops: tuple[str, ...]
    n_indent: int
    text: str = ""
    stop_type: str | None = None
    stopping_word: str = ""
    tokens: int = 0
    ids: list[int] = field(default_factory=list)
    cut: bool = False
    _scan: int = 0  # where the next newline whose line is still to check may be

    def feed(self, piece: str) -> str:
        """The part of ``piece`` kept (all of it, unless the output ends within it)."""
        if self.cut:
            return ""
        start, text = len(self.text), self.text + piece
        ends = []
        reach = max((len(s) for s in self.stops), default=0)
        for stop in self.stops:
            at = text.find(stop, max(start - reach, 0))
            if at >= 0:
                ends.append((at, "word", stop))
        if self.n_indent > 0:
            while (newline := text.find("\n", self._scan)) >= 0:
                first = newline + 1
                while first < len(text) and text[first] in " \t":
                    first += 1
                if first == len(text):
                    break  # its indentation is not known yet
                if first - newline - 1 < self.n_indent:
                    ends.append((first, "limit", ""))
                    break
                self._scan = first
        if ends:
            at, self.stop_type, self.stopping_word = min(ends)
            text, self.cut = text[:max(at, start)], True
        self.text = text
        return text[start:]


class InfillRoute:
    """The /infill route of an app serving ``scheduler``'s model (None: another kind, answered 400) as ``served``,
    over cli/serve.py's machinery: ``body`` (route_body: the authorized request's JSON), ``submit`` (the jobs handed
    to the scheduler with end tokens) and ``failed`` (the error of a failed batch)."""

    def __init__(self, scheduler, tokenizer, served: str, tokens: FillInMiddleTokens | None, *, body, submit, failed):
        # the optional [serve] extra, imported once the app is built (as build_app imports it)
        from starlette.responses import JSONResponse, StreamingResponse
        self.scheduler, self.tokenizer, self.served, self.tokens = scheduler, tokenizer, served, tokens
        self.body, self.submit, self.failed = body, submit, failed
        self.json, self.streaming = JSONResponse, StreamingResponse

    async def answer(self, request):
        try:
            body = await self.body(request, ROUTE, self.scheduler)
            if self.tokens is None:
                raise ApiError(501, f"infill is not supported by this model: {no_fill_in_middle_tokens()}",
                               kind="not_supported_error")
            asked = read_infill(body, self.tokenizer, self.tokens, self.scheduler.max_model_len)
            (job,), updates = self.submit(body, [(asked.prompt, asked.params)], self.tokens.end)
        except (ApiError, InputError, KVBlocksExhausted, SchedulerStopped) as exc:
            return self.error(refusal(exc))
        model = body.get("model") or self.served
        if asked.stream:
            return self.streaming(self._stream(job, updates, asked, model), media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})
        try:
            answer = await self._whole(request, job, updates, asked, model)
        except ApiError as exc:
            return self.error(exc)
        return self.json(picked_fields(answer, asked.fields))

    def error(self, exc: ApiError):
        return self.json(llama_error(exc), status_code=exc.status)

    async def _pieces(self, job: Request, updates: asyncio.Queue, asked: InfillRequest, middle: Middle):
        """Each update's kept text as it comes, with the update; ends after the last (the request cancelled where
        the output was cut before its end). Raises ApiError 500 when its batch fails."""
        while True:
            _, update = await updates.get()
            if update.finish_reason == "error":
                raise self.failed()
            text = ""
            if not asked.warm:
                text = middle.feed(update.text)
                middle.tokens = update.completion_tokens
                middle.ids += [entry.token for entry in update.logprobs]
            yield text, update
            if middle.cut:
                job.cancel()  # leaves the batch at the next step
            if update.finish_reason is not None or middle.cut:
                if middle.stop_type is None:
                    middle.stop_type = "eos" if update.finish_reason == "stop" and not asked.warm else "limit"
                return

    async def _whole(self, request, job: Request, updates: asyncio.Queue, asked: InfillRequest, model: str) -> dict:
        """The whole answer; ApiError 499 when the client leaves first (while_connected), 500 when the batch fails.
        The request leaves the batch either way."""
        middle = Middle(asked.params.stop, asked.n_indent)

        async def run() -> float:
            async for _ in self._pieces(job, updates, asked, middle):
                pass
            return time.perf_counter()
        try:
            ended = await while_connected(request, run())
        finally:
            job.cancel()
        return self._final(job, asked, middle, model, ended, streamed=False)

    async def _stream(self, job: Request, updates: asyncio.Queue, asked: InfillRequest, model: str):
        """llama.cpp's stream: a ``data:`` line of each piece of text (``"stop": false``), then the whole answer
        without its text (sent already); an error as a ``data:`` line of llama.cpp's error object."""
        middle = Middle(asked.params.stop, asked.n_indent)
        sent = 0
        try:
            async for text, update in self._pieces(job, updates, asked, middle):
                if text:
                    ids = middle.ids[sent:] if asked.return_tokens else []
                    sent = len(middle.ids)
                    yield _event({"index": 0, "content": text, "tokens": ids, "stop": False,
                                  "tokens_predicted": update.completion_tokens,
                                  "tokens_evaluated": len(asked.prompt)})
            yield _event(self._final(job, asked, middle, model, time.perf_counter(), streamed=True))
        except ApiError as exc:
            yield _event(llama_error(exc))
        finally:
            job.cancel()  # the client went away mid-stream: its row leaves the batch at the next step

    def _final(self, job: Request, asked: InfillRequest, middle: Middle, model: str, ended: float, *,
               streamed: bool) -> dict:
        """llama.cpp's /completion answer; streamed, its content and tokens were sent already."""
        predicted = 0 if asked.warm else middle.tokens
        first = job.first_token_at or ended
        prompt_ms, predicted_ms = (first - job.arrived) * 1000, 0.0 if asked.warm else (ended - first) * 1000
        evaluated = len(asked.prompt)
        truncated = middle.stop_type == "limit" and not middle.cut and asked.to_context and \
            evaluated + predicted >= self.scheduler.max_model_len
        return {"index": 0, "content": "" if streamed else middle.text,
                "tokens": [] if streamed or not asked.return_tokens else middle.ids, "stop": True, "model": model,
                "tokens_predicted": predicted, "tokens_evaluated": evaluated,
                "generation_settings": {**asked.settings, "n_indent": asked.n_indent, "stream": asked.stream,
                                        "max_tokens": 0 if asked.warm else asked.params.max_tokens},
                "prompt": self.tokenizer.decode(asked.prompt, skip_special_tokens=False),
                "has_new_line": "\n" in middle.text, "truncated": truncated, "stop_type": middle.stop_type,
                "stopping_word": middle.stopping_word, "tokens_cached": evaluated + predicted,
                "timings": {"cache_n": 0, **_rates("prompt", evaluated, prompt_ms),
                            **_rates("predicted", predicted, predicted_ms)}}


def _rates(name: str, count: int, ms: float) -> dict:
    """llama.cpp's timings of a phase: its tokens, milliseconds, milliseconds a token and tokens a second."""
    return {f"{name}_n": count, f"{name}_ms": ms, f"{name}_per_token_ms": ms / count if count else 0.0,
            f"{name}_per_second": count * 1000 / ms if count and ms > 0 else 0.0}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
