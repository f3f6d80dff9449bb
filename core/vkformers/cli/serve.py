"""``vkformers serve``: an OpenAI-compatible HTTP server, with continuous batching of the requests.

    vkformers serve                                     # the bundled SmolLM2-135M-Instruct on 127.0.0.1:8000
    vkformers serve --model ./my-checkpoint --adapter ./my-lora --port 8080 --api-key secret
    vkformers serve --model ./base --adapter sql=./sql-lora --adapter chat=./chat-lora  # requests pick by "model"
    vkformers serve --model org/base --adapter sql=org/sql-lora  # adapters from the hub, as vLLM's --lora-modules
    vkformers serve --model org/Model-GGUF:Q4_K_M      # one GGUF file of a hub repo, by its quantization tag
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions (streamed as
server-sent events with ``"stream": true``), POST /v1/responses (OpenAI's Responses API over the chat route's
machinery, cli/responses.py; GET and DELETE /v1/responses/{id} for the responses it stored), GET /health, GET
/metrics (Prometheus text), vLLM's POST /tokenize and /detokenize, and llama.cpp's POST /infill for editors'
fill-in-the-middle (cli/infill_route.py). The requests run through a
BatchScheduler (models/batching.py), over a paged KV cache (models/paged_cache.py) sized from
``--gpu-memory-utilization`` or ``--kv-cache-tokens``. Before the server listens, a warm-up records the decode steps
and prefills the first requests replay (BatchScheduler.warm_up; ``--no-warmup``, ``--warmup-batch-sizes``,
``--warmup-prompt-widths``). An embedding model (a sentence-transformers folder, or an
encoder such as BERT) is served on POST /v1/embeddings instead, through SentenceTransformer (models/sentence.py) on
one worker thread; a reranker (a cross-encoder of one label) on POST /rerank and /score (cli/rerank.py), through
CrossEncoder (models/cross_encoder.py). Needs the ``serve`` extra (Starlette and uvicorn): ``pip install
'vkformers[serve]'``.

This module holds the command (its options, loading the model, the listening socket) and the application with its
routes. A request's body is read in cli/completion_request.py (sampling settings), cli/output_constraints.py
(grammars, forced tool calls) and cli/request_prompts.py (prompts, chat templates); its output shaped in
cli/completion_output.py; embeddings in cli/embeddings_route.py; errors and field checks in cli/api_schema.py.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from vkformers.cli import generate as cli_generate
from vkformers.cli.api_schema import ApiError, number_field, prometheus_text, while_connected
from vkformers.cli.completion_output import (Output, chat_logprobs, completion_logprobs, held_updates, joined_logprobs,
                                             refusal, usage, vllm_prompt_logprobs)
from vkformers.cli.completion_request import (choice_params, echoes, model_sampling_defaults, sampling_params,
                                              shown_prompt_logprobs, stop_token_ids, stream_usage)
from vkformers.cli.embeddings_route import (Embedder, embedding_data, embedding_format, embedding_inputs,
                                            embedding_prometheus)
from vkformers.cli.infill_route import InfillRoute
from vkformers.cli.model_option import MODEL_SPELLINGS, add_gguf_file_option, gguf_model_name, resolve_model
from vkformers.cli.options import positive_int, template_variables, whole_number, whole_numbers
from vkformers.cli.output_constraints import forced_tool_call
from vkformers.cli.request_prompts import (chat_prompt, chat_text, completion_prompt, completion_prompts,
                                           completion_suffix, echoed_prompts, generation_prompt, prompt_ids)
from vkformers.cli.rerank import RERANK_ROUTES, SCORE_ROUTES, Reranker, rerank_prometheus
from vkformers.cli.responses import (ResponseEvents, ResponseStore, chat_request, conversation, finished, output_items,
                                     renamed, response_head, stores)
from vkformers.engine.quantized import QUANTIZE_FORMATS
from vkformers.errors import InputError, VkformersError
from vkformers.models.batching import BatchScheduler, Request, SamplingParams, SchedulerStopped
from vkformers.models.seq2seq_serving import EncoderDecoderScheduler
from vkformers.models.fill_in_middle import fill_in_middle_tokens
from vkformers.models.generation_settings import end_token_ids
from vkformers.models.loading import AutoTokenizer
from vkformers.models.paged_cache import PAGE_SIZE, KVBlocksExhausted
from vkformers.models.lora import check_adapter_folder, load_adapter, merge_lora, resolve_adapter, serve_adapters
from vkformers.models.reasoning import ANSWER, OPENING, REASONING_PARSERS, ReasoningStream
from vkformers.models.sentence import SentenceTransformer, is_cross_encoder_checkpoint, is_embedding_checkpoint
from vkformers.models.structured_output import after_thinking
from vkformers.models.tool_calls import TOOL_CALL_PARSERS, FirstCallOnly, NamedCallStream, NamedToolCall

INSTALL_HINT = "vkformers serve needs Starlette and uvicorn: pip install 'vkformers[serve]'"
MAX_CHOICES = 128               # OpenAI's bound on n; here also on prompts x n of a batch of prompts
DEFAULT_MEMORY_SHARE = 0.9      # vLLM's default gpu_memory_utilization


def add_parser(subparsers):
    parser = subparsers.add_parser("serve", help="serve a causal LM, an embedding model or a reranker over an "
                                                 "OpenAI-compatible HTTP API",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("model_name", nargs="?", default=None, metavar="MODEL",
                        help="the model, as vLLM's `vllm serve MODEL` takes it (the same as --model)")
    parser.add_argument("--model", default=None,
                        help=f"{MODEL_SPELLINGS} (default: {cli_generate.DEFAULT_MODEL_FILE} from the "
                             f"{cli_generate.DEFAULT_MODEL_PACKAGE} package); a sentence-transformers "
                             "folder or an encoder is served on /v1/embeddings, a cross-encoder of one label (a "
                             "reranker) on /v1/rerank and /v1/score")
    add_gguf_file_option(parser)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder, hub repo id or org/repo:QUANT for a causal LM (default: the model's "
                             "own; a .gguf file's from its metadata)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the API (default: a .gguf file's stem, a split one's without "
                             "its part number, else --model as given; "
                             "SmolLM2-135M-Instruct for the bundled model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=whole_number(1, 65535), default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--max-batch", "--max-num-seqs", type=positive_int, default=64,
                        help="most requests decoded together; more wait (default 64)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="most tokens of a request, prompt and output (default: the model's positions)")
    parser.add_argument("--gpu-memory-utilization", type=memory_share, default=DEFAULT_MEMORY_SHARE,
                        help="share of the device's memory this server may take, weights included: the paged KV "
                             "cache (blocks of 16 tokens shared by all requests) gets what is left of it after the "
                             "weights and a reserve for activations (default 0.9, as vLLM's)")
    parser.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                        help="size the paged KV cache in tokens instead of from --gpu-memory-utilization; requests "
                             "wait, or the newest is preempted, when it is full")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="compute every prompt in full (default: a prompt starting with the full blocks of an "
                             "earlier one, a shared system prompt, takes their keys and values from the paged cache "
                             "and prefills only the rest)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="serve at once: the first requests of each shape build and record their decode steps "
                             "and prefills (by default they are recorded before the server listens)")
    parser.add_argument("--warmup-batch-sizes", type=whole_numbers(1), default=None, metavar="N,...",
                        help="batch sizes (rows) whose decode steps the warm-up records (default on a GPU: every "
                             "batch size the scheduler runs, powers of two up to --max-batch; on a CPU device none; "
                             "'none': none)")
    parser.add_argument("--warmup-prompt-widths", type=whole_numbers(1), default=None, metavar="N,...",
                        help="widths (columns) of prompts whose prefills the warm-up records, alone and joining a "
                             "batch (default on a GPU: 64,128,256,512,1024, the widths of prompts of up to 1,024 "
                             "tokens; on a CPU device none; 'none': none)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="weights and activations (auto: the checkpoint's; float32 for .gguf)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZE_FORMATS,
                        help="pack a safetensors checkpoint's Linear weights in this block format while loading")
    parser.add_argument("--adapter", action="append", default=[], metavar="[NAME=]DIR_OR_REPO",
                        help="a PEFT LoRA adapter folder or hub repo id: DIR_OR_REPO is merged into the weights at "
                             "load (one at most); NAME=DIR_OR_REPO (repeatable) is served beside the base model, "
                             "unmerged, to requests whose 'model' is NAME, rows of different adapters sharing a batch "
                             "(as vLLM's --lora-modules)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the Jinja chat template for /v1/chat/completions, a file or the template itself "
                             "(default: the tokenizer's), as vLLM's option")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="answer chat requests with 'tools' (tool_choice 'auto'): the tools go to the chat "
                             "template and the model's calls come back as 'tool_calls' (needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                        help="the model's format of tool calls: hermes (Hermes, Qwen 2.5 and Qwen 3: JSON between "
                             "<tool_call> tags), llama3_json (Llama 3.1-3.3: the reply a JSON call), mistral "
                             "([TOOL_CALLS] and a JSON list)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="give a thinking model's reasoning apart from its answer on the chat and Responses "
                             "routes ('reasoning' and 'reasoning_content' of the message, a reasoning item): "
                             "deepseek_r1 (DeepSeek-R1 and its distills, QwQ: the reply is reasoning up to "
                             "</think>), qwen3 (Qwen3: reasoning between <think> and </think>, a reply that opens "
                             "none all answer)")
    parser.add_argument("--default-chat-template-kwargs", type=template_variables, default=None, metavar="JSON",
                        help="variables for the chat template that requests do not set in their "
                             "'chat_template_kwargs', a JSON object such as '{\"enable_thinking\": false}'")
    parser.add_argument("--api-key", default=os.environ.get("VKFORMERS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VKFORMERS_API_KEY)")
    parser.add_argument("--sampling-defaults", default="model", choices=("model", "openai"),
                        help="what a request's missing temperature, top_p, top_k and min_p are: the model's "
                             "generation config's where it sets them, as vLLM takes them (model, the default), or "
                             "OpenAI's 1.0 and 1.0 and none of the others (openai)")
    parser.add_argument("--device", type=int, default=None, help="Vulkan device index (default: $VKFORMERS_DEVICE or 0)")
    parser.set_defaults(func=run)
    return parser


def memory_share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def web_modules():
    """Starlette and uvicorn, or a VkformersError saying how to install them."""
    try:
        import starlette  # noqa: F401  (the optional [serve] extra: the core command line runs without it)
        import uvicorn
    except ImportError:
        raise VkformersError(INSTALL_HINT) from None
    return uvicorn


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use or an unknown host is said at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise VkformersError(f"--host {host}: not an address this machine can listen on ({exc.strerror}); give one "
                             f"such as 127.0.0.1, or 0.0.0.0 for every interface") from None
    sock = socket.socket(family, kind, proto)
    if os.name != "nt":  # as uvicorn does: restart at once on a port left in TIME_WAIT (Windows would share the port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise VkformersError(f"port {port} on {host} is in use: stop what listens there, or pick another "
                                 f"--port") from None
        raise VkformersError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --host or "
                             f"--port") from None
    return sock


def run(args) -> int:
    uvicorn = web_modules()
    with listening_socket(args.host, args.port) as sock:
        return serve(args, uvicorn, sock)


def serve(args, uvicorn, sock: socket.socket) -> int:
    if args.model_name is not None:
        if args.model is not None and args.model != args.model_name:
            raise VkformersError(f"the model is given twice ({args.model_name} and --model {args.model}): give one")
        args.model = args.model_name
    if args.device is not None:
        os.environ["VKFORMERS_DEVICE"] = str(args.device)
    served = args.served_model_name or served_name(args.model, args.gguf_file)
    args.model = resolve_model(args.model, args.gguf_file)  # a hub repo's GGUF file fetched: its local path
    args.tokenizer = resolve_model(args.tokenizer, option="--tokenizer")
    model_name = args.model or cli_generate.default_model()
    scheduler = None
    merged, named = adapter_options(args.adapter)
    reranks = args.model is not None and is_cross_encoder_checkpoint(model_name)
    embeds = args.model is not None and is_embedding_checkpoint(model_name)
    if (reranks or embeds) and (args.quantization is not None or args.adapter or args.tokenizer is not None
                                or args.reasoning_parser is not None):
        raise VkformersError("--quantization, --adapter, --tokenizer and --reasoning-parser apply to causal LMs; an "
                             "embedding model or a reranker is served as it is")
    if reranks:
        reranker = Reranker.load(model_name, args.dtype, batch_size=args.max_batch)
        app, close = build_app(None, reranker.model.tokenizer, served, api_key=args.api_key, reranker=reranker), \
            reranker.close
    elif embeds:
        embedder = Embedder(SentenceTransformer(model_name, dtype=args.dtype), batch_size=args.max_batch)
        app, close = build_app(None, embedder.model.tokenizer, served, api_key=args.api_key, embedder=embedder), \
            embedder.close
    else:
        # hub repo ids fetched, and every adapter checked, before minutes of model loading
        merged_folder = resolve_adapter(merged) if merged is not None else None
        folders = {name: resolve_adapter(value) for name, value in named.items()}
        for folder in ([merged_folder] if merged_folder is not None else []) + list(folders.values()):
            check_adapter_folder(folder)
        if served in named:
            raise VkformersError(f"--adapter {served}=...: the base model is served as '{served}'; name the adapter "
                                 "otherwise")
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_name)
        if args.chat_template is not None:
            tokenizer.chat_template = read_chat_template(args.chat_template)
        if args.reasoning_parser is not None:
            check_reasoning_tags(tokenizer, args.reasoning_parser)
        model = cli_generate.load_model(model_name, args.dtype, quantization=args.quantization)
        if merged_folder is not None:
            merge_lora(load_adapter(model, merged_folder))
        if hasattr(model, "generation_encoder_states"):  # an encoder-decoder: its prompts are the encoder's input
            if folders:
                raise VkformersError(f"{model_name}: an encoder-decoder is served without --adapter NAME=DIR (its "
                                     "requests run in groups on one model); merge the adapter with --adapter DIR")
            if args.kv_cache_tokens is not None:
                raise VkformersError(f"{model_name}: an encoder-decoder is served without --kv-cache-tokens (each "
                                     "group of requests keeps its own decoder cache); leave it out")
            scheduler = EncoderDecoderScheduler(model, tokenizer, max_batch=args.max_batch,
                                                max_model_len=args.max_model_len, eos=eos_ids(model, tokenizer))
        else:
            selector = serve_adapters(model, folders) if folders else None
            blocks = None if args.kv_cache_tokens is None else -(-args.kv_cache_tokens // PAGE_SIZE) + 1  # + scratch
            scheduler = BatchScheduler(model, tokenizer, max_batch=args.max_batch, max_model_len=args.max_model_len,
                                       eos=eos_ids(model, tokenizer), kv_blocks=blocks,
                                       gpu_memory_utilization=None if blocks else args.gpu_memory_utilization,
                                       prefix_caching=args.prefix_caching, adapters=selector,
                                       cache_salt=f"{model_name}|{args.dtype}|{args.quantization}|{merged}")
        defaults = model_sampling_defaults(model) if args.sampling_defaults == "model" else {}
        if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
            raise VkformersError("--enable-auto-tool-choice and --tool-call-parser go together: give both or neither")
        app, close = build_app(scheduler, tokenizer, served, api_key=args.api_key, sampling_defaults=defaults,
                               adapters=named, tool_call_parser=args.tool_call_parser,
                               reasoning_parser=args.reasoning_parser,
                               chat_template_kwargs=args.default_chat_template_kwargs), scheduler.close
        if args.warmup:  # before the server listens: /health answers once the first requests replay
            warmed = scheduler.warm_up(args.warmup_batch_sizes, args.warmup_prompt_widths)
            if warmed.ran:
                print(f"vkformers serve: {warmed.summary()}", file=sys.stderr, flush=True)
        scheduler.start()
    print(f"vkformers serve: {served} on http://{args.host}:{args.port}/v1 (ready when /health answers)",
          file=sys.stderr, flush=True)
    if scheduler is not None:
        print(f"vkformers serve: {scheduler.kv_cache_summary()}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down on Ctrl-C, then raised it again
        pass
    finally:
        close()
    if not server.started:
        raise VkformersError(f"the server on {args.host}:{args.port} did not start; rerun with --debug to see why")
    return 0


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself where it names no file and holds Jinja."""
    path = Path(os.path.expanduser(value))
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise VkformersError(f"--chat-template {value}: cannot read it ({exc})") from None
    if "{{" not in value and "{%" not in value:
        raise VkformersError(f"--chat-template {value}: no such file, and not a Jinja template; give a file or the "
                             "template text")
    return value


