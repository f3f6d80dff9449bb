"""Serving benchmark: ``vkformers serve``'s routes under concurrent streaming clients.

Starts the server in this process (the scheduler and the Starlette app on uvicorn, on a free local port) and, for
each concurrency, runs that many client threads, each streaming its requests one after another through
/v1/completions: random token prompts of --prompt-range tokens, outputs of --output-range tokens (``ignore_eos``,
so that every output has its drawn length). Prints per concurrency the aggregate output tokens/s, time to first
token p50/p99 and inter-token latency p50/p99 (from the arrival times of the streamed events; a chunk of several
tokens counts as that many tokens, spread evenly). --soak N sends N short requests from --soak-threads threads
after a warm-up at that load and prints the process's RSS, the device buffer bytes and the small-object heap
(pymalloc blocks) before and after, and their growth per request, each measured idle with the bounded caches let go
(the scheduler's batch caches, the plan cache, the engine's strides cache), as tests/test_serve_soak.py does.
Each load also prints the scheduler thread's time in decode steps, prefills and sampling; --profile adds the GPU
time per kernel (every plan recorded with timestamps). The server warms up first as ``vkformers serve`` does
(BatchScheduler.warm_up; --no-warmup skips it), so that the replayed prefills and steps each load prints count the
warm-up's effect; the run's own warm-up load (1 client) still runs. --adapters N serves N random LoRA adapters (rank
--adapter-rank on q/k/v/o_proj) beside the base model, unmerged (``vkformers serve --adapter NAME=DIR``): the
requests take the base model and each adapter in turn.

    python bench/serve.py [--model M | --random-shape llama3-8b] [--concurrency 1,8,32,64] [--requests 4] [--quick]
                          [--kv-cache-tokens N | --gpu-memory-utilization F] [--no-prefix-caching] [--no-warmup]
                          [--soak 1000]
                          [--adapters N [--adapter-rank R]] [--no-torch] [--profile] [--json OUT]

--quick: short prompts and outputs, for lavapipe. --random-shape NAME: no download; a Llama of that shape
(llama3-8b: hidden 4096, 32 layers, 32/8 heads, ffn 14336, vocab 128256; tinyllama; --layers to cut it down) with
random bfloat16 weights drawn cheaply as bench/quant.py does (a few rows tiled), and a made-up tokenizer of the
vocabulary's size (the clients send token ids). When torch sees a CUDA GPU (and not --no-torch), the same run ends
with the reference: PyTorch + transformers ``generate`` with a static cache, the same shape (random weights drawn on
the GPU), serving the requests of the --torch-clients load 8 at a time (left-padded, each batch generating its
longest output); its output tok/s counts only the tokens the requests asked for.
"""
from __future__ import annotations

import argparse
import gc
import http.client
import json
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from common import LLAMA3_8B, cuda_torch, run_clients, write_results
from llama import TINYLLAMA
from quant import tiled_weights
from tokenizers import Tokenizer, models

from vkformers.cli import generate as cli_generate
from vkformers.cli import serve as cli_serve
from vkformers.engine import lazy
from vkformers.models import batching
from vkformers.models.batching import BatchScheduler
from vkformers.models.paged_cache import PAGE_SIZE
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.lora import LoraConfig, PEFT_PREFIX, resolve_targets, serve_adapters
from vkformers.models.safetensors_io import write_safetensors
from vkformers.models.tokenizer import PreTrainedTokenizer
from vkformers.runtime.vulkan import buffer_memory


# "tiny": a Llama whose GPU work is negligible, so that a load measures the scheduler's and the server's host work
SHAPES = {"llama3-8b": LLAMA3_8B, "tinyllama": TINYLLAMA,
          "tiny": dict(TINYLLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)}


def random_shape(name: str, layers: int | None):
    """(model, tokenizer, config): a Llama of the named shape with random bfloat16 weights, and a word-level
    tokenizer of one made-up word per id (its eos: none, the clients ask for every token)."""
    config = dict(SHAPES[name])
    if layers:
        config["num_hidden_layers"] = layers
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tiled_weights(model, None), dtype="bfloat16", requires_grad=False)
    model.eval()
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tokenizer = PreTrainedTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="w0")), {})
    return model, tokenizer, config


