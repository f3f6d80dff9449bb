"""Host time of the serving scheduler (models/batching.py): where a turn of ``BatchScheduler`` spends it, on a model
whose device work is negligible but whose graph is as deep as Llama-3-8B's (32 layers of hidden 64, 4/2 heads, ffn
128, vocabulary 1,000), so that on any device (lavapipe included) the times are the host's.

Runs the scheduler directly (no HTTP): for each concurrency, that many clients each submit --requests requests one
after another (random prompts of --prompt-range tokens, greedy outputs of --output-range tokens), prompts laid out
as on a GPU (PREFILL_BUCKET 64 columns, unless --bucket). Prints, per concurrency, the wall time, and the total and
mean time per call of the scheduler's parts: prefills (per rebuild and per joining chunk, and the model's prefill
calls within), decode steps (the step's forward or replay, the choice of tokens, the text and the clients' updates),
and the replayed prefills and steps; --profile FILE writes a cProfile of the scheduler's thread.

    python bench/serve_host.py [--concurrency 1,8] [--requests 4 | 6,2] [--layers 32] [--kv-cache-tokens N]
                               [--profile out.prof]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import threading
import time
from collections import defaultdict

import numpy as np
from tokenizers import Tokenizer, models

from common import run_clients

from vkformers.models import batching, generation
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.tokenizer import PreTrainedTokenizer
from vkformers.runtime import vulkan

DEEP_TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu")


def deep_tiny(layers: int, dtype: str):
    config = dict(DEEP_TINY, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(0)
    weights = {name: (np.ones(slot.shape, np.float32) if name.endswith("norm.weight")
                      else rng.standard_normal(slot.shape, dtype=np.float32) * 0.05)
               for name, slot in model.named_slots() if slot.tied_to is None}
    model.load_state_dict(weights, dtype=dtype, requires_grad=False)
    model.eval()
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tokenizer = PreTrainedTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="w0")), {})
    return model, tokenizer


DEVICE = [0.0]  # seconds spent submitting recorded command buffers and waiting for them


def time_device():
    """Count the time in Sequence.replay (submit and wait): on lavapipe, the device's work runs on the host."""
    replay = vulkan.Sequence.replay

    def timed(self):
        start = time.perf_counter()
        try:
            return replay(self)
        finally:
            DEVICE[0] += time.perf_counter() - start
    vulkan.Sequence.replay = timed


class Timers:
    """Wraps methods of an object with timers: total seconds, device seconds within and calls per name."""

    def __init__(self):
        self.total, self.device, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)

    def wrap(self, owner, name: str, label: str | None = None):
        inner = getattr(owner, name)
        label = label or name

        def timed(*args, **kwargs):
            start, device = time.perf_counter(), DEVICE[0]
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - start
                self.device[label] += DEVICE[0] - device
                self.calls[label] += 1
        setattr(owner, name, timed)

    def report(self):
        print(f"  {'':<22} {'total ms':>10} {'device ms':>10} {'host ms':>10} {'calls':>6} {'host ms/call':>12}")
        for label in sorted(self.total, key=lambda k: -(self.total[k] - self.device[k])):
            total, device, calls = self.total[label], self.device[label], self.calls[label]
            print(f"  {label:<22} {total * 1e3:10.1f} {device * 1e3:10.1f} {(total - device) * 1e3:10.1f} {calls:6d} "
                  f"{(total - device) / calls * 1e3:12.2f}")

    def clear(self):
        self.total.clear(), self.device.clear(), self.calls.clear()


def run(scheduler, vocab: int, clients: int, requests: int, prompt_range, output_range, seed: int):
    rng = np.random.default_rng(seed)
    jobs = [[(rng.integers(10, vocab - 10, rng.integers(*prompt_range, endpoint=True)).tolist(),
              int(rng.integers(*output_range, endpoint=True))) for _ in range(requests)] for _ in range(clients)]
    tokens = [0]
    lock = threading.Lock()

    def client(work):
        for prompt, max_tokens in work:
            done = threading.Event()

            def on_update(update, done=done):
                if update.finish_reason is not None:
                    with lock:
                        tokens[0] += update.completion_tokens
                    done.set()
            scheduler.submit(Request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), on_update, []))
            done.wait()
    return run_clients(client, jobs), tokens[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", default="4", help="per client (one value, or one per concurrency)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-range", default="64,1024")
    parser.add_argument("--output-range", default="64,256")
    parser.add_argument("--bucket", type=int, default=64, help="prefill columns rounding (GPU: 64)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--profile", default=None, help="write a cProfile of the scheduler's thread here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    generation.PREFILL_BUCKET["cpu"] = args.bucket  # lay prompts out as on a GPU
    model, tokenizer = deep_tiny(args.layers, args.dtype)
    time_device()
    blocks = None if args.kv_cache_tokens is None else -(-args.kv_cache_tokens // batching.PAGE_SIZE) + 1
    scheduler = BatchScheduler(model, tokenizer, max_batch=args.max_batch, max_model_len=2048, kv_blocks=blocks)
    timers = Timers()
    for name in ("_rebuild", "_prefill_chunk", "_step", "_choose", "_advance_text", "_place", "_move"):
        timers.wrap(scheduler, name)
    for name in ("prefill", "decode_step"):
        timers.wrap(model, name, f"model.{name}")
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        loop = scheduler._loop

        def profiled():
            profiler.enable()
            try:
                loop()
            finally:
                profiler.disable()
        scheduler._loop = profiled
    scheduler.start()
    prompt_range = tuple(int(v) for v in args.prompt_range.split(","))
    output_range = tuple(int(v) for v in args.output_range.split(","))
    run(scheduler, 1000, 1, 1, (prompt_range[0], prompt_range[0]), (4, 4), 99)  # warm-up: kernels, first plans
    timers.clear()
    loads = [int(c) for c in args.concurrency.split(",")]
    requests = [int(r) for r in args.requests.split(",")]
    for clients, count in zip(loads, requests * len(loads) if len(requests) == 1 else requests):
        before = {k: getattr(scheduler.metrics, k) for k in ("steps", "replayed_steps", "rebuilds", "prefill_chunks")}
        before["prefill_replays"] = getattr(scheduler.metrics, "prefill_replays", 0)
        seconds, tokens = run(scheduler, 1000, clients, count, prompt_range, output_range, args.seed)
        after = {k: getattr(scheduler.metrics, k, 0) for k in before}
        print(f"concurrency {clients}: {seconds:.2f} s, {tokens} tokens, {tokens / seconds:.1f} tok/s; "
              + ", ".join(f"{k} {after[k] - before[k]}" for k in before))
        timers.report()
        timers.clear()
    scheduler.close()
    if profiler is not None:
        profiler.dump_stats(args.profile)
        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
