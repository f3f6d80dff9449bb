"""``vkformers serve``: the continuous-batching scheduler against ``model.generate``, and the OpenAI-compatible routes
through the ``openai`` client and raw HTTP, on a tiny random llama GGUF (with a byte-level BPE tokenizer and a chat
template) served by uvicorn on a free local port.

The engine is not shared across threads: every reference ``generate`` runs while the scheduler is idle.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import vkformers as vkf
from vkformers.cli import main
from vkformers.cli import serve as cli_serve
from vkformers.cli.api_schema import ApiError
from vkformers.cli.completion_request import model_sampling_defaults, sampling_params
from vkformers.cli.request_prompts import chat_prompt, completion_prompt
from vkformers.models import batching
from vkformers.engine.function import grad_enabled
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.decode_capture import DecodeCapture
from vkformers.models.decoder.layer import DecoderLayer
from vkformers.models.gguf import load_gguf_model, load_gguf_tokenizer
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.lora import LoraConfig, LoraLinear, apply_lora, merge_lora, save_adapter

try:  # the [serve] extra and the openai client of the [test] extra (CI installs both)
    import openai
    import uvicorn
except ImportError:
    openai = uvicorn = None

API_KEY = "test-key"
SERVED = "tiny"
PROMPTS = ["the capital of france is", "hello", "once upon a time there was a", "gpu", "a b c d e f g h",
           "the quick brown fox", "x", "language models on any gpu through vulkan compute"]


def write_tiny_model(folder):
    """A tiny random llama written as a GGUF in ``folder``: (path, tokenizer, reference model)."""
    from test_gguf import gguf, random_llama, train_bpe, write_tiny_gguf
    if gguf is None:
        pytest.fail("the gguf package is needed to write the tiny model", pytrace=False)
    backend = train_bpe()
    path = write_tiny_gguf(folder / "tiny.gguf", random_llama(backend.get_vocab_size()), backend)
    return path, load_gguf_tokenizer(path), load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)


def prefill_bucket(monkeypatch, columns):
    """Prompts laid out at multiples of ``columns`` (0: each at its own width) on any device, CPU or GPU."""
    for device in ("cpu", "gpu"):
        monkeypatch.setitem(batching.PREFILL_BUCKET, device, columns)


def scheduler_on(path, tokenizer, **options):
    return BatchScheduler(load_gguf_model(AutoModelForCausalLM, path, requires_grad=False), tokenizer, **options)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve"))


def reference_tokens(reference, ids, max_tokens, eos=(), **sampling):
    """generate's tokens for one request alone; sampling without top-k (OpenAI's API has none), as the server."""
    ids = np.asarray(ids, np.int64)[None]
    sampling.setdefault("top_k", 0)
    return reference.generate(ids, max_new_tokens=max_tokens, eos_token_id=list(eos), **sampling)[0, ids.shape[1]:]


def encode(tokenizer, text):
    return [int(t) for t in tokenizer(text, return_tensors="np")["input_ids"][0]]


def wait_for(condition, seconds=120.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def run_staggered(scheduler, jobs):
    """Submit (prompt ids, SamplingParams) jobs: half at once, the others one by one after further decode steps, so
    that they join a running batch at different step boundaries. Returns the finished requests."""
    requests = []
    for index, (ids, params) in enumerate(jobs):
        if index >= len(jobs) // 2:
            steps = scheduler.metrics.steps
            wait_for(lambda: scheduler.metrics.steps >= steps + 2 or all(r.finished for r in requests))
        requests.append(scheduler.submit(Request(ids, params, lambda update: None, [])))
    wait_for(lambda: all(r.finished for r in requests))
    return requests


def run_together(scheduler, jobs):
    """Submit (prompt ids, SamplingParams) jobs before the scheduler starts, so that they begin in one batch; wait
    until all finish and every KV block is back, then close the scheduler. Returns the finished requests."""
    requests = [scheduler.submit(Request(ids, params, lambda update: None, [])) for ids, params in jobs]
    scheduler.start()
    try:
        wait_for(lambda: all(r.finished for r in requests))
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    return requests


def test_concurrent_greedy_and_seeded_requests_match_generate_alone(tiny):
    path, tokenizer, reference = tiny
    lengths = [5, 9, 3, 12, 7, 4, 10, 6]
    greedy = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, lengths)]
    sampled = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=i))
               for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    expected_greedy = [reference_tokens(reference, ids, p.max_tokens) for ids, p in greedy]
    expected_sampled = [reference_tokens(reference, ids, p.max_tokens, do_sample=True, temperature=0.8, top_p=0.9,
                                         seed=p.seed) for ids, p in sampled]
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    scheduler = BatchScheduler(model, tokenizer, max_batch=8).start()
    try:
        for jobs, expected in ((greedy, expected_greedy), (sampled, expected_sampled)):
            requests = run_staggered(scheduler, jobs)
            for request, tokens in zip(requests, expected):
                assert request.generated == tokens.tolist() and request.finish_reason == "length"
        # requests did run together, and joined a batch that was already decoding
        assert scheduler.metrics.peak_live_rows >= 3
        assert scheduler.metrics.placements >= 2 and scheduler.metrics.rebuilds >= 2
    finally:
        scheduler.close()
    assert scheduler.error is None


@pytest.mark.parametrize("paged", [False, True])
def test_decode_steps_run_without_gradients_fused_and_choose_greedy_tokens_on_the_gpu(tiny, paged, monkeypatch):
    """The scheduler's thread records no gradient (the mode is per thread: a model whose parameters require
    gradients would build autograd graphs there and miss the fused decode kernels), and a batch of greedy rows reads
    back the tokens the GPU chose instead of the logits (DecodeCapture.choose); outputs equal generate alone."""
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, (9, 6, 11))]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in jobs]
    modes, fused, chosen = [], [0], [0]
    real_forward, real_fused, real_choose = DecoderLayer.forward, DecoderLayer._decode_fused, DecodeCapture.choose

    def spy_forward(self, x, ctx):
        if threading.current_thread().name == "vkformers-scheduler":
            modes.append(grad_enabled())
        return real_forward(self, x, ctx)

    def spy_fused(self, x, ctx):
        out = real_fused(self, x, ctx)
        fused[0] += out is not None
        return out

    def spy_choose(self, *args):
        out = real_choose(self, *args)
        chosen[0] += out is not None
        return out
    monkeypatch.setattr(DecoderLayer, "forward", spy_forward)
    monkeypatch.setattr(DecoderLayer, "_decode_fused", spy_fused)
    monkeypatch.setattr(DecodeCapture, "choose", spy_choose)
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=True)
    requests = run_together(BatchScheduler(model, tokenizer, max_batch=4, kv_blocks=64 if paged else None), jobs)
    assert [r.generated for r in requests] == [tokens.tolist() for tokens in expected]
    assert modes and not any(modes) and fused[0] > 0 and chosen[0] > 0


@pytest.mark.parametrize("paged", [False, True])
def test_a_rebuild_of_many_rows_prefills_in_chunks_of_bounded_tokens(tiny, paged, monkeypatch):
    """Eight prompts arriving together are prefilled as one batch in chunks of at most PREFILL_TOKENS tokens (rows x
    columns: 8 x 4 here) and only the last position's logits; their outputs are those of generate alone."""
    monkeypatch.setattr(batching, "PREFILL_TOKENS", 32)
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=5, temperature=0)) for p in PROMPTS]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = scheduler_on(path, tokenizer, max_batch=8, **({"kv_blocks": 64} if paged else {}))
    model, shapes = scheduler.model, []
    prefill = model.prefill

    def counted(ids, mask, positions, cache, capture=None):
        shapes.append(ids.shape)
        logits = prefill(ids, mask, positions, cache, capture)
        assert logits.shape == (ids.shape[0], model.config["vocab_size"])
        return logits
    monkeypatch.setattr(model, "prefill", counted, raising=False)
    requests = [scheduler.submit(Request(ids, p, lambda update: None, [])) for ids, p in jobs]
    scheduler.start()
    try:
        wait_for(lambda: all(r.finished for r in requests))
    finally:
        scheduler.close()
    assert scheduler.error is None and scheduler.metrics.errors == 0
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    longest = max(len(ids) for ids, _ in jobs)
    assert len(shapes) >= -(-longest // 4) and all(rows * columns <= 32 for rows, columns in shapes)


@pytest.mark.parametrize("paged", [False, True])
def test_prefills_of_one_shape_replay_their_recorded_plan(tiny, paged, monkeypatch):
    """Prompts of different lengths laid out at one width (a bucket of 16 columns, as a GPU rounds them to 64),
    each prefilled in two chunks of 8 columns: the first two prompts record and confirm each chunk's plan, every
    later one replays both (no Python forward); outputs stay those of generate alone."""
    prefill_bucket(monkeypatch, 16)
    monkeypatch.setattr(batching, "PREFILL_CHUNK", 8)
    path, tokenizer, reference = tiny
    tokens = encode(tokenizer, " ".join(PROMPTS))
    prompts = [tokens[-n:] for n in (9, 12, 10, 14, 11)]
    jobs = [(ids, SamplingParams(max_tokens=4, temperature=0)) for ids in prompts]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = scheduler_on(path, tokenizer, max_batch=4, **({"kv_blocks": 64} if paged else {})).start()
    try:
        outputs = [run_staggered(scheduler, [job])[0].generated for job in jobs]  # one after another
    finally:
        scheduler.close()
    assert scheduler.error is None and outputs == [e.tolist() for e in expected]
    metrics = scheduler.metrics
    assert metrics.rebuilds == len(jobs) and metrics.prefills == 2 * len(jobs)
    assert metrics.prefill_replays == 2 * (len(jobs) - 2)


@pytest.mark.parametrize("paged", [False, True])
def test_prompts_joining_a_running_batch_replay_their_prefill(tiny, paged, monkeypatch):
    """Three long requests decode in a batch of four rows; five short ones of different lengths (one width, a bucket
    of 16 columns) join its free row one after another, each prefilled apart and placed: from the third on, their
    prefill replays the plan the two before confirmed. Every output is generate's."""
    prefill_bucket(monkeypatch, 16)
    path, tokenizer, reference = tiny
    tokens = encode(tokenizer, " ".join(PROMPTS))
    long = [(encode(tokenizer, p), SamplingParams(max_tokens=60, temperature=0)) for p in PROMPTS[:3]]
    short = [(tokens[-n:], SamplingParams(max_tokens=2, temperature=0)) for n in (9, 12, 10, 14, 11)]
    expected = [reference_tokens(reference, ids, p.max_tokens).tolist() for ids, p in long + short]
    scheduler = scheduler_on(path, tokenizer, max_batch=4, **({"kv_blocks": 96} if paged else {}))
    # the first long one's updates (on the scheduler's thread) pace the steps as a CPU device runs them: on a GPU
    # this tiny model's steps are shorter than wait_for's poll, and the long ones finished before the short ones joined
    paced = [lambda update: time.sleep(0.02)] + [lambda update: None] * (len(long) - 1)
    requests = [scheduler.submit(Request(ids, p, on_update, [])) for (ids, p), on_update in zip(long, paced)]
    scheduler.start()
    try:
        for job in short:
            requests += run_staggered(scheduler, [job])
        assert not requests[0].finished  # the short ones all joined the running batch
        wait_for(lambda: all(r.finished for r in requests))
    finally:
        scheduler.close()
    assert [r.generated for r in requests] == expected
    metrics = scheduler.metrics
    assert (metrics.rebuilds, metrics.placements, metrics.prefill_chunks) == (1, 5, 5)
    assert metrics.prefills == 6 and metrics.prefill_replays == 3


def test_the_scheduler_holds_at_most_prefill_plans_recorded_prefills(tiny, monkeypatch):
    """Prompts of four widths, each twice (its prefill plan recorded and confirmed): PREFILL_PLANS 2 keeps the two
    used last, the others forgotten (their plans free to go); outputs stay generate's."""
    prefill_bucket(monkeypatch, 8)
    monkeypatch.setattr(batching, "PREFILL_POWERS_OF_TWO", False)  # four widths: whole buckets only
    monkeypatch.setattr(batching, "PREFILL_PLANS", 2)
    path, tokenizer, reference = tiny
    tokens = encode(tokenizer, " ".join(PROMPTS))
    prompts = [tokens[:n] for n in (5, 13, 21, 29) for _ in range(2)]
    scheduler = scheduler_on(path, tokenizer, max_batch=2).start()
    try:
        outputs = [run_staggered(scheduler, [(ids, SamplingParams(max_tokens=2, temperature=0))])[0].generated
                   for ids in prompts]
        assert len(scheduler._prefill_captures) == 2
        assert all(capture.ready for capture, _ in scheduler._prefill_captures.values())
        assert sorted(key[2] for key in scheduler._prefill_captures) == [24, 32]  # the columns of the last two
    finally:
        scheduler.close()
    assert outputs == [reference_tokens(reference, ids, 2).tolist() for ids in prompts]
    assert scheduler.metrics.prefills == 8 and scheduler.metrics.prefill_replays == 0


def test_prompt_widths_round_to_powers_of_two_and_whole_chunks(tiny, monkeypatch):
    """With PREFILL_POWERS_OF_TWO (the default), prompts are laid out at a power of two of at least the bucket below
    PREFILL_CHUNK and at whole chunks above it: few prefill shapes, so that most prefills replay a recorded plan.
    Never so far that the batch's columns leave the longest prompt too little room for its outputs (max_model_len
    tokens in all): with COLUMN_LIMIT 1 (columns up to max_model_len), not at all."""
    prefill_bucket(monkeypatch, 16)
    monkeypatch.setattr(batching, "PREFILL_CHUNK", 32)
    path, tokenizer, _ = tiny
    scheduler = scheduler_on(path, tokenizer)  # max_model_len 128: up to 256 columns
    widths = {n: scheduler._width(n) for n in (1, 16, 17, 32, 33, 65, 100, 128)}
    assert widths == {1: 16, 16: 16, 17: 32, 32: 32, 33: 64, 65: 96, 100: 128, 128: 128}
    monkeypatch.setattr(batching, "PREFILL_POWERS_OF_TWO", False)
    assert [scheduler._width(n) for n in (17, 33, 100)] == [32, 48, 112]
    monkeypatch.setattr(batching, "COLUMN_LIMIT", 1)
    assert [scheduler._width(n) for n in (17, 33, 100)] == [17, 33, 100]


@pytest.mark.parametrize("bucket, chunk", [(0, 512), (16, 512), (0, 8)])
def test_a_longer_prompt_joins_a_free_row_by_moving_the_batch_right(tiny, bucket, chunk, monkeypatch):
    """Three short prompts decode in a batch of four rows; a prompt longer than the batch's columns takes the free
    row after the batch's tokens move right (no prefill of the running rows again). bucket 16: prompts prefilled
    at a multiple of 16 tokens, as a GPU rounds them (to 64) to share recorded prefills. chunk 8: the long prompt
    is prefilled 8 tokens a turn, the others decoding in between."""
    prefill_bucket(monkeypatch, bucket)
    monkeypatch.setattr(batching, "PREFILL_CHUNK", chunk)
    path, tokenizer, reference = tiny
    short = [(encode(tokenizer, p), SamplingParams(max_tokens=40, temperature=0)) for p in ("x", "gpu", "hello")]
    long = (encode(tokenizer, PROMPTS[7]), SamplingParams(max_tokens=6, temperature=0))
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in short + [long]]
    scheduler = BatchScheduler(load_gguf_model(AutoModelForCausalLM, path, requires_grad=False), tokenizer,
                               max_batch=4)
    requests = [scheduler.submit(Request(ids, p, lambda update: None, [])) for ids, p in short]  # one batch
    scheduler.start()
    try:
        wait_for(lambda: scheduler.metrics.steps >= 2)
        requests.append(scheduler.submit(Request(*long, lambda update: None, [])))
        wait_for(lambda: all(r.finished for r in requests))
    finally:
        scheduler.close()
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    metrics = scheduler.metrics
    assert (metrics.rebuilds, metrics.placements, metrics.shifts, metrics.peak_live_rows) == (1, 1, 1, 4)
    width = len(long[0]) if bucket == 0 else -(-len(long[0]) // bucket) * bucket
    assert metrics.prefill_chunks == -(-width // chunk)


def test_caches_grow_and_batches_pack_as_tokens_come(tiny, monkeypatch):
    """With a few columns to spare, the batch's cache doubles as outputs grow, and a batch whose columns reach the
    limit is packed again; outputs stay those of generate alone."""
    path, tokenizer, reference = tiny
    monkeypatch.setattr(batching, "CACHE_GROWTH", 4)
    monkeypatch.setattr(batching, "COLUMN_ROUNDING", 8)
    monkeypatch.setattr(batching, "COLUMN_LIMIT", 1)  # columns up to max_model_len, then the batch is packed
    lengths = [20, 9, 14, 12, 18, 4, 16, 11]
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, lengths)]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = BatchScheduler(load_gguf_model(AutoModelForCausalLM, path, requires_grad=False), tokenizer,
                               max_batch=4, max_model_len=64).start()
    try:
        requests = run_staggered(scheduler, jobs)
    finally:
        scheduler.close()
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    assert scheduler.metrics.growths >= 1 and scheduler.error is None and scheduler.metrics.errors == 0


