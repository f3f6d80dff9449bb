"""The continuous-batching scheduler over a paged KV cache (models/paged_cache.py): staggered greedy and seeded
requests equal ``model.generate`` alone; a pool too small for every request at once makes requests wait and
preempts the newest (recomputed when it rejoins) without changing any output; blocks follow the tokens held and
all come back when requests finish or leave; a request that could never fit is refused."""
from __future__ import annotations

import pytest
from test_serve import (PROMPTS, encode, prefill_bucket, reference_tokens, run_staggered, run_together, scheduler_on,
                        wait_for, write_tiny_model)

from vkformers.errors import InputError
from vkformers.models import batching
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.gguf import load_gguf_model
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.paged_cache import KVBlocksExhausted

LENGTHS = [5, 9, 3, 12, 7, 4, 10, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("paged"))



@pytest.mark.parametrize("kv_blocks, page_size", [(256, 16), (40, 4)])
def test_paged_batches_match_generate_alone(tiny, kv_blocks, page_size):
    """256 blocks: room for all; 40 blocks of 4 tokens: requests wait for blocks and the newest are preempted."""
    path, tokenizer, reference = tiny
    greedy = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, LENGTHS)]
    sampled = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=i))
               for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in greedy] + \
        [reference_tokens(reference, ids, p.max_tokens, do_sample=True, temperature=0.8, top_p=0.9, seed=p.seed)
         for ids, p in sampled]
    scheduler = scheduler_on(path, tokenizer, max_batch=8, kv_blocks=kv_blocks, page_size=page_size).start()
    try:
        requests = run_staggered(scheduler, greedy) + run_staggered(scheduler, sampled)
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.error is None and scheduler.last_error is None
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    assert all(r.finish_reason == "length" for r in requests)
    metrics = scheduler.metrics
    assert metrics.peak_live_rows >= 3 and metrics.placements >= 1


def test_requests_outgrowing_the_pool_are_preempted_and_recomputed(tiny):
    """Two requests of 40 tokens start together in a pool of 20 blocks of 4 tokens: when it runs out, the newer
    leaves its row (blocks given back), waits, and is prefilled again with its tokens so far once the other is
    done; both outputs are generate's."""
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=40, temperature=0)) for p in PROMPTS[:2]]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = scheduler_on(path, tokenizer, max_batch=4, kv_blocks=21, page_size=4)
    requests = run_together(scheduler, jobs)
    assert scheduler.last_error is None and scheduler.metrics.preemptions >= 1
    assert [r.generated for r in requests] == [e.tolist() for e in expected]