def check_reasoning_tags(tokenizer, name: str) -> None:
    """--reasoning-parser NAME reads the thinking's tags in the output's text, which leaves out special tokens: a
    tokenizer that makes a tag one is refused."""
    tags = REASONING_PARSERS[name]()
    for tag in (tags.start, tags.end):
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        if tokenizer.decode(ids, skip_special_tokens=True) != tag:
            raise VkformersError(f"--reasoning-parser {name}: this tokenizer makes {tag} a special token, which the "
                                 "output's text leaves out, so the reasoning cannot be told apart; serve without "
                                 "--reasoning-parser, or give a --tokenizer whose thinking tags are text")


def adapter_options(values: list[str]) -> tuple[str | None, dict[str, str]]:
    """--adapter's values: (the folder or hub repo id merged into the weights, or None; name -> folder or repo id of
    those served by name), as given. NAME=DIR names an adapter where NAME holds no path separator and the whole value
    is no existing folder."""
    merged, named = None, {}
    for value in values:
        name, _, folder = value.partition("=")
        if folder and name and "/" not in name and os.sep not in name and not Path(value).is_dir():
            if name in named:
                raise VkformersError(f"--adapter {name}=...: the name is given twice; give each adapter its own")
            named[name] = folder
        elif merged is not None:
            raise VkformersError("one --adapter DIR at most is merged into the weights; serve more side by side as "
                                 "--adapter NAME=DIR")
        else:
            merged = value
    return merged, named


