"""Prefix caching on the paged KV cache (models/paged_cache.py, BlockPool.register/lookup): a request whose prompt
starts with the full blocks of an earlier prompt (a shared system prompt) prefills only the rest; outputs are
``model.generate``'s with and without it, in a roomy pool, under preemption and in a pool so small that cached
blocks are evicted; every block comes back (none held, reference counts zero) at the end."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_serve import (encode, prefill_bucket, reference_tokens, run_staggered, run_together, scheduler_on, wait_for,
                        write_tiny_model)

from vkformers.models import batching
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.paged_cache import SCRATCH, BlockPool, prefix_keys

SYSTEM = "you are a helpful model on any gpu through vulkan compute; answer in one short line. the question: "
QUESTIONS = ["the capital of france is", "hello", "once upon a time there was a", "gpu", "a b c d e f g h",
             "the quick brown fox"]
LENGTHS = [6, 9, 4, 12, 7, 5]
OTHER = "another system prompt, so that the pool drops blocks of the first one: "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("prefix"))



def check_pool_empty(scheduler):
    pool = scheduler._pool
    assert scheduler.metrics.kv_blocks_used == 0 and pool.used_blocks == 0
    assert not pool.refs.any()
    assert pool.free_blocks == pool.blocks - 1
    assert len(set(pool._free) | set(pool._idle)) == pool.blocks - 1 and SCRATCH not in pool._free


def shared_blocks(a, b, page_size):
    """Full blocks two prompts share from their start (at least one token of b left to prefill)."""
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return min(same, len(a), len(b) - 1) // page_size


def test_a_shared_system_prompt_is_prefilled_once(tiny):
    path, tokenizer, reference = tiny
    first, second = (encode(tokenizer, SYSTEM + q) for q in QUESTIONS[:2])
    hit = shared_blocks(first, second, 4) * 4
    assert hit >= 16  # the system prompt spans several blocks
    scheduler = scheduler_on(path, tokenizer, max_batch=4, kv_blocks=64, page_size=4).start()
    try:
        requests = [scheduler.submit(Request(first, SamplingParams(max_tokens=5, temperature=0), lambda u: None, []))]
        wait_for(lambda: requests[0].finished)
        before = scheduler.metrics.prefill_tokens
        assert scheduler.metrics.prefix_hit_tokens == 0 and scheduler.metrics.kv_blocks_cached >= hit // 4
        requests.append(scheduler.submit(Request(second, SamplingParams(max_tokens=5, temperature=0),
                                                 lambda u: None, [])))
        wait_for(lambda: requests[1].finished)
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.last_error is None
    metrics = scheduler.metrics
    assert metrics.prefill_tokens - before == len(second) - hit  # only the suffix
    assert metrics.prefix_hit_tokens == hit
    assert metrics.prefix_queried_tokens == len(first) + len(second)
    assert [r.generated for r in requests] == [reference_tokens(reference, ids, 5).tolist()
                                               for ids in (first, second)]
    check_pool_empty(scheduler)


@pytest.mark.parametrize("kv_blocks, max_batch", [(256, 8), (80, 4), (64, 2)])
def test_outputs_with_and_without_prefix_caching_are_generate_s(tiny, kv_blocks, max_batch):
    """256 blocks: room for all; 80 and 64 blocks of 4 tokens: requests wait, the newest are preempted, and cached
    blocks no request holds are evicted for new tokens."""
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, SYSTEM + q), SamplingParams(max_tokens=n, temperature=0))
            for q, n in zip(QUESTIONS, LENGTHS)]
    jobs += [(encode(tokenizer, OTHER + q), SamplingParams(max_tokens=n, temperature=0))
             for q, n in zip(QUESTIONS[:3], LENGTHS[3:])]
    jobs += [(encode(tokenizer, SYSTEM + QUESTIONS[0]), SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9,
                                                                       seed=3))]
    expected = [reference_tokens(reference, ids, p.max_tokens).tolist() for ids, p in jobs[:-1]]
    expected.append(reference_tokens(reference, jobs[-1][0], 8, do_sample=True, temperature=0.8, top_p=0.9,
                                     seed=3).tolist())
    results = {}
    for caching in (True, False):
        scheduler = scheduler_on(path, tokenizer, max_batch=max_batch, kv_blocks=kv_blocks, page_size=4,
                                 prefix_caching=caching).start()
        try:
            requests = run_staggered(scheduler, jobs)
            wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
        finally:
            scheduler.close()
        assert scheduler.error is None and scheduler.last_error is None
        results[caching] = [r.generated for r in requests], scheduler.metrics
        check_pool_empty(scheduler)
    (cached, metrics), (plain, plain_metrics) = results[True], results[False]
    assert cached == plain == expected
    assert metrics.prefix_hit_tokens > 0
    if kv_blocks == 256:  # (in small pools, preemptions recompute tokens as they happen to fall)
        assert metrics.prefill_tokens < plain_metrics.prefill_tokens
    assert plain_metrics.prefix_hit_tokens == 0 and plain_metrics.kv_blocks_cached == 0
    if kv_blocks < 256:
        assert metrics.kv_blocks_evicted >= 1


def test_preempted_requests_sharing_a_prefix_are_generate_s(tiny):
    """Three requests of 40 tokens sharing a short system prompt start together in a pool of 35 blocks of 4
    tokens: when it runs out, the newest leaves its row (its shared blocks stay with the others) and rejoins on the
    cached prefix; outputs are generate's with and without prefix caching."""
    path, tokenizer, reference = tiny
    jobs = [(encode(tokenizer, "be brief. " + q), SamplingParams(max_tokens=40, temperature=0))
            for q in QUESTIONS[1:4]]
    expected = [reference_tokens(reference, ids, p.max_tokens).tolist() for ids, p in jobs]
    for caching in (True, False):
        scheduler = scheduler_on(path, tokenizer, max_batch=4, kv_blocks=36, page_size=4, prefix_caching=caching)
        requests = run_together(scheduler, jobs)
        assert scheduler.last_error is None and scheduler.metrics.preemptions >= 1
        assert (scheduler.metrics.prefix_hit_tokens > 0) == caching
        assert [r.generated for r in requests] == expected
        check_pool_empty(scheduler)