def test_requests_cancelled_before_they_run_never_start(tiny):
    path, tokenizer, _ = tiny
    scheduler = BatchScheduler(load_gguf_model(AutoModelForCausalLM, path, requires_grad=False), tokenizer)
    updates = []
    requests = [scheduler.submit(Request(encode(tokenizer, p), SamplingParams(max_tokens=3), updates.append, []))
                for p in PROMPTS[:2]]
    for request in requests:
        request.cancel()
    scheduler.start()
    try:
        wait_for(lambda: all(r.finished for r in requests))
        assert scheduler.submit(Request(encode(tokenizer, "hi"), SamplingParams(max_tokens=2), updates.append, []))
        wait_for(lambda: scheduler.metrics.finished == 3)
    finally:
        scheduler.close()
    assert [r.finish_reason for r in requests] == ["cancelled"] * 2 and all(not r.generated for r in requests)
    assert scheduler.metrics.errors == 0 and scheduler.metrics.cancelled == 2 and updates[-1].finish_reason == "length"


def test_max_batch_makes_requests_wait(tiny):
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=4, temperature=0)) for p in PROMPTS[:5]]
    expected = [reference_tokens(reference, ids, 4) for ids, _ in jobs]
    scheduler = BatchScheduler(load_gguf_model(AutoModelForCausalLM, path, requires_grad=False), tokenizer,
                               max_batch=2)
    requests = [scheduler.submit(Request(ids, params, lambda update: None, [])) for ids, params in jobs]
    assert scheduler.metrics.waiting == 5
    scheduler.start()
    try:
        wait_for(lambda: all(r.finished for r in requests))
    finally:
        scheduler.close()
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    assert scheduler.metrics.requests == 5 and scheduler.metrics.finished == 5