def served_name(model: str | None, gguf_file: str | None = None) -> str:
    """The model's name in the API: the bundled model's, a .gguf file's (or --gguf-file's) stem, a split GGUF's
    without its part number, else --model as given (org/repo:QUANT too)."""
    if model is None:
        return cli_generate.DEFAULT_MODEL_FILE.split(".")[0]
    return gguf_model_name(model, gguf_file) or model.rstrip("/")


def eos_ids(model, tokenizer) -> list[int]:
    """Where a request's completion stops, as vkformers generate stops (models/generation_settings.py)."""
    return end_token_ids(model, tokenizer)


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
            ("decode_steps_replayed_total", "counter", "batched decode steps replayed from their recorded plan",
             m.replayed_steps),
            ("batch_rebuilds_total", "counter", "prefills of the running batch (requests joining)", m.rebuilds),
            ("prefills_total", "counter", "prefill forwards (chunks of rebuilds and of joining prompts)", m.prefills),
            ("prefills_replayed_total", "counter", "prefill forwards replayed from their recorded plan",
             m.prefill_replays),
            ("requests_running", "gauge", "requests in the running batch", m.live_rows),
            ("requests_waiting", "gauge", "requests waiting for a place in the batch", m.waiting),
            ("batch_rows", "gauge", "rows of the running batch, masked ones included", m.batch_rows),
            ("batch_occupancy", "gauge", "mean share of live rows over decode steps",
             m.occupancy_sum / m.steps if m.steps else 0.0),
            ("kv_cache_tokens", "gauge", "KV cache entries held by the running batch (rows x length)",
             m.cache_tokens),
            ("kv_cache_blocks", "gauge", "blocks of the paged KV cache (0: contiguous caches)", m.kv_blocks),
            ("kv_cache_blocks_used", "gauge", "blocks of the paged KV cache held by requests", m.kv_blocks_used),
            ("preemptions_total", "counter", "requests sent back to wait for KV blocks (recomputed)", m.preemptions),
            ("batch_compactions_total", "counter", "paged: columns every row had to spare given back (no copy)",
             m.compactions),
            ("prefill_tokens_total", "counter", "prompt tokens computed by prefills (prefix cache hits excluded)",
             m.prefill_tokens),
            ("prompt_logprob_tokens_total", "counter", "prompt tokens whose log-probabilities were computed (echo "
             "with logprobs, prompt_logprobs)", m.prompt_logprob_tokens),
            ("prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache",
             m.prefix_queried_tokens),
            ("prefix_cache_hits_total", "counter", "prompt tokens whose keys and values came from the prefix cache",
             m.prefix_hit_tokens),
            ("kv_cache_blocks_cached", "gauge", "blocks of the paged KV cache kept for prefix caching",
             m.kv_blocks_cached),
            ("kv_cache_blocks_evicted_total", "counter", "cached blocks taken back for new tokens",
             m.kv_blocks_evicted),
            ("decode_seconds_total", "counter", "scheduler time in decode steps (GPU waits included)",
             m.decode_seconds),
            ("prefill_seconds_total", "counter", "scheduler time in prefills (GPU waits included)", m.prefill_seconds),
            ("sampling_seconds_total", "counter", "scheduler time choosing tokens and streaming them",
             m.choose_seconds),
            ("time_to_first_token_seconds_sum", "counter", "summed time to first token", m.ttft_sum),
            ("time_to_first_token_seconds_count", "counter", "requests with a first token", m.ttft_count)]
    return prometheus_text(rows, label)