def test_blocks_follow_the_tokens_and_a_request_leaving_gives_them_back(tiny):
    path, tokenizer, reference = tiny
    scheduler = scheduler_on(path, tokenizer, max_batch=4, kv_blocks=64, page_size=4)
    long = scheduler.submit(Request(encode(tokenizer, PROMPTS[7]), SamplingParams(max_tokens=60, temperature=0),
                                    lambda update: None, []))
    short = scheduler.submit(Request(encode(tokenizer, "x"), SamplingParams(max_tokens=3, temperature=0),
                                     lambda update: None, []))
    scheduler.start()
    try:
        wait_for(lambda: short.finished and scheduler.metrics.steps >= 6)
        held = scheduler.metrics.kv_blocks_used
        tokens = len(long.prompt) + len(long.generated)
        assert 0 < held <= -(-(tokens + 8 + 4) // 4) + 2  # one row's tokens (and the lookahead), not the batch's
        long.cancel()
        wait_for(lambda: long.finished and scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert long.finish_reason == "cancelled"
    with pytest.raises(KVBlocksExhausted, match="KV blocks"):
        scheduler_on(path, tokenizer, kv_blocks=8, page_size=4).submit(
            Request(encode(tokenizer, PROMPTS[0]), SamplingParams(max_tokens=40), lambda update: None, []))


def test_the_server_on_a_paged_cache(tiny):
    """A completion through the HTTP routes on a paged scheduler is generate's; one that could never fit the pool
    gets a 503 error object and the server goes on; /metrics counts the blocks."""
    import http.client
    import json
    import socket
    import threading
    import time

    import uvicorn
    from test_serve import free_port, request

    from vkformers.cli import serve as cli_serve
    path, tokenizer, reference = tiny
    scheduler = scheduler_on(path, tokenizer, max_batch=4, max_model_len=96, kv_blocks=12, page_size=4).start()
    web = uvicorn.Server(uvicorn.Config(cli_serve.build_app(scheduler, tokenizer, "tiny"), host="127.0.0.1",
                                        port=free_port(), log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    server = {"port": web.config.port}
    try:
        wait_for(lambda: web.started, 30)
        status, text = request(server, "POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 80})
        assert status == 503 and json.loads(text)["error"]["code"] == "kv_cache_full"
        assert "KV blocks" in json.loads(text)["error"]["message"]
        status, text = request(server, "POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6,
                                                                   "temperature": 0, "ignore_eos": True})
        ids = encode(tokenizer, PROMPTS[0])
        assert status == 200 and json.loads(text)["choices"][0]["text"] == tokenizer.decode(
            reference_tokens(reference, ids, 6), skip_special_tokens=True)
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
        status, text = request(server, "GET", "/metrics")
        assert 'vkformers_kv_cache_blocks{model="tiny"} 11' in text
        assert 'vkformers_kv_cache_blocks_used{model="tiny"} 0' in text
        # a client leaving mid-stream: its request leaves the batch and its blocks go back to the pool
        choose = scheduler._choose
        scheduler._choose = lambda *args: time.sleep(0.02) or choose(*args)  # slow enough to leave mid-stream
        connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "a", "max_tokens": 18, "temperature": 0, "ignore_eos": True, "stream": True}),
            headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event: the request is decoding
        wait_for(lambda: scheduler.metrics.kv_blocks_used > 0)
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        wait_for(lambda: scheduler.metrics.cancelled == 1 and scheduler.metrics.kv_blocks_used == 0, 60)
    finally:
        web.should_exit = True
        thread.join(30)
        scheduler.close()


def test_a_pool_sized_from_device_memory(tiny, monkeypatch):
    """gpu_memory_utilization (vkformers serve's default): as many blocks as fit in that share of the device's
    heap less this process's buffers (the weights) and the activations' reserve, within the driver's budget where it
    reports one; a share too small for one request of max_model_len is an InputError saying what to change."""
    from vkformers.models import batching
    from vkformers.models.paged_cache import block_bytes
    path, tokenizer, _ = tiny
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    device = model.parameters()[0].device
    heap = device.memory()  # the driver's figures (lavapipe: a heap of host memory, no budget)
    assert heap["size"] > 0 and (heap["budget"] == 0 or 0 < heap["usage"] <= heap["budget"])
    per_block = block_bytes(model.num_layers, model.num_kv_heads, model.head_dim, 16, "float32")
    reserve, held = batching.ACTIVATION_RESERVE_MIN, 3 * per_block
    monkeypatch.setattr(batching, "buffer_memory", lambda: {"live_bytes": held, "peak_bytes": held})

    def pool_of(size, budget=0, usage=0, share=0.9):
        monkeypatch.setattr(type(device), "memory", lambda self: {"size": size, "budget": budget, "usage": usage})
        return BatchScheduler(model, tokenizer, max_batch=4, max_model_len=64, gpu_memory_utilization=share)

    size = int((reserve + held + 40.5 * per_block) / 0.9)
    scheduler = pool_of(size)
    assert scheduler.kv_blocks == 40 + 1 and scheduler.prefix_caching  # (+ the scratch block)
    assert scheduler.kv_cache_summary().startswith("paged KV cache: 640 tokens (40 blocks of 16), ")
    # the driver's budget for this process, less what it holds, bounds it too
    assert pool_of(size, budget=reserve + 30.5 * per_block + 1000, usage=1000).kv_blocks == 30 + 1
    # never more blocks than a full batch could hold
    assert pool_of(64 << 30).kv_blocks == 2 * 4 * -(-scheduler._column_limit() // 16) + 1
    with pytest.raises(InputError, match="needs 12; raise the memory share, lower max_model_len"):
        pool_of(int((reserve + held + 5.5 * per_block) / 0.9))
    with pytest.raises(InputError, match="gpu_memory_utilization must be in"):
        pool_of(size, share=1.5)


@pytest.mark.parametrize("name", ["mistral", "bloom"])
def test_models_whose_attention_depends_on_columns_page_by_default(name):
    """A sliding window of 4 (Mistral's fixture) and ALiBi (BLOOM's) on the pool vkformers serve sizes by default:
    paged (without prefix caching), staggered requests each get generate's tokens alone."""
    from test_serve_recurrent import LENGTHS as lengths
    from test_serve_recurrent import PROMPTS as prompts
    from test_serve_recurrent import alone, char_tokenizer, load
    tokenizer = char_tokenizer()
    reference = load(name)
    jobs = [(tokenizer.encode(p, add_special_tokens=False), SamplingParams(max_tokens=n, temperature=0))
            for p, n in zip(prompts, lengths)]
    expected = [alone(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = BatchScheduler(load(name), tokenizer, max_batch=4, max_model_len=64,
                               gpu_memory_utilization=0.9).start()
    try:
        requests = run_staggered(scheduler, jobs)
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.kv_blocks > 1 and not scheduler.prefix_caching
    assert scheduler.error is None and scheduler.last_error is None
    assert [r.generated for r in requests] == expected
    assert scheduler.metrics.placements >= 1 and scheduler.metrics.peak_live_rows >= 3


@pytest.mark.parametrize("page_size", [16, 4])
def test_a_longer_prompt_joins_a_paged_batch_by_moving_its_block_tables(tiny, page_size, monkeypatch):
    """Three short prompts decode in a paged batch of four rows; a prompt longer than the batch's columns takes the
    free row after every row moves right by whole blocks of its table (PagedKVCache.shift_right: no copy, no
    prefill of the running rows again); outputs equal generate alone."""
    prefill_bucket(monkeypatch, 0)  # prompts at their own widths on a GPU too
    path, tokenizer, reference = tiny
    short = [(encode(tokenizer, p), SamplingParams(max_tokens=30, temperature=0)) for p in ("x", "gpu", "hello")]
    long = (encode(tokenizer, " ".join(PROMPTS[5:])), SamplingParams(max_tokens=6, temperature=0))
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in short + [long]]
    scheduler = scheduler_on(path, tokenizer, max_batch=4, kv_blocks=1024 // page_size, page_size=page_size)
    requests = [scheduler.submit(Request(ids, p, lambda update: None, [])) for ids, p in short]  # one batch
    scheduler.start()
    try:
        wait_for(lambda: scheduler.metrics.steps >= 2)
        assert scheduler._state[0].position < len(long[0])
        requests.append(scheduler.submit(Request(*long, lambda update: None, [])))
        wait_for(lambda: all(r.finished for r in requests))
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.last_error is None
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    metrics = scheduler.metrics
    assert (metrics.rebuilds, metrics.placements, metrics.shifts, metrics.peak_live_rows) == (1, 1, 1, 4)


def test_a_paged_batch_at_its_column_limit_gives_back_spare_columns_instead_of_a_rebuild(tiny, monkeypatch):
    """Requests come and go while the batch's columns reach the limit (max_model_len here): every row's spare leading
    blocks go (PagedKVCache.compact, table entries moved, not keys and values) instead of prefilling the batch
    again; outputs equal generate alone and every block comes back."""
    monkeypatch.setattr(batching, "COLUMN_LIMIT", 1)
    monkeypatch.setattr(batching, "COLUMN_ROUNDING", 8)
    prefill_bucket(monkeypatch, 0)  # prompts at their own widths on a GPU too
    path, tokenizer, reference = tiny
    prompts = PROMPTS[:7] * 2  # of 1 to 25 tokens
    lengths = [20, 9, 14, 12, 18, 4, 16] * 2
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = scheduler_on(path, tokenizer, max_batch=2, max_model_len=48, kv_blocks=96, page_size=4)
    requests = run_together(scheduler, jobs)  # two rows at a time, the others joining as rows come free
    assert scheduler.last_error is None and scheduler.error is None
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    metrics = scheduler.metrics
    assert metrics.compactions >= 1 and metrics.steps > 48, (metrics.compactions, metrics.rebuilds, metrics.steps)


def test_prefills_that_outgrow_the_pool_admit_fewer_requests_until_one_finishes(tiny, monkeypatch):
    """Where the pool runs out in a prefill (no request there can be preempted), every request waits again; the
    scheduler then admits half as many at a time until a request finishes, instead of failing the same batch over
    and over (here the estimate of free blocks is fooled into admitting everything at once)."""
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, LENGTHS)]
    expected = [reference_tokens(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = scheduler_on(path, tokenizer, max_batch=8, kv_blocks=32, page_size=4)
    monkeypatch.setattr(scheduler, "_blocks_free", lambda joining, place: True)
    requests = run_together(scheduler, jobs)
    assert scheduler.error is None and scheduler.last_error is None
    assert [r.generated for r in requests] == [e.tolist() for e in expected]
    assert scheduler.metrics.preemptions >= 8 and scheduler._admit_limit is None


@pytest.mark.parametrize("failure", [KVBlocksExhausted, RuntimeError])
def test_a_failure_while_prefilled_prompts_join_loses_no_request(tiny, failure, monkeypatch):
    """The pool running out (or any failure) while prefilled prompts take their rows: those requests are in no row
    yet, and still wait again (or get an error), none left hanging; the pool runs out once here. Prompts prefill 8
    columns a turn: the last chunk (and the placing) comes in a later turn than the one that admitted them."""
    monkeypatch.setattr(batching, "PREFILL_CHUNK", 8)
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(PROMPTS, LENGTHS)]
    expected = [reference_tokens(reference, ids, p.max_tokens).tolist() for ids, p in jobs]
    scheduler = scheduler_on(path, tokenizer, max_batch=8, kv_blocks=256, page_size=4)
    place, failed = scheduler._place, []

    def place_once(*args):
        if not failed:
            failed.append(True)
            raise failure("the pool ran out while placing")
        return place(*args)
    monkeypatch.setattr(scheduler, "_place", place_once)
    scheduler.start()
    try:
        requests = run_staggered(scheduler, jobs)
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert failed and all(r.finished for r in requests)
    if failure is KVBlocksExhausted:
        assert scheduler.last_error is None and [r.generated for r in requests] == expected
    else:
        errors = [r for r in requests if r.finish_reason == "error"]
        assert errors and isinstance(scheduler.last_error, RuntimeError)
        assert all(r.generated == e for r, e in zip(requests, expected) if r.finish_reason != "error")