def test_the_block_pool_counts_references_and_evicts_the_least_recently_used():
    pool = BlockPool(1, 1, 4, 5, page_size=2)  # 4 blocks
    keys = prefix_keys(np.arange(6), 2)
    assert len(keys) == 3 and prefix_keys(np.arange(6), 2, b"adapter")[0] != keys[0]
    assert prefix_keys([0, 1, 9, 9], 2)[0] == keys[0] and prefix_keys([0, 1, 9, 9], 2)[1] != keys[1]
    blocks = [pool.allocate() for _ in range(3)]
    for key, block in zip(keys, blocks):
        pool.register(key, block)
    assert pool.lookup(keys) == blocks and pool.refs[blocks].tolist() == [2, 2, 2]
    pool.release(blocks)
    assert pool.used_blocks == 3  # still held once
    pool.release(blocks[::-1])  # the last block goes idle first: least recently used
    assert pool.used_blocks == 0 and pool.free_blocks == 4 and pool.cached_blocks == 3
    taken = [pool.allocate(), pool.allocate()]  # the never-used block, then the oldest idle one
    assert taken[1] == blocks[2] and pool.evictions == 1 and pool.cached_prefix(keys) == 2
    assert pool.lookup(keys) == blocks[:2]  # the longest prefix still registered