ADAPTER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def random_adapters(model, count: int, rank: int, folder: Path) -> dict:
    """``count`` PEFT adapter folders of random A and B (rank ``rank`` on ADAPTER_TARGETS) for ``model``: name ->
    folder."""
    rng = np.random.default_rng(7)
    modules = dict(model.named_modules())
    adapters = {}
    for index in range(count):
        tensors = {}
        for name in resolve_targets(model, ADAPTER_TARGETS):
            layer = modules[name]
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (
                rng.standard_normal((rank, layer.in_features)) / np.sqrt(layer.in_features)).astype(np.float32)
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (
                0.01 * rng.standard_normal((layer.out_features, rank))).astype(np.float32)
        adapters[f"adapter{index + 1}"] = where = folder / f"adapter{index + 1}"
        where.mkdir(parents=True)
        write_safetensors(where / "adapter_model.safetensors", tensors, metadata={"format": "pt"})
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ADAPTER_TARGETS)
        (where / "adapter_config.json").write_text(json.dumps(config.to_peft_dict()))
    return adapters


def start_server(model_name, dtype: str, max_batch: int, max_model_len: int | None,
                 kv_cache_tokens: int | None = None, prefix_caching: bool = True, loaded=None,
                 gpu_memory_utilization: float | None = None, adapters: dict | None = None, warmup: bool = True):
    uvicorn = cli_serve.web_modules()
    if loaded is None:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        model = cli_generate.load_model(model_name, dtype)
    else:
        model, tokenizer = loaded
    blocks = None if kv_cache_tokens is None else -(-kv_cache_tokens // PAGE_SIZE) + 1
    selector = serve_adapters(model, adapters) if adapters else None
    scheduler = BatchScheduler(model, tokenizer, max_batch=max_batch, max_model_len=max_model_len,
                               eos=cli_serve.eos_ids(model, tokenizer), kv_blocks=blocks,
                               gpu_memory_utilization=None if blocks else gpu_memory_utilization,
                               prefix_caching=prefix_caching, adapters=selector)
    if warmup:  # as vkformers serve does before it listens
        warmed = scheduler.warm_up()
        if warmed.ran:
            print(warmed.summary(), flush=True)
    scheduler.start()
    app = cli_serve.build_app(scheduler, tokenizer, "bench", adapters=adapters)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return port, scheduler, server, thread, len(tokenizer)


def stream_completion(port: int, prompt: list[int], max_tokens: int,
                      model: str = "bench") -> tuple[float, list[float], int]:
    """(seconds to the first token, seconds between tokens, tokens) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    arrivals, tokens, seen = [], 0, 0
    for line in response:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(event["error"]["message"])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        elif event["choices"][0]["text"] or event["choices"][0]["finish_reason"]:
            arrivals.append(time.perf_counter())
    connection.close()
    if not arrivals:
        raise RuntimeError("no token arrived")
    # the events carry the text as it becomes whole: spread the tokens evenly over the events' times
    seen = max(tokens, len(arrivals))
    times = np.interp(np.linspace(0, len(arrivals) - 1, seen), np.arange(len(arrivals)), arrivals)
    return float(times[0] - start), list(np.diff(times)), tokens


def draw_jobs(vocab: int, clients: int, requests: int, prompt_range, output_range, seed: int, shared: int = 0):
    """Per client, its (prompt ids, max_tokens) requests; every prompt starts with the same ``shared`` tokens (a
    system prompt), the rest drawn to a length in ``prompt_range``."""
    system = np.random.default_rng(12345).integers(100, vocab - 100, shared).tolist()
    rng = np.random.default_rng(seed)
    return [[(system + rng.integers(100, vocab - 100, rng.integers(*prompt_range, endpoint=True)).tolist(),
              int(rng.integers(*output_range, endpoint=True))) for _ in range(requests)] for _ in range(clients)]


def run_load(port: int, vocab: int, clients: int, requests: int, prompt_range, output_range, seed: int,
             shared: int = 0, models=("bench",)) -> dict:
    """``models``: the names requests take in turn (the base model and served adapters)."""
    jobs = draw_jobs(vocab, clients, requests, prompt_range, output_range, seed, shared)
    jobs = [[(prompt, max_tokens, models[(c + i) % len(models)]) for i, (prompt, max_tokens) in enumerate(work)]
            for c, work in enumerate(jobs)]
    ttfts, gaps, totals, errors = [], [], [0], []
    lock = threading.Lock()

    def client(work):
        for prompt, max_tokens, model in work:
            try:
                ttft, between, tokens = stream_completion(port, prompt, max_tokens, model)
            except Exception as exc:  # counted and reported: a failed request is a result here
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                ttfts.append(ttft)
                gaps.extend(between)
                totals[0] += tokens
    elapsed = run_clients(client, jobs)
    pct = lambda values, q: float(np.percentile(values, q)) * 1e3 if values else float("nan")
    return {"clients": clients, "requests": clients * requests, "failed": len(errors),
            "output_tokens_per_s": totals[0] / elapsed, "ttft_ms_p50": pct(ttfts, 50), "ttft_ms_p95": pct(ttfts, 95),
            "ttft_ms_p99": pct(ttfts, 99),
            "itl_ms_p50": pct(gaps, 50), "itl_ms_p99": pct(gaps, 99), "seconds": elapsed,
            "first_error": errors[0] if errors else None}


def torch_reference(torch, config, jobs, batch: int = 8) -> dict:
    """PyTorch + transformers generate (static cache, greedy, bfloat16) of the same shape serving ``jobs``
    ``batch`` at a time: the requests' output tokens over the wall time, and the raw rate (every row's tokens).
    Every batch is left-padded to the longest prompt of all and reuses one static cache, so that the decode step
    transformers compiles on a GPU keeps its shapes (compiled during the warm-up, not timed)."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    settings = {k: v for k, v in config.items() if k != "model_type"}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # drawn in bfloat16 on the GPU: no float32 copy, no host draw
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    finally:
        torch.set_default_dtype(default)
    requests = [job for work in jobs for job in work]
    groups = [requests[i:i + batch] for i in range(0, len(requests), batch)]
    width = max(len(p) for p, _ in requests)
    cache = StaticCache(config=model.config, max_cache_len=width + max(n for _, n in requests))

    def run(group, new=None):
        ids = torch.zeros((batch, width), dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, (prompt, _) in enumerate(group):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        for row in range(len(group), batch):  # a short last group: filler rows, as a static batch runs them
            ids[row, -1], mask[row, -1] = 100, 1
        new = new or max(n for _, n in group)
        cache.reset()
        model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, past_key_values=cache, pad_token_id=0)
        return new

    with torch.no_grad():
        run(groups[0], 8)  # warm-up: kernels, the compiled decode step
        run(groups[0], 8)
        torch.cuda.synchronize()
        start = time.perf_counter()
        raw = sum(batch * run(group) for group in groups)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    model.to("meta")  # its weights' GPU memory back (the cache goes with this call)
    asked = sum(n for _, n in requests)
    return {"reference": f"torch {torch.__version__} transformers generate, static cache, batch {batch}",
            "requests": len(requests), "output_tokens_per_s": asked / elapsed, "raw_tokens_per_s": raw / elapsed,
            "seconds": elapsed}


