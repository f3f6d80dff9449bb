"""``vkformers serve`` under a soak: 1,000 short completions from 16 client threads (keep-alive connections, one in
four streamed) against the tiny random llama of test_serve.py served by uvicorn on a free local port. No request may
fail, every answer must be well-formed with exact usage counts, and the server's memory must be flat after a warm-up
at the same load.

Flat, measured at two idle points with the bounded caches let go: the scheduler's batch caches and the plan cache
(``release_caches``: at most 64 recorded plans, but which ones are held depends on how the threads' requests happened
to batch) and the engine's cache of strides by shape (4,096 shapes, filled as batches of new widths come). Then the
device buffer bytes must be exactly equal, the small-object heap (``sys.getallocatedblocks``: pymalloc's blocks of at
most 512 bytes, where every Python object of a per-request leak would lie) within ``BLOCKS`` in all, under one block
per four requests (it moves by about 100 either way), and the objects the garbage collector tracks within
``OBJECTS``. A leak of one object per request fails both.
"""
from __future__ import annotations

import gc
import http.client
import json
import sys
import threading

import numpy as np
import pytest

from test_serve import SERVED, encode, free_port, uvicorn, wait_for, write_tiny_model
from vkformers.cli import serve as cli_serve
from vkformers.engine import lazy
from vkformers.models.batching import BatchScheduler
from vkformers.models.gguf import load_gguf_model
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime.vulkan import buffer_memory

THREADS = 16
REQUESTS = 1000
WARM_UP = 320  # at the soak's load: every batch size, prompt width and decode capture of it recorded once
BLOCKS = REQUESTS // 4
OBJECTS = 100  # gc-tracked objects: the same held ones before and after but for a few (it moves by about 10)
WORDS = ["hello", "gpu", "the", "quick", "fox", "x", "a b", "capital", "vulkan", "time"]


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory):
    if uvicorn is None:
        pytest.fail("the soak test needs pip install 'vkformers[serve]' (Starlette, uvicorn)", pytrace=False)
    path, tokenizer, _ = write_tiny_model(tmp_path_factory.mktemp("soak"))
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    scheduler = BatchScheduler(model, tokenizer, max_batch=THREADS, max_model_len=64,
                               eos=cli_serve.eos_ids(model, tokenizer)).start()
    app = cli_serve.build_app(scheduler, tokenizer, SERVED)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30)
    yield port, scheduler, tokenizer
    server.should_exit = True
    thread.join(30)
    scheduler.close()


def jobs(count: int, seed: int):
    """(prompt, max_tokens, stream) of ``count`` short requests: prompts of one to three words, 2-4 tokens out."""
    rng = np.random.default_rng(seed)
    return [(" ".join(rng.choice(WORDS, int(rng.integers(1, 4)))), int(rng.integers(2, 5)), i % 4 == 0)
            for i in range(count)]


def complete(connection, prompt: str, max_tokens: int, stream: bool) -> dict:
    """One /v1/completions request on a keep-alive connection: the answer, a streamed one gathered into the same
    shape (its text joined, the finish reason and usage of its last events)."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    assert response.status == 200, data[:200]
    if not stream:
        return json.loads(data)
    events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
    assert len(finish) == 1 and chunks[-1]["choices"] == [], chunks[-1]
    return {"object": "text_completion", "usage": chunks[-1]["usage"],
            "choices": [{"index": 0, "text": "".join(c["text"] for c in choices), "finish_reason": finish[0]}]}


def soak(port: int, tokenizer, count: int, seed: int) -> list[str]:
    """Send ``count`` requests from THREADS threads and check every answer; the failures, as strings."""
    work = jobs(count, seed)
    failures = []

    def client(first: int):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            for prompt, max_tokens, stream in work[first::THREADS]:
                try:
                    answer = complete(connection, prompt, max_tokens, stream)
                    prompt_tokens = len(encode(tokenizer, prompt))
                    assert answer["object"] == "text_completion"
                    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                                               "total_tokens": prompt_tokens + max_tokens}, answer["usage"]
                    (choice,) = answer["choices"]
                    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str), choice
                except Exception as exc:  # gathered: the test reports the first ones
                    failures.append(f"{prompt!r} {max_tokens} stream={stream}: {exc!r}")
                    connection.close()
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def idle_memory(scheduler) -> tuple[int, int, int]:
    """(device buffer bytes, pymalloc blocks, gc-tracked objects) with the bounded caches let go."""
    assert scheduler.release_caches(60)
    lazy.contiguous_strides.cache_clear()
    gc.collect()
    return buffer_memory()["live_bytes"], sys.getallocatedblocks(), len(gc.get_objects())


def test_soak_of_short_requests_from_16_threads_keeps_memory_flat(soak_server):
    port, scheduler, tokenizer = soak_server
    assert soak(port, tokenizer, WARM_UP, seed=1) == []
    buffers, blocks, objects = idle_memory(scheduler)
    finished = scheduler.metrics.finished
    failures = soak(port, tokenizer, REQUESTS, seed=2)
    after = idle_memory(scheduler)
    assert failures == [], f"{len(failures)} of {REQUESTS} failed, first: {failures[:3]}"
    assert scheduler.metrics.finished - finished == REQUESTS and scheduler.last_error is None
    assert after[0] == buffers, f"device buffers {buffers:,} -> {after[0]:,} bytes"
    assert after[1] - blocks <= BLOCKS, f"pymalloc blocks {blocks:,} -> {after[1]:,} over {REQUESTS} requests"
    assert after[2] - objects <= OBJECTS, f"gc-tracked objects {objects:,} -> {after[2]:,}"