# ---------------------------------------------------------------- the HTTP server

@pytest.fixture(scope="module")
def web():
    if uvicorn is None or openai is None:
        pytest.fail("the serve tests need pip install 'vkformers[serve,test]' (Starlette, uvicorn, openai)",
                    pytrace=False)


@contextlib.contextmanager
def serving(scheduler, tokenizer, **options):
    """The routes of ``scheduler`` (started) on a free local port, as SERVED with API_KEY (and build_app's
    ``options``): {port, scheduler, tokenizer, client (openai's)}; the server stopped and the scheduler closed
    after."""
    app = cli_serve.build_app(scheduler, tokenizer, SERVED, api_key=API_KEY, **options)
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: web.started, 30)
        yield {"port": port, "scheduler": scheduler, "tokenizer": tokenizer,
               "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)}
    finally:
        web.should_exit = True
        thread.join(30)
        scheduler.close()


@contextlib.contextmanager
def serving_tiny(tiny):
    """A GGUF model (path, tokenizer, _), as write_tiny_model makes one, on a scheduler of 4 rows and 96 positions,
    served."""
    path, tokenizer, _ = tiny
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    scheduler = BatchScheduler(model, tokenizer, max_batch=4, max_model_len=96,
                               eos=cli_serve.eos_ids(model, tokenizer)).start()
    with serving(scheduler, tokenizer) as served:
        yield served


@pytest.fixture(scope="module")
def server(tiny, web):
    with serving_tiny(tiny) as served:
        yield served


def request(server, method, route, body=None, *, raw=None, key=API_KEY):
    connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=120)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    connection.request(method, route, body=data, headers=headers)
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    return response.status, text


def expected_eos(server, tiny):
    return cli_serve.eos_ids(tiny[2], server["tokenizer"])