def test_the_server_reports_prefix_cache_hits(tiny):
    """Two completions sharing the system prompt through the openai client against a paged server: the
    texts are generate's, and /metrics counts the second prompt's cached tokens as hits."""
    import threading

    import openai
    import uvicorn
    from test_serve import free_port, request

    from vkformers.cli import serve as cli_serve
    path, tokenizer, reference = tiny
    scheduler = scheduler_on(path, tokenizer, max_batch=4, kv_blocks=64, page_size=4).start()
    web = uvicorn.Server(uvicorn.Config(cli_serve.build_app(scheduler, tokenizer, "tiny"), host="127.0.0.1",
                                        port=free_port(), log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: web.started, 30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{web.config.port}/v1", api_key="none", max_retries=0)
        texts = [client.completions.create(model="tiny", prompt=SYSTEM + q, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for q in QUESTIONS[:2]]
        ids = [encode(tokenizer, SYSTEM + q) for q in QUESTIONS[:2]]
        assert texts == [tokenizer.decode(reference_tokens(reference, i, 4), skip_special_tokens=True) for i in ids]
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
        text = request({"port": web.config.port}, "GET", "/metrics", key=None)[1]
        hit = shared_blocks(*ids, 4) * 4
        assert f'vkformers_prefix_cache_hits_total{{model="tiny"}} {hit}' in text
        assert f'vkformers_prefix_cache_queries_total{{model="tiny"}} {len(ids[0]) + len(ids[1])}' in text
        assert f'vkformers_prefill_tokens_total{{model="tiny"}} {len(ids[0]) + len(ids[1]) - hit}' in text
        assert 'vkformers_kv_cache_blocks_used{model="tiny"} 0' in text
    finally:
        web.should_exit = True
        thread.join(30)
        scheduler.close()


@pytest.mark.parametrize("name, caching", [("llama", True), ("opt", True), ("gemma2", False), ("mistral", False),
                                           ("bloom", False)])
def test_models_whose_attention_depends_on_columns_run_without_prefix_caching(name, caching):
    """Sliding windows (Gemma-2, Mistral) and ALiBi (BLOOM) measure distances in cache columns, which the masked gap
    of a prefix-cached row would lengthen; OPT counts positions over the mask, so the gap is harmless to it."""
    folder = Path(__file__).parent / "fixtures" / name
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", requires_grad=False)
    assert BatchScheduler(model, None, kv_blocks=16).prefix_caching is caching
    assert not BatchScheduler(model, None).prefix_caching  # contiguous caches: no blocks to share


def test_prefills_after_a_cached_prefix_replay_their_recorded_plan(tiny, monkeypatch):
    """Prompts sharing a system prompt, one after another, laid out at one width (a bucket of 16 columns): each
    after the first prefills from the column its cached blocks end at, reading them through its block tables; from
    the fourth prompt on, that prefill replays the plan the two before it confirmed (its tables, ids, positions and
    mask written into it). Outputs stay generate's, and every block comes back."""
    prefill_bucket(monkeypatch, 16)
    monkeypatch.setattr(batching, "PREFILL_POWERS_OF_TWO", False)  # widths of whole buckets only
    path, tokenizer, reference = tiny
    system, rest = encode(tokenizer, SYSTEM), encode(tokenizer, " ".join(QUESTIONS))
    width = -(-(len(system) + 2) // 16) * 16
    lengths = list(range(2, width - len(system) + 1))[:5]
    prompts = [system + rest[-n:] for n in lengths]
    assert len(prompts) == 5 and len({p[len(system)] for p in prompts}) == 5  # suffixes differ from their start
    scheduler = scheduler_on(path, tokenizer, max_batch=4, kv_blocks=64, page_size=4).start()
    try:
        outputs = [run_staggered(scheduler, [(ids, SamplingParams(max_tokens=3, temperature=0))])[0].generated
                   for ids in prompts]
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.last_error is None
    assert outputs == [reference_tokens(reference, ids, 3).tolist() for ids in prompts]
    metrics = scheduler.metrics
    assert metrics.prefix_hit_tokens == 4 * (len(system) // 4 * 4)
    assert metrics.prefills == 5 and metrics.prefill_replays == 2
    check_pool_empty(scheduler)
