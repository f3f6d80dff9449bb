"""``vkformers serve``: an OpenAI-compatible HTTP server, with continuous batching of the requests.

    vkformers serve                                     # the bundled SmolLM2-135M-Instruct on 127.0.0.1:8000
    vkformers serve --model ./my-checkpoint --adapter ./my-lora --port 8080 --api-key secret
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events with
``"stream": true``), GET /health, GET /metrics (Prometheus text). The requests run through a BatchScheduler
(models/batching.py). Needs the ``serve`` extra (Starlette and uvicorn): ``pip install 'vkformers[serve]'``.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from vkformers.cli import generate as cli_generate
from vkformers.cli.options import positive_int
from vkformers.engine.quantized import QUANTIZE_FORMATS
from vkformers.errors import InputError, VkformersError
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.loading import AutoTokenizer
from vkformers.models.lora import load_adapter, merge_lora

INSTALL_HINT = "vkformers serve needs Starlette and uvicorn: pip install 'vkformers[serve]'"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


def add_parser(subparsers):
    parser = subparsers.add_parser("serve", help="serve a causal LM over an OpenAI-compatible HTTP API",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help=f"checkpoint folder, hub repo id or .gguf file (default: {cli_generate.DEFAULT_MODEL_FILE} "
                             f"from the {cli_generate.DEFAULT_MODEL_PACKAGE} package)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: a .gguf file's stem, else --model as given; "
                             "SmolLM2-135M-Instruct for the bundled model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=positive_int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--max-batch", type=positive_int, default=64,
                        help="most requests decoded together; more wait (default 64)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="most tokens of a request, prompt and output (default: the model's positions)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="weights and activations (auto: the checkpoint's; float32 for .gguf)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZE_FORMATS,
                        help="pack a safetensors checkpoint's Linear weights in this block format while loading")
    parser.add_argument("--adapter", default=None, type=Path,
                        help="a PEFT LoRA adapter folder, merged into the weights at load")
    parser.add_argument("--api-key", default=os.environ.get("VKFORMERS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VKFORMERS_API_KEY)")
    parser.add_argument("--device", type=int, default=None, help="Vulkan device index (default: $VKFORMERS_DEVICE or 0)")
    parser.set_defaults(func=run)
    return parser


def web_modules():
    """Starlette and uvicorn, or a VkformersError saying how to install them."""
    try:
        import starlette  # noqa: F401  (the optional [serve] extra: the core command line runs without it)
        import uvicorn
    except ImportError:
        raise VkformersError(INSTALL_HINT) from None
    return uvicorn


def run(args) -> int:
    uvicorn = web_modules()
    if args.device is not None:
        os.environ["VKFORMERS_DEVICE"] = str(args.device)
    model_name = args.model or cli_generate.default_model()
    served = args.served_model_name or served_name(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = cli_generate.load_model(model_name, args.dtype, quantization=args.quantization)
    if args.adapter is not None:
        merge_lora(load_adapter(model, args.adapter))
    scheduler = BatchScheduler(model, tokenizer, max_batch=args.max_batch, max_model_len=args.max_model_len,
                               eos=eos_ids(model, tokenizer)).start()
    app = build_app(scheduler, tokenizer, served, api_key=args.api_key)
    print(f"vkformers serve: {served} on http://{args.host}:{args.port}/v1 (ready when /health answers)",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        scheduler.close()
    return 0


def served_name(model: str | None) -> str:
    """The model's name in the API: the bundled model's, a .gguf file's stem, else --model as given."""
    if model is None:
        return cli_generate.DEFAULT_MODEL_FILE.split(".")[0]
    return Path(model).stem if model.endswith(".gguf") else model.rstrip("/")


