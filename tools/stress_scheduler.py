"""Random workloads through the continuous-batching scheduler, each request's output against ``generate`` alone.

The serve tests pin one scenario each; this draws many: the scheduler's limits (column limit and rounding, cache
growth, prefill chunks and plans, prompt widths as a GPU lays them out), paged or contiguous caches with small
pools (waits, preemptions, compaction), prefix caching, shared prompt prefixes, greedy and seeded sampling,
staggered arrivals and cancellations, on the tiny llama of the serve tests and the recurrent fixtures.

    python tools/stress_scheduler.py --seed 1 --trials 100 --models tiny,rwkv,jamba,mamba

A trial prints ``ok`` with the scheduler's counters, or ``BAD`` with what differed, or ``HANG`` with what the
scheduler still held when its requests did not finish; ``--first N`` repeats trial N of a seed alone.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import test_serve  # noqa: E402  (the tiny llama GGUF and the reference helpers)
import test_serve_recurrent  # noqa: E402  (the recurrent fixtures and their character tokenizer)

from vkformers.models import batching, generation  # noqa: E402
from vkformers.models.batching import BatchScheduler, Request, SamplingParams  # noqa: E402

LIMITS = {"COLUMN_LIMIT": [1, 2], "COLUMN_ROUNDING": [8, 16], "CACHE_GROWTH": [4, 16, 256],
          "PREFILL_CHUNK": [8, 16, 512], "PREFILL_TOKENS": [32, 64, 8192], "PREFILL_PLANS": [1, 8],
          "PREFILL_POWERS_OF_TWO": [True, False]}
DEFAULTS = {name: getattr(batching, name) for name in LIMITS}
BUCKETS = dict(generation.PREFILL_BUCKET)


class Models:
    """Each model twice: one the scheduler runs, one for generate alone (loaded once)."""

    def __init__(self):
        self.tiny = test_serve.write_tiny_model(Path(tempfile.mkdtemp()))
        self.chars = test_serve_recurrent.char_tokenizer()
        self.references = {}

    def load(self, name):
        if name == "tiny":
            path, tokenizer, _ = self.tiny
            return test_serve.scheduler_on(path, tokenizer).model, tokenizer
        return test_serve_recurrent.load(name), self.chars

    def reference(self, name):
        if name not in self.references:
            self.references[name] = self.tiny[2] if name == "tiny" else self.load(name)[0]
        return self.references[name]

    def encode(self, name, tokenizer, text):
        if name == "tiny":
            return test_serve.encode(tokenizer, text)
        return tokenizer.encode(text, add_special_tokens=False)


def draw(rng: random.Random, models: Models, names: list[str]):
    """One trial's model, limits, scheduler options and jobs (ids, params, arrival in s, cancelled)."""
    name = rng.choice(names)
    limits = {key: rng.choice(values) for key, values in LIMITS.items()}
    bucket = rng.choice([0, 8, 16])
    max_len = rng.choice([48, 64, 96])
    options = dict(max_batch=rng.choice([1, 2, 3, 4, 8]), max_model_len=max_len)
    if rng.random() < 0.7:
        page = rng.choice([4, 8, 16])
        options.update(kv_blocks=rng.choice([2 * max_len // page + 6, 3 * max_len // page + 6, 4 * max_len // page]),
                       page_size=page, prefix_caching=rng.random() < 0.5)
    model, tokenizer = models.load(name)
    shared = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, 20)))
    jobs = []
    for _ in range(rng.randint(2, 9)):
        text = (shared if rng.random() < 0.5 else "") + "".join(
            rng.choice("abcdefghijklmnop ,.") for _ in range(rng.randint(1, 30)))
        ids = models.encode(name, tokenizer, text)[:max_len - 31] or [5]
        tokens = rng.randint(1, min(30, max_len - len(ids)))
        params = (SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.9, seed=rng.randint(0, 99))
                  if rng.random() < 0.3 else SamplingParams(max_tokens=tokens, temperature=0))
        jobs.append((ids, params, rng.random() * 0.3, rng.random() < 0.1))
    return name, model, tokenizer, limits, bucket, options, sorted(jobs, key=lambda job: job[2])