class LoopMailbox:
    """Hands items from other threads to asyncio queues of one event loop, waking the loop once for all the items
    posted before it runs: the scheduler's thread posts every row's token of a step, which would otherwise wake the
    loop (a write to its self-pipe, and a switch of threads) once per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list = []

    def post(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:
                return  # the drain already scheduled delivers it, in order
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop closed (server shutting down)
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


def build_app(scheduler: BatchScheduler | None, tokenizer, served: str, *, api_key: str | None = None,
              embedder: Embedder | None = None, sampling_defaults: dict | None = None, adapters: dict | None = None,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              chat_template_kwargs: dict | None = None, reranker: Reranker | None = None):
    """The Starlette application serving ``scheduler``'s causal LM, ``embedder``'s embedding model or
    ``reranker``'s cross-encoder under the name ``served``; the routes of the other kinds answer 400.
    ``sampling_defaults``: see completion_request.sampling_params.
    ``adapters``: name -> folder of the scheduler's adapters (in its order), each also served under its name.
    ``tool_call_parser``: a TOOL_CALL_PARSERS name, for chat requests with tools (models/tool_calls.py).
    ``reasoning_parser``: a REASONING_PARSERS name, whose reasoning the chat and Responses routes give apart from
    the answer (models/reasoning.py). ``chat_template_kwargs``: template variables of requests that do not set
    them (--default-chat-template-kwargs)."""
    web_modules()
    # the optional [serve] extra, imported once the command runs (web_modules said how to install it)
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    created = int(time.time())
    stored = ResponseStore()
    mailboxes: dict = {}  # the event loop's LoopMailbox (one loop serves the app)

    def mailbox_of(loop) -> LoopMailbox:
        if mailboxes.get("loop") is not loop:
            mailboxes.update(loop=loop, mailbox=LoopMailbox(loop))
        return mailboxes["mailbox"]

    adapters = dict(adapters or {})
    names = [served, *adapters]

    def model_card(name: str = served) -> dict:
        card = {"id": name, "object": "model", "created": created, "owned_by": "vkformers"}
        if name in adapters:  # as vLLM lists its LoRA modules
            card.update(root=str(adapters[name]), parent=served)
        if scheduler is not None or reranker is not None:  # as vLLM's
            card["max_model_len"] = scheduler.max_model_len if scheduler is not None else reranker.model.max_length
        return card

    def unknown_model(name) -> ApiError:
        listed = ", ".join(f"'{n}'" for n in names)
        return ApiError(404, f"the model '{name}' does not exist; this server serves {listed}", param="model",
                        code="model_not_found")

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
        if model is not None and model not in names:
            raise unknown_model(model)
        return body

    async def route_body(request, route: str, runner) -> dict:
        """An authorized request's JSON body, for a route that runs on ``runner`` (the scheduler or the embedder:
        a 400 when this server has the other kind)."""
        authorize(request)
        body = await read_body(request)
        if runner is None:
            raise wrong_kind(route)
        return body

    async def health(request):
        if scheduler is not None and scheduler.error is not None:
            return JSONResponse({"status": "error", "error": str(scheduler.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        text = prometheus(scheduler, served) if scheduler is not None else \
            embedding_prometheus(embedder, served) if embedder is not None else rerank_prometheus(reranker, served)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def models(request):
        try:
            authorize(request)
        except ApiError as exc:
            return error(exc)
        return JSONResponse({"object": "list", "data": [model_card(name) for name in names]})

    async def model_info(request):
        try:
            authorize(request)
            if request.path_params["model"] not in names:
                raise unknown_model(request.path_params["model"])
        except ApiError as exc:
            return error(exc)
        return JSONResponse(model_card(request.path_params["model"]))

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    def wrong_kind(route: str) -> ApiError:
        kind = "a causal LM: it answers POST /v1/completions, /v1/chat/completions and /v1/responses" \
            if scheduler is not None else "an embedding model: it answers POST /v1/embeddings" \
            if embedder is not None else "a reranker: it answers POST /v1/rerank and /v1/score"
        return ApiError(400, f"{route} is not served for '{served}', {kind}", code="model_not_supported")

    thinking = REASONING_PARSERS[reasoning_parser]() if reasoning_parser is not None else None
    infill = fill_in_middle_tokens(tokenizer) if scheduler is not None else None  # for completions with a suffix
    thinking_tokens = thinking.tag_tokens(tokenizer) if thinking is not None else (None, None)

    def chat_reply(body: dict) -> tuple[list[int], str | None]:
        """A chat request's prompt ids, and where its reply starts (ThinkingTags.reply_start: THINKING, OPENING or
        ANSWER) where the server reads reasoning; None where it does not."""
        text = chat_text(body, tokenizer, chat_template_kwargs)
        start = None if thinking is None else \
            thinking.reply_start(generation_prompt(body, tokenizer, chat_template_kwargs, text))
        return prompt_ids(tokenizer, text), start

    def after_reasoning(params: SamplingParams, start: str | None) -> SamplingParams:
        """``params`` whose output grammar (response_format, guided decoding, a forced tool call) keeps to the
        answer only: a reply that may think first thinks freely up to its closing tag, as vLLM applies the grammar
        once the reasoning ends."""
        grammar = params.output_grammar
        if start in (None, ANSWER) or grammar is None:
            return params
        try:
            grammar = after_thinking(grammar, (thinking.start, thinking.end), thinking_tokens,
                                     opened=start != OPENING)
        except VkformersError as exc:  # (one that compiled alone: not expected)
            raise ApiError(400, f"the output's grammar cannot follow the reasoning: {exc}") from None
        return replace(params, grammar=grammar)

    def shows_reasoning(body: dict) -> bool:
        """vLLM's include_reasoning: false leaves the reasoning out of the response."""
        include = body.get("include_reasoning", True)
        if not isinstance(include, bool):
            raise ApiError(400, f"'include_reasoning' must be true or false, got {include!r}",
                           param="include_reasoning")
        return include

    def splits(start: str | None, count: int) -> list[ReasoningStream] | None:
        return None if start is None else [ReasoningStream(thinking, start) for _ in range(count)]

    def tool_parser(body: dict):
        """The parser that reads tool calls from a chat request's reply, or None (the reply is text): a forced tool
        choice's, or where the server has one and the request gives tools it may call."""
        forced = forced_tool_call(body)
        if forced is not None:
            return forced[1]
        if tool_call_parser is None or not body.get("tools") or body.get("tool_choice") == "none":
            return None
        parser = TOOL_CALL_PARSERS[tool_call_parser]()
        return FirstCallOnly(parser) if body.get("parallel_tool_calls") is False else parser

    def submit(body: dict, jobs, ends=()) -> tuple[list[Request], asyncio.Queue]:
        """A call's (prompt ids, SamplingParams) ``jobs`` handed to the scheduler, with the call's end tokens (and
        ``ends``, a fill-in-the-middle prompt's) and adapter: the requests, and the queue their updates come on as
        (index, Update). Where the scheduler refuses one, none is queued."""
        mailbox = mailbox_of(asyncio.get_running_loop())
        updates: asyncio.Queue = asyncio.Queue()

        def deliver(index):
            def on_update(update):  # on the scheduler's thread
                mailbox.post(updates, (index, update))
            return on_update
        eos = [] if body.get("ignore_eos") else scheduler.eos + list(ends)  # vLLM's: outputs of a set length
        eos = eos + stop_token_ids(body)
        adapter = names.index(body.get("model") or served) if scheduler.adapters is not None else 0
        requests = scheduler.submit_all([Request(prompt, params, deliver(index), eos, adapter)
                                         for index, (prompt, params) in enumerate(jobs)])
        return requests, updates

    async def outputs(request, jobs: list[Request], updates: asyncio.Queue, start: str | None = None) -> list[Output]:
        """The whole output of each of a call's requests, once all have finished (split into reasoning and answer
        from ``start``, chat_reply's, where the server reads reasoning). Raises ApiError 499 when the client leaves
        meanwhile (while_connected), 500 when their batch fails; the requests leave the batch either
        way."""
        done = [Output(reasoning=split) for split in splits(start, len(jobs)) or [None] * len(jobs)]

        async def collect() -> list[Output]:
            while any(out.finish_reason is None for out in done):
                index, update = await updates.get()
                if update.finish_reason == "error":
                    raise failed()
                done[index].add(update)
            return done
        try:
            return await while_connected(request, collect())
        finally:
            for job in jobs:
                job.cancel()  # a client gone before the end: the requests leave the batch

    async def complete(request, chat: bool):
        try:
            body = await route_body(request, "/v1/chat/completions" if chat else "/v1/completions", scheduler)
            prompt, start = chat_reply(body) if chat else (None, None)
            prompts = [prompt] if chat else completion_prompts(body, tokenizer, infill)
            settings = [after_reasoning(sampling_params(body, chat=chat, prompt_tokens=len(p),
                                                        max_model_len=scheduler.max_model_len,
                                                        defaults=sampling_defaults, tools=tool_call_parser is not None),
                                        start)
                        for p in prompts]
            parser = tool_parser(body) if chat else None
            show_reasoning = shows_reasoning(body) if chat else True
            params = settings[0]
            echo, shown = echoes(body, chat), shown_prompt_logprobs(body, chat)
            n = number_field(body, "n", 1, int, 1, MAX_CHOICES)
            if len(prompts) * n > MAX_CHOICES:
                raise ApiError(400, f"{len(prompts)} prompts x n={n} make more than {MAX_CHOICES} choices; send fewer "
                                    "prompts a request", param="prompt")
            prompt_tokens = sum(len(p) for p in prompts)
            stream = bool(body.get("stream"))
            include_usage = stream_usage(body)
            jobs = [(prompt, p) for prompt, each in zip(prompts, settings) for p in choice_params(each, n)]
            if chat:  # one prompt_logprobs for the response (vLLM's): its first choice's
                jobs[1:] = [(prompt, replace(p, prompt_logprobs=None)) for prompt, p in jobs[1:]]
            echoed = [text for text in echoed_prompts(body, tokenizer, prompts) for _ in range(n)] if echo else None
            name = body.get("model") or served
            choices, updates = submit(body, jobs, () if chat or completion_suffix(body) is None else infill.end)
        except (ApiError, InputError, KVBlocksExhausted, SchedulerStopped) as exc:
            return error(refusal(exc))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": name}
        if stream:
            return StreamingResponse(stream_events(choices, updates, head, chat, include_usage, prompt_tokens, parser,
                                                   echoed, splits(start, len(choices)), show_reasoning),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            done = await outputs(request, choices, updates, start)
        except ApiError as exc:
            return error(exc)
        results = []
        for index, out in enumerate(done):
            if chat:
                message, reason = chat_message(out, parser, show_reasoning)
                results.append({"index": index, "message": message, "logprobs": chat_logprobs(tokenizer, out.logprobs)
                                if params.logprobs is not None else None, "finish_reason": reason})
            else:
                text, logprobs = out.text, None
                if params.logprobs is not None:
                    logprobs = completion_logprobs(tokenizer, out.logprobs, len(echoed[index]) if echo else 0,
                                                   params.logprobs)
                if echo:  # the prompt and its entries first (the completion's text offsets counted after it)
                    text = echoed[index] + text
                    if logprobs is not None:
                        logprobs = joined_logprobs(completion_logprobs(tokenizer, out.prompt_logprobs, 0,
                                                                       params.logprobs), logprobs)
                results.append({"index": index, "text": text, "finish_reason": out.finish_reason,
                                "logprobs": logprobs})
                if shown is not None:  # vLLM's: on each choice
                    results[-1]["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out.prompt_logprobs, shown)
        thought = sum(o.reasoning.reasoning_tokens for o in done) if start is not None else None
        answer = {**head, "choices": results, "usage": usage(prompt_tokens, sum(o.tokens for o in done), thought)}
        if chat and shown is not None:  # vLLM's: on the response
            answer["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, done[0].prompt_logprobs, shown)
        return JSONResponse(answer)

    def chat_message(out: Output, parser, show_reasoning: bool) -> tuple[dict, str]:
        """A whole chat reply's message and finish reason: its reasoning apart where the server reads reasoning
        (``show_reasoning``: in the message), the calls of its answer where ``parser`` reads tool calls."""
        content, reasoning = out.answer()
        message, reason = {"role": "assistant", "content": content}, out.finish_reason
        if parser is not None and content is not None:
            text, calls = parser.parse(content)
            if calls:
                message.update(content=text, tool_calls=[call.api() for call in calls])
                reason = parser.finish_reason
        if out.reasoning is not None:  # vLLM's name, and the one of DeepSeek's API and earlier vLLMs
            message["reasoning"] = message["reasoning_content"] = reasoning if show_reasoning else None
        return message, reason

    async def stream_events(choices, updates, head, chat: bool, include_usage: bool, prompt_tokens: int,
                            parser=None, echoed=None, reasoning_splits: list[ReasoningStream] | None = None,
                            show_reasoning: bool = True):
        """``parser``: tool calls are read from each choice's text (held back from where a call may start), each
        call streamed as it comes (its name, then its arguments in pieces), as vLLM streams them. ``echoed``: each
        choice's prompt text, sent (with its entries in logprobs) in the choice's first chunk, as vLLM sends it.
        ``reasoning_splits``: each choice's reasoning is sent apart from its answer (in chunks of their own, its
        ``reasoning`` and ``reasoning_content`` where ``show_reasoning``), the answer alone read for calls."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        named = [NamedCallStream(parser) for _ in choices] if isinstance(parser, NamedToolCall) else None
        unsent = list(echoed) if echoed is not None else [None] * len(choices)  # prompts still to echo

        def event(choice, extra=None):
            return f"data: {json.dumps({**head, 'choices': [choice], **(extra or {})})}\n\n"
        sent, counts = [0] * len(choices), [0] * len(choices)
        logprobs_wanted = choices[0].params.logprobs
        try:
            if chat:
                for index in range(len(choices)):
                    yield event({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
            async for index, thought, text, calls, update, called in held_updates(
                    updates, len(choices), None if named else parser, reasoning_splits, incremental=True):
                if update.finish_reason == "error":
                    yield f"data: {json.dumps(failed().body())}\n\n"
                    break
                reason, extra, entries = update.finish_reason, {}, update.logprobs
                thought = thought if show_reasoning else ""
                if unsent[index] is not None:  # echo: the prompt and its entries first
                    text, entries = unsent[index] + text, (update.prompt_logprobs or []) + entries
                    unsent[index] = None
                if named is not None and text:  # (the call's first chunk waits for its arguments)
                    deltas, text = named[index].feed(text), ""
                    extra = {"tool_calls": deltas} if deltas else {}
                if calls:
                    extra = {"tool_calls": calls}
                if called:
                    reason = parser.finish_reason
                if text or thought or extra or entries or reason:
                    logprobs = None
                    if logprobs_wanted is not None:
                        logprobs = chat_logprobs(tokenizer, entries) if chat else \
                            completion_logprobs(tokenizer, entries, sent[index], logprobs_wanted)
                    delta = {"content": text} if text or not (reason or extra or thought) else {}
                    if thought:
                        delta = {"reasoning": thought, "reasoning_content": thought, **delta}
                    choice = {"index": index, "delta": {**delta, **extra}} if chat else {"index": index, "text": text}
                    yield event({**choice, "logprobs": logprobs, "finish_reason": reason})
                    sent[index] += len(text)
                if update.finish_reason:
                    counts[index] = update.completion_tokens
            else:
                if include_usage:
                    thinking_tokens = sum(s.reasoning_tokens for s in reasoning_splits) if reasoning_splits else None
                    counted = usage(prompt_tokens, sum(counts), thinking_tokens)
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': counted})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for job in choices:
                job.cancel()  # the client went away mid-stream: its rows leave the batch at the next step

    async def create_response(request):
        """OpenAI's Responses API (cli/responses.py): the request run as the chat completions request it amounts
        to, its output given as a response object or the response's typed events."""
        try:
            body = await route_body(request, "/v1/responses", scheduler)
            store = stores(body)
            messages = conversation(body, stored.history(body))
            chat = chat_request(body, messages)
            prompt, start = chat_reply(chat)
            params = after_reasoning(sampling_params(chat, chat=True, prompt_tokens=len(prompt),
                                                     max_model_len=scheduler.max_model_len,
                                                     defaults=sampling_defaults, tools=tool_call_parser is not None),
                                     start)
            parser = tool_parser(chat)
            jobs, updates = submit(chat, [(prompt, params)])
        except (ApiError, InputError, KVBlocksExhausted, SchedulerStopped) as exc:
            return error(renamed(refusal(exc)))
        head = response_head(body, params, model=body.get("model") or served, store=store)

        def logprobs(entries) -> list:
            return chat_logprobs(tokenizer, entries)["content"] if params.logprobs is not None else []

        def keep(response):
            if store:
                stored.keep(response, messages)
        if body.get("stream"):
            return StreamingResponse(stream_response(jobs, updates, parser, ResponseEvents(head), len(prompt),
                                                     logprobs, keep, splits(start, 1)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            (out,) = await outputs(request, jobs, updates, start)
        except ApiError as exc:
            return error(exc)
        content, reasoning = out.answer()
        text, calls = parser.parse(content) if parser is not None and content is not None else (content, [])
        thought = out.reasoning.reasoning_tokens if out.reasoning is not None else 0
        response = finished(head, output_items(text, calls, logprobs(out.logprobs), out.finish_reason, reasoning),
                            out.finish_reason, len(prompt), out.tokens, thought)
        keep(response)
        return JSONResponse(response)

    async def stream_response(jobs, updates, parser, events: ResponseEvents, prompt_tokens: int, logprobs, keep,
                              reasoning_splits: list[ReasoningStream] | None = None):
        """A streamed response's events (ResponseEvents) as its reply comes; ``keep`` takes the whole response.
        ``reasoning_splits`` (one): the reply's reasoning comes as a reasoning item before its answer. Each call
        streams as it comes (a named function's arguments too), as on the chat route."""
        named = NamedCallStream(parser) if isinstance(parser, NamedToolCall) else None
        try:
            yield events.start()
            async for _, thought, text, calls, update, _ in held_updates(
                    updates, 1, None if named else parser, reasoning_splits, incremental=True):
                if update.finish_reason == "error":
                    yield events.fail(failed().message)
                    break
                if named is not None:
                    calls, text = named.feed(text) if text else [], ""
                if events.called:  # text once a call went out: what follows the last whole call (ToolCallStream)
                    chunk = events.add_calls(calls) + events.add_text(text, logprobs(update.logprobs))
                else:
                    chunk = events.add_reasoning(thought) + events.add_text(text, logprobs(update.logprobs)) + \
                        events.add_calls(calls)
                if update.finish_reason:
                    chunk += events.finish(update.finish_reason, prompt_tokens, update.completion_tokens,
                                           reasoning_splits[0].reasoning_tokens if reasoning_splits else 0)
                    keep(events.response)
                if chunk:
                    yield chunk
        finally:
            for job in jobs:
                job.cancel()  # the client went away mid-stream: its row leaves the batch at the next step

    async def stored_response(request):
        """GET (the response object) or DELETE a stored response."""
        try:
            authorize(request)
            if scheduler is None:
                raise wrong_kind("/v1/responses")
            ident = request.path_params["response_id"]
            if request.method == "DELETE":
                stored.delete(ident)
                return JSONResponse({"id": ident, "object": "response.deleted", "deleted": True})
            return JSONResponse(stored.get(ident))
        except ApiError as exc:
            return error(exc)

    async def tokenize(request):
        """vLLM's /tokenize: a completion's ``prompt`` or a chat's ``messages`` as the model reads them."""
        try:
            body = await route_body(request, "/tokenize", scheduler)
            if "messages" in body:
                tokens = chat_prompt(body, tokenizer, chat_template_kwargs)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' must be a string (or give 'messages')", param="prompt")
                add = body.get("add_special_tokens", True)
                tokens = completion_prompt(prompt, tokenizer) if add else \
                    [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
        except ApiError as exc:
            return error(exc)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": scheduler.max_model_len})

    async def detokenize(request):
        """vLLM's /detokenize: token ids back to text."""
        try:
            body = await route_body(request, "/detokenize", tokenizer)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
            vocab = len(tokenizer)
            if any(not 0 <= t < vocab for t in tokens):
                raise ApiError(400, f"a token id is outside the vocabulary of {vocab}", param="tokens")
        except ApiError as exc:
            return error(exc)
        return JSONResponse({"prompt": tokenizer.decode(tokens)})

    async def embeddings(request):
        try:
            body = await route_body(request, "/v1/embeddings", embedder)
            inputs = embedding_inputs(body)
            encoding, dimensions = embedding_format(body, embedder.width)
            try:
                vectors, tokens = await embedder(inputs)
            except VkformersError as exc:  # a token id out of the vocabulary, an input too long
                embedder.metrics.errors += 1
                raise ApiError(400, str(exc), param="input") from None
        except ApiError as exc:
            return error(exc)
        embedder.metrics.requests += 1
        embedder.metrics.inputs += len(inputs)
        embedder.metrics.prompt_tokens += tokens
        return JSONResponse({"object": "list", "data": embedding_data(vectors, encoding, dimensions,
                                                                      embedder.model.normalize),
                             "model": served, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def reranking(route: str, answer):
        """A route of the reranker: ``answer`` (Reranker.rerank or Reranker.score_texts, cli/rerank.py) of the
        request's body."""
        async def handle(request):
            try:
                body = await route_body(request, route, reranker)
                return JSONResponse(await answer(reranker, body, served))
            except ApiError as exc:
                return error(exc)
        return handle

    infilling = InfillRoute(scheduler, tokenizer, served, infill, body=route_body, submit=submit, failed=failed)
    routes = [Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
              Route("/v1/models/{model:path}", model_info),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/responses", create_response, methods=["POST"]),
              Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
              Route("/v1/embeddings", embeddings, methods=["POST"]),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/infill", infilling.answer, methods=["POST"])]
    routes += [Route(path, reranking(path, Reranker.rerank), methods=["POST"]) for path in RERANK_ROUTES]
    routes += [Route(path, reranking(path, Reranker.score_texts), methods=["POST"]) for path in SCORE_ROUTES]
    return Starlette(routes=routes)