def eos_ids(model, tokenizer) -> list[int]:
    """The tokenizer's end-of-sequence token and the model config's (chat models end a turn with a token the base
    config may not list), as vkformers generate stops at."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    configured = (getattr(model, "config", None) or {}).get("eos_token_id")
    eos += [e for e in (configured if isinstance(configured, list) else [configured]) if e is not None]
    return sorted(set(eos))


# ---------------------------------------------------------------- requests (OpenAI's schemas)

class ApiError(Exception):
    """An OpenAI-style error response: HTTP ``status`` and the error object's fields."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                       param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(400, f"'{name}' must be {span}, got {value}", param=name)
    return kind(value)


def sampling_params(body: dict, *, chat: bool, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """The generation settings of a completions (``chat`` False) or chat completions request."""
    if _number(body, "n", 1, int) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if not chat and body.get("echo"):
        raise ApiError(400, "echo is not supported", param="echo")
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = next((name for name in names if body.get(name) is not None), None)
    room = max(max_model_len - prompt_tokens, 1)  # (a prompt that leaves none is refused by the scheduler)
    default = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
    max_tokens = default if given is None else _number(body, given, None, int, low=1)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", param="stop")
    if chat:
        logprobs = _number(body, "top_logprobs", 0, int, 0, 20) if body.get("logprobs") else None
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        logprobs = _number(body, "logprobs", None, int, 0, 5)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    return SamplingParams(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, float, 0, 2),
                          top_p=_number(body, "top_p", 1.0, float, 0, 1), seed=seed,
                          stop=tuple(s for s in stop if s), logprobs=logprobs)


def completion_prompt(body: dict, tokenizer) -> list[int]:
    """A completions request's prompt as token ids: a string, a list of token ids, or a list holding one of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="np")["input_ids"]
        return [int(t) for t in cli_generate.start_from_bos(tokenizer, ids)[0]]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")


def chat_prompt(body: dict, tokenizer) -> list[int]:
    """A chat request's messages through the model's chat template, ending with the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    conversation = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message must be an object with a 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, "a message's 'content' must be a string or a list of text parts", param="messages")
        conversation.append({"role": message["role"], "content": content or ""})
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="np")["input_ids"]
    return [int(t) for t in np.asarray(ids)[0]]


# ---------------------------------------------------------------- responses

def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(tokenizer, entries, offset: int, text: str) -> dict:
    """/v1/completions' logprobs object for ``entries`` (TokenLogprob), text offsets counted from ``offset``."""
    tokens = [token_text(tokenizer, e.token) for e in entries]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(tokenizer, entries) -> dict:
    def item(token, logprob):
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def prometheus(scheduler: BatchScheduler, served: str) -> str:
    """GET /metrics: the scheduler's counters and gauges in Prometheus' text format."""
    m = scheduler.metrics
    label = f'{{model="{served}"}}'
    rows = [("requests_total", "counter", "requests received", m.requests),
            ("requests_finished_total", "counter", "requests finished", m.finished),
            ("requests_cancelled_total", "counter", "requests left before their end (client gone)", m.cancelled),
            ("batch_errors_total", "counter", "batches that failed (their requests got an error)", m.errors),
            ("prompt_tokens_total", "counter", "prompt tokens received", m.prompt_tokens),
            ("generation_tokens_total", "counter", "tokens generated", m.generation_tokens),
            ("decode_steps_total", "counter", "batched decode steps", m.steps),
            ("batch_rebuilds_total", "counter", "prefills of the running batch (requests joining)", m.rebuilds),
            ("requests_running", "gauge", "requests in the running batch", m.live_rows),
            ("requests_waiting", "gauge", "requests waiting for a place in the batch", m.waiting),
            ("batch_rows", "gauge", "rows of the running batch, masked ones included", m.batch_rows),
            ("batch_occupancy", "gauge", "mean share of live rows over decode steps",
             m.occupancy_sum / m.steps if m.steps else 0.0),
            ("kv_cache_tokens", "gauge", "KV cache entries held by the running batch (rows x length)",
             m.cache_tokens),
            ("time_to_first_token_seconds_sum", "counter", "summed time to first token", m.ttft_sum),
            ("time_to_first_token_seconds_count", "counter", "requests with a first token", m.ttft_count)]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP vkformers_{name} {help_text}", f"# TYPE vkformers_{name} {kind}",
                  f"vkformers_{name}{label} {value}"]
    return "\n".join(lines) + "\n"