def phases(metrics) -> dict:
    """The scheduler's counters that say where a load's time went."""
    names = ("decode_seconds", "prefill_seconds", "choose_seconds", "steps", "replayed_steps", "prefills",
             "prefill_replays", "prefill_tokens", "rebuilds", "placements", "occupancy_sum", "generation_tokens")
    return {name: getattr(metrics, name) for name in names}


def print_phases(p: dict, seconds: float) -> None:
    steps = max(p["steps"], 1)
    print(f"     scheduler: decode {p['decode_seconds']:.2f} s ({p['steps']} steps, {p['replayed_steps']} replayed, "
          f"{p['decode_seconds'] / steps * 1e3:.1f} ms each, {p['occupancy_sum'] / steps:.2f} occupancy), prefill "
          f"{p['prefill_seconds']:.2f} s ({p['prefills']} forwards, {p['prefill_replays']} replayed, "
          f"{p['prefill_tokens']} tokens, {p['rebuilds']} rebuilds, {p['placements']} placements), sampling "
          f"{p['choose_seconds']:.2f} s; of {seconds:.2f} s", flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def idle_memory(scheduler) -> tuple[int, int, int]:
    """(RSS, device buffer bytes, pymalloc blocks) with the bounded caches let go."""
    scheduler.release_caches(120)
    lazy.contiguous_strides.cache_clear()
    gc.collect()
    return rss_bytes(), buffer_memory()["live_bytes"], sys.getallocatedblocks()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--random-shape", choices=sorted(SHAPES), default=None,
                        help="no download: a Llama of this shape with random bfloat16 weights (instead of --model)")
    parser.add_argument("--layers", type=int, default=None, help="with --random-shape: fewer layers")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="every prompt starts with the same this many tokens (a system prompt)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--torch-clients", type=int, default=32,
                        help="the reference serves the requests of this load (its seed), 8 at a time")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--prompt-range", default="64,1024")
    parser.add_argument("--output-range", default="64,256")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="a paged KV cache of this many tokens (vkformers serve --kv-cache-tokens)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="without --kv-cache-tokens, the paged KV cache's share of device memory as vkformers "
                             "serve sizes it (default 0.5, not serve's 0.9: the PyTorch reference runs on the same "
                             "GPU afterwards, beside the buffers)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="start without the scheduler's warm-up (vkformers serve --no-warmup)")
    parser.add_argument("--quick", action="store_true", help="prompts of 16-64 and outputs of 8-32 tokens")
    parser.add_argument("--soak", type=int, default=0, help="also send this many short requests")
    parser.add_argument("--soak-threads", type=int, default=16)
    parser.add_argument("--prefill-widths", choices=("bucket", "pow2"), default=None,
                        help="prompt widths: PREFILL_BUCKET multiples, or powers of two and whole chunks "
                             "(batching.PREFILL_POWERS_OF_TWO; default: the scheduler's, pow2)")
    parser.add_argument("--profile", action="store_true",
                        help="GPU time per kernel of each load, beside the scheduler's time per phase")
    parser.add_argument("--adapters", type=int, default=0,
                        help="serve this many random LoRA adapters beside the base model, requests taking each in turn")
    parser.add_argument("--adapter-rank", type=int, default=16)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    parse_range = lambda text: tuple(int(v) for v in text.split(","))
    prompt_range, output_range = parse_range(args.prompt_range), parse_range(args.output_range)
    if args.quick:
        prompt_range, output_range = (16, 64), (8, 32)
    if args.prefill_widths:
        batching.PREFILL_POWERS_OF_TWO = args.prefill_widths == "pow2"
    profiler = lazy.profile().__enter__() if args.profile else None  # every plan recorded with timestamps
    loaded, config = None, None
    # the load's longest request and a margin: a model's own context (SmolLM2's 8,192) would size a KV cache that
    # lavapipe's memory share cannot hold
    needed = args.shared_prefix + max(prompt_range) + max(output_range) + 64
    if args.random_shape:
        model, tokenizer, config = random_shape(args.random_shape, args.layers)
        loaded = (model, tokenizer)
        max_model_len = args.max_model_len or needed
    else:
        max_model_len = args.max_model_len or (needed if args.quick else None)
    adapters = None
    if args.adapters:
        if loaded is None:
            loaded = (cli_generate.load_model(args.model or cli_generate.default_model(), args.dtype),
                      AutoTokenizer.from_pretrained(args.model or cli_generate.default_model()))
        adapters = random_adapters(loaded[0], args.adapters, args.adapter_rank,
                                   Path(tempfile.mkdtemp(prefix="vkformers-bench-adapters-")))
    models = ("bench", *(adapters or ()))
    port, scheduler, server, thread, vocab = start_server(args.model or args.random_shape or cli_generate.default_model(), args.dtype,
                                                          args.max_batch, max_model_len, args.kv_cache_tokens,
                                                          args.prefix_caching, loaded,
                                                          args.gpu_memory_utilization, adapters, args.warmup)
    device = scheduler.model.parameters()[0].device
    print(f"device: {device.name}; model: {args.random_shape or args.model or 'SmolLM2-135M-Instruct'}; prompts "
          f"{prompt_range} outputs {output_range} tokens; max-model-len {scheduler.max_model_len}; KV cache: "
          f"{scheduler.kv_cache_summary()}", flush=True)
    results = []
    run_load(port, vocab, 1, 1, prompt_range, (4, 4), seed=0, shared=args.shared_prefix)  # warm-up: kernels, plans
    for clients in (int(c) for c in args.concurrency.split(",")):
        before = phases(scheduler.metrics)
        if profiler is not None:
            profiler.kernels.clear()
            profiler.replays = 0
        result = run_load(port, vocab, clients, args.requests, prompt_range, output_range, seed=clients,
                          shared=args.shared_prefix, models=models)
        result["phases"] = {name: value - before[name] for name, value in phases(scheduler.metrics).items()}
        results.append(result)
        print(f"{clients:3d} clients: {result['output_tokens_per_s']:8.1f} output tok/s, TTFT p50 "
              f"{result['ttft_ms_p50']:7.1f} ms p95 {result['ttft_ms_p95']:7.1f} ms p99 {result['ttft_ms_p99']:7.1f} "
              f"ms, ITL p50 {result['itl_ms_p50']:6.1f}"
              f" ms p99 {result['itl_ms_p99']:6.1f} ms, {result['failed']} failed of {result['requests']}", flush=True)
        if result["failed"]:
            print(f"     first error: {result['first_error']}", flush=True)
        print_phases(result["phases"], result["seconds"])
        if profiler is not None:
            print(profiler.report(top=25), flush=True)
    if args.soak:
        per_thread = -(-args.soak // args.soak_threads)
        run_load(port, vocab, args.soak_threads, per_thread, (8, 16), (4, 8), seed=1)  # warm-up at that load
        before = idle_memory(scheduler)
        soak = run_load(port, vocab, args.soak_threads, per_thread, (8, 16), (4, 8), seed=2)
        after = idle_memory(scheduler)
        soak.update(rss_before=before[0], rss_after=after[0], buffers_before=before[1], buffers_after=after[1],
                    blocks_before=before[2], blocks_after=after[2])
        results.append({"soak": soak})
        n = soak["requests"]
        print(f"soak: {n} requests from {args.soak_threads} threads, {soak['failed']} failed; RSS "
              f"{before[0] / 2**20:.1f} -> {after[0] / 2**20:.1f} MiB ({(after[0] - before[0]) / n:+.0f} B/request), "
              f"device buffers {before[1]:,} -> {after[1]:,} bytes ({(after[1] - before[1]) / n:+.1f} B/request), "
              f"pymalloc blocks {before[2]:,} -> {after[2]:,} ({(after[2] - before[2]) / n:+.2f}/request)")
    server.should_exit = True
    thread.join()
    scheduler.close()
    metrics = scheduler.metrics
    print(f"scheduler: {metrics.steps} decode steps, peak {metrics.peak_live_rows} rows, {metrics.rebuilds} rebuilds, "
          f"{metrics.placements} placements, {metrics.preemptions} preemptions; prefix cache "
          f"{metrics.prefix_hit_tokens} of {metrics.prefix_queried_tokens} prompt tokens")
    torch = None if args.no_torch or config is None else cuda_torch()
    if torch is not None:
        del scheduler, server, loaded  # (the Vulkan buffers stay with the process; torch allocates beside them)
        jobs = draw_jobs(vocab, args.torch_clients, args.requests, prompt_range, output_range, args.torch_clients,
                         args.shared_prefix)
        reference = torch_reference(torch, config, jobs)
        results.append({"torch": reference})
        mine = next((r for r in results if r.get("clients") == args.torch_clients), None)
        ratio = "" if mine is None else (f" (vkformers at {args.torch_clients} clients: "
                                         f"{mine['output_tokens_per_s'] / reference['output_tokens_per_s']:.2f}x)")
        print(f"{reference['reference']}: {reference['output_tokens_per_s']:8.1f} output tok/s over the "
              f"{reference['requests']} requests of the {args.torch_clients}-client load, "
              f"{reference['raw_tokens_per_s']:.1f} tok/s counting every row's tokens{ratio}", flush=True)
    elif config is not None and not args.no_torch:
        print("no PyTorch reference: torch sees no CUDA GPU here")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