def test_health_models_and_metrics(server):
    assert request(server, "GET", "/health", key=None) == (200, '{"status":"ok"}')
    models = server["client"].models.list()
    assert [m.id for m in models.data] == [SERVED]
    status, text = request(server, "GET", "/metrics", key=None)
    assert status == 200
    for name in ("vkformers_requests_total", "vkformers_requests_cancelled_total", "vkformers_generation_tokens_total", "vkformers_requests_running",
                 "vkformers_batch_occupancy", "vkformers_kv_cache_tokens", "vkformers_time_to_first_token_seconds_sum",
                 "vkformers_decode_seconds_total", "vkformers_prefill_seconds_total",
                 "vkformers_sampling_seconds_total", "vkformers_batch_compactions_total"):
        assert f"{name}{{model=\"{SERVED}\"}} " in text


def test_completion_matches_generate(server, tiny):
    tokenizer, reference = server["tokenizer"], tiny[2]
    prompt = PROMPTS[0]
    ids = encode(tokenizer, prompt)
    tokens = reference_tokens(reference, ids, 8, expected_eos(server, tiny))
    response = server["client"].completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0,
                                                   logprobs=3)
    choice = response.choices[0]
    assert choice.text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == len(tokens)
    assert response.usage.total_tokens == len(ids) + len(tokens)
    assert choice.finish_reason == ("stop" if tokens[-1] in expected_eos(server, tiny) else "length")
    # greedy: the chosen token is the most likely one, its log-probability the highest of the top ones (keyed by
    # text: byte tokens that decode alike share a key)
    assert len(choice.logprobs.token_logprobs) == len(tokens)
    for logprob, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and logprob <= 0 and abs(max(top.values()) - logprob) < 1e-6
    # token ids as the prompt give the same
    again = server["client"].completions.create(model=SERVED, prompt=ids, max_tokens=8, temperature=0)
    assert again.choices[0].text == choice.text


def test_streamed_completion_equals_the_whole_one(server):
    client = server["client"]
    whole = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    status, text = request(server, "POST", "/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 3,
                                                               "stream": True})
    assert status == 200 and text.endswith("data: [DONE]\n\n")


def test_chat_completion_uses_the_chat_template(server, tiny):
    tokenizer, reference = server["tokenizer"], tiny[2]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         return_tensors="np")["input_ids"][0]]
    tokens = reference_tokens(reference, ids, 7, expected_eos(server, tiny))
    client = server["client"]
    response = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=7, temperature=0,
                                              logprobs=True, top_logprobs=2)
    message = response.choices[0].message
    assert message.role == "assistant" and message.content == tokenizer.decode(tokens, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == len(tokens)
    assert len(response.choices[0].logprobs.content) == len(tokens)
    assert all(len(entry.top_logprobs) == 2 for entry in response.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=SERVED, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content


def test_seeded_sampling_repeats(server):
    client = server["client"]
    runs = [client.completions.create(model=SERVED, prompt=PROMPTS[5], max_tokens=8, temperature=0.9, top_p=0.95,
                                      seed=seed).choices[0].text for seed in (11, 11, -11, 2 ** 64 - 11)]
    assert runs[0] == runs[1] and runs[2] == runs[3]  # a negative seed: its two's complement, as vLLM's
    status, error = error_of(request(server, "POST", "/v1/completions", {"model": SERVED, "prompt": "hi", "seed": 1.5}))
    assert status == 400 and error["param"] == "seed"


def test_n_choices_each_sample_on_their_own_rows(server, tiny):
    """n=3: greedy choices are identical (generate's output); seeded choices i sample with seed + i, each equal to
    generate with that seed, choice 0 to the request with n=1; streamed choices carry their index; usage counts the
    prompt once and every choice's tokens."""
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    ids = encode(tokenizer, PROMPTS[3])
    eos = expected_eos(server, tiny)
    greedy = client.completions.create(model=SERVED, prompt=PROMPTS[3], max_tokens=6, temperature=0, n=3)
    tokens = reference_tokens(reference, ids, 6, eos)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {tokenizer.decode(tokens, skip_special_tokens=True)}
    assert greedy.usage.prompt_tokens == len(ids) and greedy.usage.completion_tokens == 3 * len(tokens)
    sampling = dict(temperature=0.9, top_p=0.95, seed=5)
    sampled = client.completions.create(model=SERVED, prompt=PROMPTS[3], max_tokens=8, n=3, **sampling)
    expected = [tokenizer.decode(reference_tokens(reference, ids, 8, eos, do_sample=True, temperature=0.9, top_p=0.95,
                                                  seed=5 + i), skip_special_tokens=True) for i in range(3)]
    assert [c.text for c in sampled.choices] == expected and len(set(expected)) > 1
    assert client.completions.create(model=SERVED, prompt=PROMPTS[3], max_tokens=8,
                                     **sampling).choices[0].text == expected[0]
    messages = [{"role": "user", "content": "hello"}]
    chunks = list(client.chat.completions.create(model=SERVED, messages=messages, max_tokens=5, n=2, stream=True,
                                                 stream_options={"include_usage": True}, **sampling))
    whole = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=5, n=2, **sampling)
    for index in range(2):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)
        assert streamed == whole.choices[index].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for n in (0, 129):
        status, text = request(server, "POST", "/v1/completions", {"prompt": "hi", "n": n})
        assert status == 400 and json.loads(text)["error"]["param"] == "n"


def test_a_batch_of_prompts_answers_each_prompt_n_times_in_order(server, tiny):
    """prompt as a list (OpenAI's batch): choices prompt by prompt, n each (index = prompt * n + choice), each
    greedy choice generate's output for its prompt; usage counts each prompt once; streamed alike."""
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    eos = expected_eos(server, tiny)
    ids = [encode(tokenizer, PROMPTS[2]), encode(tokenizer, PROMPTS[5])]
    texts = [tokenizer.decode(reference_tokens(reference, i, 5, eos), skip_special_tokens=True) for i in ids]
    counts = [len(reference_tokens(reference, i, 5, eos)) for i in ids]
    for prompt in ([PROMPTS[2], PROMPTS[5]], ids):  # strings, and token id lists
        whole = client.completions.create(model=SERVED, prompt=prompt, max_tokens=5, temperature=0, n=2)
        assert [c.index for c in whole.choices] == [0, 1, 2, 3]
        assert [c.text for c in whole.choices] == [texts[0], texts[0], texts[1], texts[1]]
        assert whole.usage.prompt_tokens == len(ids[0]) + len(ids[1])
        assert whole.usage.completion_tokens == 2 * sum(counts)
    chunks = list(client.completions.create(model=SERVED, prompt=[PROMPTS[2], PROMPTS[5]], max_tokens=5,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    for index in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index) == texts[index]
    assert chunks[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1])
    status, error = error_of(request(server, "POST", "/v1/completions", {"prompt": ["hi"] * 65, "n": 2}))
    assert status == 400 and error["param"] == "prompt" and "more than 128 choices" in error["message"]
    for wrong in ([], [["hi"]], [1, "hi"]):
        status, error = error_of(request(server, "POST", "/v1/completions", {"prompt": wrong}))
        assert status == 400 and error["param"] == "prompt", wrong
    # a batch with a prompt the model cannot take is refused whole: none of its prompts runs
    metrics = server["scheduler"].metrics
    before = metrics.requests
    for wrong in (ids[1] + [10 ** 6], [5] * 95):  # an id outside the vocabulary; too long for max_tokens
        status, error = error_of(request(server, "POST", "/v1/completions",
                                         {"prompt": [ids[0], wrong], "max_tokens": 5, "n": 2}))
        assert status == 400, error
    assert metrics.requests == before