def build_app(scheduler: BatchScheduler, tokenizer, served: str, *, api_key: str | None = None):
    """The Starlette application serving ``scheduler``'s model under the name ``served``."""
    web_modules()
    # the optional [serve] extra, imported once the command runs (web_modules said how to install it)
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())

    def error(exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    def failed() -> ApiError:
        return ApiError(500, f"generation failed: {scheduler.last_error or scheduler.error}", kind="server_error")

    def authorize(request):
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {api_key}":
            raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def read_body(request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != served:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")
        return body

    async def health(request):
        if scheduler.error is not None:
            return JSONResponse({"status": "error", "error": str(scheduler.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        return PlainTextResponse(prometheus(scheduler, served), media_type="text/plain; version=0.0.4")

    async def models(request):
        try:
            authorize(request)
        except ApiError as exc:
            return error(exc)
        return JSONResponse({"object": "list", "data": [{"id": served, "object": "model", "created": created,
                                                         "owned_by": "vkformers"}]})

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    async def complete(request, chat: bool):
        try:
            authorize(request)
            body = await read_body(request)
            prompt = chat_prompt(body, tokenizer) if chat else completion_prompt(body, tokenizer)
            params = sampling_params(body, chat=chat, prompt_tokens=len(prompt),
                                     max_model_len=scheduler.max_model_len)
            stream = bool(body.get("stream"))
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            loop = asyncio.get_running_loop()
            updates: asyncio.Queue = asyncio.Queue()

            def deliver(update):  # on the scheduler's thread
                try:
                    loop.call_soon_threadsafe(updates.put_nowait, update)
                except RuntimeError:  # the event loop closed (server shutting down)
                    pass
            eos = [] if body.get("ignore_eos") else scheduler.eos  # vLLM's extension: outputs of a set length
            job = scheduler.submit(Request(prompt, params, deliver, eos))
        except InputError as exc:
            return error(ApiError(400, str(exc)))
        except ApiError as exc:
            return error(exc)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": served}
        if stream:
            return StreamingResponse(stream_events(job, updates, head, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, entries, finish, count = "", [], None, 0
        try:
            while finish is None:
                update = await updates.get()
                text += update.text
                entries += update.logprobs
                finish, count = update.finish_reason, update.completion_tokens
        finally:
            job.cancel()  # a client gone before the end: the request leaves the batch
        if finish == "error":
            return error(failed())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": chat_logprobs(tokenizer, entries) if params.logprobs is not None else None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": completion_logprobs(tokenizer, entries, 0, text)
                      if params.logprobs is not None else None}
        return JSONResponse({**head, "choices": [choice], "usage": usage(len(prompt), count)})

    async def stream_events(job, updates, head, chat: bool, include_usage: bool):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choice, extra=None):
            return f"data: {json.dumps({**head, 'choices': [choice], **(extra or {})})}\n\n"
        sent = 0
        try:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            while True:
                update = await updates.get()
                if update.finish_reason == "error":
                    yield f"data: {json.dumps(failed().body())}\n\n"
                    break
                if update.text or update.logprobs or update.finish_reason:
                    logprobs = None
                    if job.params.logprobs is not None:
                        logprobs = chat_logprobs(tokenizer, update.logprobs) if chat else \
                            completion_logprobs(tokenizer, update.logprobs, sent, update.text)
                    delta = {"content": update.text} if update.text or not update.finish_reason else {}
                    choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": update.text}
                    yield event({**choice, "logprobs": logprobs, "finish_reason": update.finish_reason})
                    sent += len(update.text)
                if update.finish_reason:
                    if include_usage:
                        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(len(job.prompt), update.completion_tokens)})}\n\n"  # noqa: E501
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # the client went away mid-stream: its row leaves the batch at the next step

    routes = [Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes)