def expected_tokens(reference, ids, params) -> list[int]:
    if params.temperature == 0:
        return test_serve.reference_tokens(reference, ids, params.max_tokens).tolist()
    return test_serve.reference_tokens(reference, ids, params.max_tokens, do_sample=True, temperature=0.8,
                                       top_p=0.9, seed=params.seed).tolist()


def run(scheduler, jobs, timeout: float):
    """Submit the jobs at their arrival times, cancel the marked ones; the requests (None: refused at submit)."""
    requests, began = [], time.monotonic()
    scheduler.start()
    try:
        for ids, params, arrival, _ in jobs:
            time.sleep(max(0.0, arrival - (time.monotonic() - began)))
            try:
                requests.append(scheduler.submit(Request(ids, params, lambda update: None, [])))
            except Exception as exc:  # a request the pool can never hold
                print(f"    refused: {str(exc).splitlines()[0]}")
                requests.append(None)
        for request, (*_, cancel) in zip(requests, jobs):
            if cancel and request is not None:
                time.sleep(0.02)
                request.cancel()
        test_serve.wait_for(lambda: all(r.finished for r in requests if r is not None), timeout)
        if scheduler.kv_blocks is not None and not scheduler.prefix_caching:
            test_serve.wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    return requests


def trial(seed: int, index: int, models: Models, names: list[str], timeout: float) -> bool:
    rng = random.Random(seed * 100003 + index)
    name, model, tokenizer, limits, bucket, options, jobs = draw(rng, models, names)
    for key, value in {**DEFAULTS, **limits}.items():
        setattr(batching, key, value)
    generation.PREFILL_BUCKET.update(BUCKETS)
    generation.PREFILL_BUCKET["cpu"] = bucket  # a GPU's prompt layout on any device
    described = f"trial {seed}:{index} {name} {limits} bucket={bucket} {options} jobs={len(jobs)}"
    reference = models.reference(name)
    expected = [expected_tokens(reference, ids, params) for ids, params, _, _ in jobs]
    try:
        scheduler = BatchScheduler(model, tokenizer, **options)
    except Exception as exc:
        print(f"{described} refused: {str(exc).splitlines()[0]}")
        return True
    try:
        requests = run(scheduler, jobs, timeout)
    except AssertionError:
        held = [(len(r.prompt), len(r.generated), r.params.max_tokens) for r in scheduler._rows if r is not None]
        print(f"{described} HANG: waiting {len(scheduler._waiting)}, rows {held}, {scheduler.metrics}")
        return False
    bad = [f"error {scheduler.error or scheduler.last_error!r}"] if scheduler.error or scheduler.last_error else []
    for request, (ids, params, _, cancel), want in zip(requests, jobs, expected):
        if request is not None and not cancel and request.finish_reason != "cancelled" and request.generated != want:
            # generate on a model fresh from disk, holding no recorded plan of earlier trials
            fresh = expected_tokens(models.load(name)[0], ids, params)
            bad.append(f"prompt {ids} {params}: got {request.generated}, generate alone {want}"
                       + ("" if fresh == want else f", generate alone on a fresh model {fresh}"))
    m = scheduler.metrics
    print(f"{described} {'BAD' if bad else 'ok'} steps={m.steps} rebuilds={m.rebuilds} placements={m.placements} "
          f"shifts={m.shifts} compactions={m.compactions} preemptions={m.preemptions}", flush=True)
    for line in bad:
        print("    " + line)
    if bad:
        print("    jobs (prompt, max_tokens, temperature, seed, arrival s, cancelled):",
              [(ids, p.max_tokens, p.temperature, p.seed, round(at, 3), cancel) for ids, p, at, cancel in jobs])
    if scheduler.last_error is not None:
        traceback.print_exception(scheduler.last_error)
    return not bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--first", type=int, default=0, help="the first trial's index (repeat one: --trials 1)")
    parser.add_argument("--models", default="tiny,rwkv,jamba,mamba")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a trial's requests may take")
    args = parser.parse_args(argv)
    models, names = Models(), args.models.split(",")
    failed = [index for index in range(args.first, args.first + args.trials)
              if not trial(args.seed, index, models, names, args.timeout)]
    print(f"{args.trials - len(failed)} of {args.trials} trials ok" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