def test_chat_roles_outside_openai_s_are_refused_and_developer_is_the_system_prompt(server):
    chat = {"model": SERVED, "max_tokens": 4, "temperature": 0}
    for role, hint in (("wizard", "must be one of system, developer, user, assistant, tool"),):
        messages = [{"role": role, "content": "hi"}, {"role": "user", "content": "hello"}]
        status, error = error_of(request(server, "POST", "/v1/chat/completions", {**chat, "messages": messages}))
        assert status == 400 and error["param"] == "messages" and hint in error["message"], error
    answers = [server["client"].chat.completions.create(
        messages=[{"role": role, "content": "be brief"}, {"role": "user", "content": "hello"}], **chat)
        for role in ("system", "developer")]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens
    status, error = error_of(request(server, "POST", "/v1/completions", {"prompt": "hi", "suffix": "end"}))
    assert status == 400 and error["param"] == "suffix"


def test_an_lm_server_answers_400_on_embeddings_rerank_and_score(server):
    for route, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                        ("/rerank", {"query": "q", "documents": ["d"]}), ("/score", {"text_1": "a", "text_2": "b"})):
        status, text = request(server, "POST", route, {"model": SERVED, **body})
        assert status == 400 and f"{route} is not served" in json.loads(text)["error"]["message"]
        assert "/v1/completions" in json.loads(text)["error"]["message"]


def test_text_decoded_as_tokens_come_equals_the_whole_decode():
    """The scheduler decodes each new token with the few before it (batching._IncrementalText): with the bundled
    SmolLM2 tokenizer (byte-level BPE), every text so far is a prefix of the whole decode and the last one equals it,
    for random ids (bytes that make no character in between) and for text of multi-byte characters."""
    from vkformers.cli import generate as cli_generate
    from vkformers.models.loading import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cli_generate.default_model())
    rng = np.random.default_rng(0)
    text = "Hello wörld: ünïcode, 日本語のテキスト and emoji 🎉🎉 done."
    cases = [encode(tokenizer, text)] + [[int(t) for t in rng.integers(0, len(tokenizer), 40)] for _ in range(50)]
    for ids in cases:
        rendered = batching._IncrementalText()
        texts = [rendered.extend(tokenizer, ids[:end]) for end in range(1, len(ids) + 1)]
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert all(whole.startswith(t) for t in texts)
        if not whole.endswith("\ufffd"):
            assert texts[-1] == whole
    assert texts[-1] != "" and cases[0] and batching._IncrementalText().extend(tokenizer, cases[0]) == text


def test_stop_string_across_tokens(server):
    """A stop string made of the end of one token and the start of the next cuts the text there."""
    client, tokenizer = server["client"], server["tokenizer"]
    for prompt in PROMPTS:  # a random model's text is mostly bytes: find two whole-character tokens in a row
        ids = encode(tokenizer, prompt)
        whole = client.completions.create(model=SERVED, prompt=ids, max_tokens=12, temperature=0, logprobs=0)
        full, pieces = whole.choices[0].text, whole.choices[0].logprobs.tokens
        for i in range(1, len(pieces)):
            before, stop = "".join(pieces[:i]), pieces[i - 1][-1:] + pieces[i][:1]
            if len(stop) == 2 and "\ufffd" not in stop and full.startswith(before + pieces[i]) \
                    and full.find(stop) == len(before) - 1:
                break
        else:
            continue
        break
    else:
        pytest.fail("no generated text with a stop string across two tokens")
    expected = full[:len(before) - 1]
    for stream in (False, True):
        result = client.completions.create(model=SERVED, prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                                           stream=stream)
        if stream:
            chunks = list(result)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = result.choices[0].text, result.choices[0].finish_reason
        assert (text, finish) == (expected, "stop")


def error_of(status_text):
    status, text = status_text
    return status, json.loads(text)["error"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    route = "/v1/completions"
    status, error = error_of(request(server, "POST", route, raw="{not json"))
    assert status == 400 and error["type"] == "invalid_request_error" and "JSON" in error["message"]
    status, error = error_of(request(server, "POST", route, {"model": "gpt-4", "prompt": "hi"}))
    assert status == 404 and error["code"] == "model_not_found"
    status, error = error_of(request(server, "POST", route, {"model": SERVED, "prompt": "hi " * 200}))
    assert status == 400 and "maximum context length of 96" in error["message"]
    status, error = error_of(request(server, "POST", route, {"model": SERVED, "prompt": "hi", "max_tokens": -1}))
    assert status == 400 and error["param"] == "max_tokens"
    status, error = error_of(request(server, "POST", route, {"model": SERVED, "prompt": [5, 10 ** 6]}))
    assert status == 400 and "vocab" in error["message"]
    status, error = error_of(request(server, "POST", route, {"model": SERVED, "prompt": "hi", "best_of": 2}))
    assert status == 400 and error["param"] == "best_of"
    status, error = error_of(request(server, "POST", route, {"model": SERVED, "prompt": "hi", "stream": True,
                                                             "stream_options": "include_usage"}))
    assert status == 400 and error["param"] == "stream_options"
    status, error = error_of(request(server, "POST", "/v1/chat/completions",
                                     {"model": SERVED, "messages": [{"role": "user", "content": "hi " * 200}]}))
    assert status == 400 and "maximum context length of 96" in error["message"]
    status, error = error_of(request(server, "POST", "/v1/chat/completions", {"model": SERVED, "messages": []}))
    assert status == 400 and error["param"] == "messages"
    for key in ("wrong", None):
        status, error = error_of(request(server, "POST", route, {"model": SERVED, "prompt": "hi"}, key=key))
        assert status == 401 and error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="wrong",
                      max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        server["client"].completions.create(model="other", prompt="hi", max_tokens=2)
    assert server["client"].completions.create(model=SERVED, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def penalized_greedy(reference, ids, count, presence=0.0, frequency=0.0, bias=()):
    """Greedy tokens of ``reference`` after OpenAI's penalties over the tokens generated so far and a logit bias,
    each step a whole forward on the host side's ids (no cache), the choice made in numpy."""
    tokens = list(ids)
    out = []
    for _ in range(count):
        logits = reference(np.asarray([tokens], np.int64)).logits.numpy()[0, -1].astype(np.float32)
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        for token, value in bias:
            logits[token] += value
        out.append(int(logits.argmax()))
        tokens.append(out[-1])
    return out


def test_vllm_and_openai_options_a_client_sends(server, tiny):
    """max_completion_tokens (chat), vLLM's stop_token_ids (the output ends before the token, finish "stop"),
    presence and frequency penalties and logit_bias (the choice numpy makes from the penalized logits), and
    GET /v1/models/{id}."""
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    messages = [{"role": "user", "content": "hello"}]
    capped = client.chat.completions.create(model=SERVED, messages=messages, max_completion_tokens=3, temperature=0)
    same = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=3, temperature=0)
    assert capped.usage.completion_tokens <= 3 and capped.choices[0].message.content == same.choices[0].message.content
    ids = encode(tokenizer, PROMPTS[2])
    plain = reference_tokens(reference, ids, 8).tolist()
    cut = next(i for i in range(2, 8) if plain[i] not in plain[:i])
    stopped = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [plain[cut]], "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == cut + 1
    assert stopped.choices[0].text == tokenizer.decode(plain[:cut], skip_special_tokens=True)
    penalties = dict(presence_penalty=-2.0, frequency_penalty=-0.5)  # (negative: repeats, which greedy here avoids)
    expected = penalized_greedy(reference, ids, 8, presence=-2.0, frequency=-0.5)
    assert expected != plain  # (else the penalties went untested)
    penalized = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True}, **penalties)
    assert penalized.choices[0].logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected]
    assert penalized.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    biased = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=4, temperature=0,
                                       logit_bias={str(plain[0] + 1): 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer.decode([plain[0] + 1] * 4, skip_special_tokens=True)
    assert client.models.retrieve(SERVED).id == SERVED
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_vllm_sampling_extras(server, tiny):
    """vLLM's repetition_penalty (over the prompt and the output: generate's, as transformers applies it), min_tokens
    (no end token nor stop string before that many tokens), allowed_token_ids and include_stop_str_in_output."""
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    ids = encode(tokenizer, PROMPTS[2])
    plain = reference_tokens(reference, ids, 8).tolist()
    expected = reference_tokens(reference, ids, 8, repetition_penalty=1.8, do_sample=False).tolist()
    assert expected != plain  # (else the penalty went untested)
    penalized = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    assert penalized.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    end = expected_eos(server, tiny)[0]
    eager = dict(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0, logit_bias={str(end): 100})
    assert client.completions.create(**eager).usage.completion_tokens == 1  # the end token at once
    held = client.completions.create(**eager, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"  # 5 tokens, then the end
    allowed = sorted({plain[0] + 1, plain[1] + 2, 7})
    chosen = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, seed=3,
                                       logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert {tokenizer.convert_tokens_to_ids(t) for t in chosen.choices[0].logprobs.tokens} <= set(allowed)
    text = tokenizer.decode(plain, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    kept = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    cut = client.completions.create(model=SERVED, prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and text.startswith(kept.choices[0].text)
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for body, param in (({"repetition_penalty": 0}, None), ({"min_tokens": 3, "max_tokens": 2}, None),
                        ({"allowed_token_ids": [10 ** 6]}, None), ({"allowed_token_ids": "1"}, "allowed_token_ids"),
                        ({"use_beam_search": True}, "use_beam_search"), ({"bad_words": ["x"]}, "bad_words"),
                        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output")):
        status, error = error_of(request(server, "POST", "/v1/chat/completions", {**chat, **body}))
        assert status == 400 and (param is None or error["param"] == param), (body, error)
    neutral = {**chat, "bad_words": [], "use_beam_search": False}  # (what changes nothing is taken)
    assert request(server, "POST", "/v1/chat/completions", neutral)[0] == 200


def test_options_this_server_cannot_honour_are_refused(server):
    """Output to a schema and tool calls without a parser would be ignored and the answer wrong: a 400 naming the
    parameter."""
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                        ({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"stop_token_ids": "2"}, "stop_token_ids")):
        status, error = error_of(request(server, "POST", "/v1/chat/completions", {**chat, **body}))
        assert status == 400 and error["param"] == param, (body, error)
    status, error = error_of(request(server, "POST", "/v1/completions",
                                     {"model": SERVED, "prompt": "hi", "logit_bias": {str(10 ** 6): 1}}))
    assert status == 400 and "vocabulary" in error["message"]
    assert request(server, "POST", "/v1/chat/completions", {**chat, "response_format": {"type": "text"},
                                                            "tools": [], "tool_choice": "none"})[0] == 200


def test_many_clients_at_once_get_each_their_own_output(server, tiny):
    """16 client threads, 8 requests each (streamed or not, greedy), against a batch of at most 4 rows: every
    response is the one generate gives its prompt alone, and the server ends with nothing running."""
    tokenizer, reference, scheduler = server["tokenizer"], tiny[2], server["scheduler"]
    eos = expected_eos(server, tiny)
    expected = {p: tokenizer.decode(reference_tokens(reference, encode(tokenizer, p), 6, eos), skip_special_tokens=True)
                for p in PROMPTS}
    failures, finished = [], scheduler.metrics.finished
    client = server["client"]

    def work(index):
        for turn in range(8):
            prompt = PROMPTS[(index + turn) % len(PROMPTS)]
            try:
                if (index + turn) % 2:
                    text = "".join(c.choices[0].text for c in client.completions.create(
                        model=SERVED, prompt=prompt, max_tokens=6, temperature=0, stream=True))
                else:
                    text = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6,
                                                     temperature=0).choices[0].text
                if text != expected[prompt]:
                    failures.append((prompt, text, expected[prompt]))
            except Exception as exc:  # collected: the assertion below names it
                failures.append((prompt, repr(exc)))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert scheduler.metrics.finished == finished + 16 * 8
    wait_for(lambda: scheduler.metrics.live_rows == 0 and scheduler.metrics.waiting == 0)


def test_a_failed_batch_answers_500_and_the_server_goes_on(server, monkeypatch):
    scheduler = server["scheduler"]
    prefill = scheduler.model.prefill

    def broken(*args):
        raise RuntimeError("device lost")
    monkeypatch.setattr(scheduler.model, "prefill", broken)
    errors = scheduler.metrics.errors
    status, error = error_of(request(server, "POST", "/v1/completions", {"model": SERVED, "prompt": "hi",
                                                                         "max_tokens": 3}))
    assert status == 500 and error["type"] == "server_error" and "device lost" in error["message"]
    assert scheduler.metrics.errors == errors + 1
    monkeypatch.setattr(scheduler.model, "prefill", prefill)
    assert request(server, "GET", "/health", key=None)[0] == 200
    assert server["client"].completions.create(model=SERVED, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    monkeypatch.setattr(scheduler, "error", RuntimeError("thread ended"))  # a scheduler whose thread is gone
    status, error = error_of(request(server, "POST", "/v1/completions", {"model": SERVED, "prompt": "hi"}))
    assert status == 503 and error["type"] == "server_error" and "thread ended" in error["message"]
    assert request(server, "GET", "/health", key=None)[0] == 503


def leave_mid_stream(server, monkeypatch, route: str, body: dict) -> bytes:
    """Stream ``body`` (at most 95 tokens wanted) to ``route`` with the scheduler slowed, drop the connection once
    the request decodes, and check that its row left the batch before its end; returns the stream's first line."""
    scheduler = server["scheduler"]
    choose = scheduler._choose
    monkeypatch.setattr(scheduler, "_choose", lambda *args: time.sleep(0.02) or choose(*args))  # slow enough
    connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    connection.request("POST", route, body=json.dumps({**body, "stream": True}),
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    response = connection.getresponse()
    assert response.status == 200
    first = response.readline()  # the first event: the request is decoding
    wait_for(lambda: scheduler.metrics.live_rows == 1)
    cancelled, tokens = scheduler.metrics.cancelled, scheduler.metrics.generation_tokens
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    wait_for(lambda: scheduler.metrics.live_rows == 0 and scheduler.metrics.cache_tokens == 0, 60)
    assert scheduler.metrics.cancelled == cancelled + 1
    assert scheduler.metrics.generation_tokens - tokens < 90
    return first


def test_a_client_leaving_mid_stream_frees_its_row(server, monkeypatch):
    leave_mid_stream(server, monkeypatch, "/v1/completions",
                     {"model": SERVED, "prompt": "a", "max_tokens": 95, "temperature": 0.5, "seed": 1})
    assert server["client"].completions.create(model=SERVED, prompt="hi", max_tokens=2).choices[0].text is not None


def test_a_client_leaving_before_a_whole_response_frees_its_row(server, monkeypatch):
    """Not streamed: the server notices the client gone while it waits for the output, and the request leaves."""
    scheduler = server["scheduler"]
    choose = scheduler._choose
    monkeypatch.setattr(scheduler, "_choose", lambda *args: time.sleep(0.02) or choose(*args))  # slow enough
    connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    body = {"model": SERVED, "prompt": "a", "max_tokens": 95, "temperature": 0, "ignore_eos": True}
    cancelled, tokens = scheduler.metrics.cancelled, scheduler.metrics.generation_tokens
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    wait_for(lambda: scheduler.metrics.live_rows == 1)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    wait_for(lambda: scheduler.metrics.live_rows == 0 and scheduler.metrics.cache_tokens == 0, 60)
    assert scheduler.metrics.cancelled == cancelled + 1
    assert scheduler.metrics.generation_tokens - tokens < 90


# ---------------------------------------------------------------- the command

@contextlib.contextmanager
def serve_command(*args, startup_lines: int = 1):
    """``vkformers serve ARGS --port P`` in a process of its own, yielded as (P, the first ``startup_lines`` lines it
    wrote to stderr) once /health answers; then stopped with Ctrl-C (uvicorn shuts down), which must end it with
    status 0."""
    port = free_port()
    command = [sys.executable, "-c", "import sys; from vkformers.cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", *map(str, args), "--port", str(port)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        lines = [process.stderr.readline() for _ in range(startup_lines)]

        def healthy():
            assert process.poll() is None, "".join(lines) + process.stderr.read()
            try:
                return request({"port": port}, "GET", "/health", key=None)[0] == 200
            except OSError:
                return False
        wait_for(healthy, 120)
        yield port, lines
    finally:
        process.send_signal(signal.SIGINT)
        status = process.wait(60)
    assert status == 0


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def saved_adapter(path, folder):
    """A LoRA adapter of random (non-zero) B matrices on the tiny GGUF model, saved in ``folder``; returns the model
    with it merged."""
    adapted = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    apply_lora(adapted, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    rng = np.random.default_rng(3)
    for _, module in adapted.named_modules():
        if isinstance(module, LoraLinear):
            module.lora_B.weight = vkf.parameter(rng.standard_normal(module.lora_B.weight.shape).astype(np.float32))
    save_adapter(adapted, folder)
    return merge_lora(adapted)


def test_generate_with_an_adapter_continues_as_the_merged_model(tiny, tmp_path, capsys):
    path, tokenizer, base = tiny
    reference = saved_adapter(path, tmp_path / "adapter")
    assert main(["generate", "--model", str(path), "--adapter", str(tmp_path / "adapter"), "--prompt", PROMPTS[1],
                 "--max-new-tokens", "5"]) == 0
    text = capsys.readouterr().out
    ids = encode(tokenizer, PROMPTS[1])
    eos = cli_serve.eos_ids(reference, tokenizer)
    assert text == tokenizer.decode(reference_tokens(reference, ids, 5, eos), skip_special_tokens=True) + "\n"
    assert text != tokenizer.decode(reference_tokens(base, ids, 5, eos), skip_special_tokens=True) + "\n"


def test_the_command_serves_until_stopped(tiny, web, tmp_path):
    """`vkformers serve --adapter` in its own process: it says where, /health answers, the model is named after the
    file, answers with the adapted model's output, and Ctrl-C stops it."""
    path, tokenizer, _ = tiny
    reference = saved_adapter(path, tmp_path / "adapter")
    with serve_command("--model", path, "--max-batch", 2, "--adapter", tmp_path / "adapter", startup_lines=2) \
            as (port, (line, pool)):
        assert line == f"vkformers serve: tiny on http://127.0.0.1:{port}/v1 (ready when /health answers)\n"
        # the default KV cache: paged, sized from the device's memory, prefix caching on
        assert re.fullmatch(r"vkformers serve: paged KV cache: [\d,]+ tokens \([\d,]+ blocks of 16\), [\d.]+ [MG]iB; "
                            r"prefix caching on\n", pool), pool
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        text = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0).choices[0].text
        metrics = request({"port": port}, "GET", "/metrics", key=None)[1]
        blocks = int(re.search(r'vkformers_kv_cache_blocks\{model="tiny"\} (\d+)', metrics).group(1))
        assert f"{blocks:,} blocks of 16" in pool
    ids = encode(tokenizer, PROMPTS[1])
    eos = cli_serve.eos_ids(reference, tokenizer)
    assert text == tokenizer.decode(reference_tokens(reference, ids, 5, eos), skip_special_tokens=True)
    assert text != tokenizer.decode(reference_tokens(tiny[2], ids, 5, eos), skip_special_tokens=True)  # adapted


def test_serve_without_the_extra_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # an import of it fails
    assert main(["serve", "--model", "anything"]) == 1
    assert capsys.readouterr().err == f"vkformers serve: error: {cli_serve.INSTALL_HINT}\n"


def test_a_port_in_use_or_an_unknown_host_is_said_before_the_model_loads(tmp_path, capsys):
    """The socket is bound first: the error names the port or the host, not the (here missing) model."""
    missing = str(tmp_path / "no-model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", missing, "--port", str(port)]) == 1
    assert capsys.readouterr().err == (f"vkformers serve: error: port {port} on 127.0.0.1 is in use: stop what "
                                       f"listens there, or pick another --port\n")
    assert main(["serve", "--model", missing, "--host", "no-such-host.invalid"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vkformers serve: error: --host no-such-host.invalid: not an address this machine can "
                          "listen on") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        from vkformers.cli import build_parser
        build_parser().parse_args(["serve", "--port", "65536"])


def test_served_names():
    assert cli_serve.served_name(None) == "SmolLM2-135M-Instruct"
    assert cli_serve.served_name("/models/tiny.gguf") == "tiny"
    assert cli_serve.served_name("HuggingFaceTB/SmolLM2-360M") == "HuggingFaceTB/SmolLM2-360M"
    assert cli_serve.served_name("./checkpoint/") == "./checkpoint"


def test_serve_arguments():
    from vkformers.cli import build_parser
    args = build_parser().parse_args(["serve", "--model", "m.gguf", "--port", "9000", "--max-batch", "8",
                                      "--max-model-len", "512", "--api-key", "k", "--host", "0.0.0.0"])
    assert (args.model, args.port, args.max_batch, args.max_model_len, args.api_key, args.host) == (
        "m.gguf", 9000, 8, 512, "k", "0.0.0.0")
    assert build_parser().parse_args(["serve", "--kv-cache-tokens", "4096"]).kv_cache_tokens == 4096
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.host, defaults.port, defaults.max_batch, defaults.model) == ("127.0.0.1", 8000, 64, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-batch", "0"])
    assert defaults.prefix_caching and not build_parser().parse_args(["serve", "--no-prefix-caching"]).prefix_caching
    assert defaults.sampling_defaults == "model"
    assert build_parser().parse_args(["serve", "--sampling-defaults", "openai"]).sampling_defaults == "openai"
    assert defaults.gpu_memory_utilization == 0.9 and defaults.kv_cache_tokens is None  # paged, sized from memory
    assert build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    for wrong in ("0", "1.5", "most"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--gpu-memory-utilization", wrong])


def test_loop_mailbox_wakes_the_loop_once_for_what_other_threads_posted_meanwhile():
    """The scheduler's thread posts every row's token of a step; the event loop wakes once for all that arrived before
    it ran, and each queue gets its items in the order posted."""
    async def run():
        loop = asyncio.get_running_loop()
        wakeups = []
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakeups.append(callback)
            return schedule(callback, *args)
        loop.call_soon_threadsafe = counted
        mailbox = cli_serve.LoopMailbox(loop)
        odd, even = asyncio.Queue(), asyncio.Queue()

        def step(first):  # on another thread, while the loop is blocked (it waits for the thread below)
            for i in range(first, first + 100):
                mailbox.post(odd if i % 2 else even, i)
        for first in (0, 100):
            producer = threading.Thread(target=step, args=(first,))
            producer.start()
            producer.join()
            got_odd = [await odd.get() for _ in range(50)]
            got_even = [await even.get() for _ in range(50)]
            assert got_odd == list(range(first + 1, first + 100, 2))
            assert got_even == list(range(first, first + 100, 2))
        assert len(wakeups) == 2  # one per step, not one per item
        assert odd.empty() and even.empty()

    asyncio.run(run())


def test_a_requests_missing_sampling_settings_come_from_the_generation_config(tiny):
    """As vLLM: temperature, top_p and top_k the request leaves out are the generation config's where it sets
    them, OpenAI's otherwise; the request's own win; vLLM's top_k (-1: off) is taken. A seeded request samples
    as generate with those settings."""
    model = SimpleNamespace(generation_config={"temperature": 0.6, "top_k": 20, "do_sample": True, "top_p": None,
                                               "min_p": 0.05})
    defaults = model_sampling_defaults(model)
    assert defaults == {"temperature": 0.6, "top_k": 20, "min_p": 0.05}
    settings = functools.partial(sampling_params, chat=True, prompt_tokens=4, max_model_len=64)
    params = settings({"max_tokens": 2}, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 1.0, 20, 0.05)
    params = settings({"max_tokens": 2, "temperature": 0.9, "top_k": -1, "top_p": 0.5, "min_p": 0}, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.9, 0.5, 0, 0.0)
    assert (settings({"max_tokens": 2}).temperature, settings({"max_tokens": 2}).top_k) == (1.0, 0)
    for wrong, name in (({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p")):
        with pytest.raises(ApiError, match=f"'{name}' must be"):
            settings({"max_tokens": 2, **wrong})
    path, tokenizer, reference = tiny
    ids = encode(tokenizer, PROMPTS[1])
    jobs = [(ids, SamplingParams(max_tokens=6, temperature=1.5, top_k=3, seed=5)),
            (ids, SamplingParams(max_tokens=6, temperature=1.5, min_p=0.3, seed=5))]
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    done = run_together(BatchScheduler(model, tokenizer, max_batch=2), jobs)
    plain = reference_tokens(reference, ids, 6, do_sample=True, temperature=1.5, seed=5).tolist()
    for request, extra in zip(done, ({"top_k": 3}, {"min_p": 0.3})):
        expected = reference_tokens(reference, ids, 6, do_sample=True, temperature=1.5, seed=5, **extra).tolist()
        assert request.generated == expected and expected != plain, extra


def test_tokenize_and_detokenize_routes(server, tiny):
    """vLLM's /tokenize (a prompt as completions read it, with or without special tokens; a chat as the template
    renders it) and /detokenize; bad token ids and a missing key are refused."""
    tokenizer = server["tokenizer"]
    status, text = request(server, "POST", "/tokenize", {"prompt": PROMPTS[0]})
    body = json.loads(text)
    expected = completion_prompt(PROMPTS[0], tokenizer)
    assert status == 200 and body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == server["scheduler"].max_model_len
    status, text = request(server, "POST", "/tokenize", {"prompt": PROMPTS[0], "add_special_tokens": False})
    assert json.loads(text)["tokens"] == encode_plain(tokenizer, PROMPTS[0])
    messages = [{"role": "user", "content": PROMPTS[1]}]
    status, text = request(server, "POST", "/tokenize", {"messages": messages})
    assert json.loads(text)["tokens"] == chat_prompt({"messages": messages}, tokenizer)
    status, text = request(server, "POST", "/detokenize", {"tokens": expected})
    assert status == 200 and json.loads(text)["prompt"] == tokenizer.decode(expected)
    status, text = request(server, "POST", "/detokenize", {"tokens": [len(tokenizer)]})
    assert status == 400 and "outside the vocabulary" in text
    assert request(server, "POST", "/tokenize", {"prompt": "x"}, key=None)[0] == 401


def encode_plain(tokenizer, text):
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def test_a_chat_without_a_template_is_a_400_and_chat_template_gives_one(tmp_path, capsys):
    from vkformers.models.loading import AutoTokenizer
    bare = AutoTokenizer.from_pretrained(Path(__file__).parent / "data" / "streamer")  # no chat template
    with pytest.raises(ApiError, match="--chat-template gives one") as refused:
        chat_prompt({"messages": [{"role": "user", "content": "hi"}]}, bare)
    assert refused.value.status == 400
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert cli_serve.read_chat_template(str(tmp_path / "t.jinja")) == template == cli_serve.read_chat_template(template)
    with pytest.raises(cli_serve.VkformersError, match="no such file, and not a Jinja template"):
        cli_serve.read_chat_template(str(tmp_path / "missing.jinja"))
    bare.chat_template = template
    assert chat_prompt({"messages": [{"role": "user", "content": "hi"}]}, bare) == encode_plain(bare, "hi")


def test_json_mode_answers_a_json_object(server):
    """response_format json_object: the reply is a valid beginning of a JSON object (a whole one when it stops)."""
    from vkformers.models.structured_output import GrammarVocabulary, TokenConstraint, any_object_grammar
    out = server["client"].chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=12, temperature=0,
                                                   response_format={"type": "json_object"})
    text, tokenizer = out.choices[0].message.content, server["tokenizer"]
    check = TokenConstraint(GrammarVocabulary.of(tokenizer, len(tokenizer)), any_object_grammar())
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        check.advance(token)  # (raises where the text stops beginning a JSON object)
    assert text.startswith("{"), text
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
