"""Continuous batching of models with recurrent state (models/batching.py, ROW_STATES of models/cache.py): a pure
Mamba, hybrids of attention and Mamba layers (Zamba's shared blocks too), a hybrid with Gated DeltaNet layers, LFM2's
short convolutions, RecurrentGemma's recurrent blocks, RWKV's token shift and WKV state, xLSTM's matrix memory and
MiniMax's lightning-attention state each keep a state per row (the replayable ones in buffers overwritten in place, so
that the batch's decode steps are replayed). Requests joining at different steps (prefilled apart and placed into free
rows, or rebuilt with the batch) and concurrent requests through the openai client against a real server give the
tokens ``model.generate`` gives each alone."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_serve import free_port, prefill_bucket, run_staggered, run_together, wait_for
from tokenizers import Tokenizer, decoders, models

from vkformers.engine.function import no_grad
from vkformers.errors import InputError
from vkformers.models import batching
from vkformers.models.batching import BatchScheduler, SamplingParams
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.tokenizer import PreTrainedTokenizer

FIXTURES = Path(__file__).parent / "fixtures"
# one character a token, covering the fixtures' 48 ids (0-2: pad, bos, eos), so that every output decodes
CHARACTERS = "abcdefghijklmnopqrstuvwxyz .,?0123456789!-:;'"
PROMPTS = ["the state of each row", "a", "mamba on vulkan, batched", "hello there", "gpu", "one two three four five",
           "x y", "continuous batching keeps a state per row"]
LENGTHS = [5, 8, 3, 7, 6, 4, 9, 5]
MODELS = ["mamba", "mamba2", "bamba", "jamba", "qwen3_next", "lfm2", "zamba", "zamba2", "recurrent_gemma", "rwkv", "xlstm",
          "minimax", "lfm2_moe", "kimi_linear"]


def char_tokenizer():
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(CHARACTERS)}
    assert len(vocab) == 48
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<pad>"))
    backend.add_special_tokens(["<pad>", "<s>", "</s>"])
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizer(backend, {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"})


def load(name):
    return AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)


def alone(model, ids, max_tokens):
    ids = np.asarray(ids, np.int64)[None]
    return model.generate(ids, max_new_tokens=max_tokens, eos_token_id=[])[0, ids.shape[1]:].tolist()


def serve_staggered(name, kv_blocks, paced: bool = False) -> BatchScheduler:
    """Serves the staggered requests (PROMPTS, LENGTHS, greedy) on fixture ``name`` with contiguous caches
    (``kv_blocks`` None) or a paged one, checks that each got the tokens generate gives it alone and that the
    scheduler met no error, and returns the (closed) scheduler for its metrics. ``paced``: the token choice slowed,
    so that the later requests find a running batch (replayed steps are quick)."""
    tokenizer = char_tokenizer()
    jobs = [(tokenizer.encode(p, add_special_tokens=False), SamplingParams(max_tokens=n, temperature=0))
            for p, n in zip(PROMPTS, LENGTHS)]
    reference = load(name)
    expected = [alone(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = BatchScheduler(load(name), tokenizer, max_batch=4, max_model_len=64, kv_blocks=kv_blocks,
                               page_size=4)
    if paced:
        choose = scheduler._choose
        scheduler._choose = lambda *args: time.sleep(0.01) or choose(*args)
    scheduler.start()
    try:
        requests = run_staggered(scheduler, jobs)
    finally:
        scheduler.close()
    assert scheduler.error is None and scheduler.last_error is None
    assert [r.generated for r in requests] == expected
    return scheduler


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kv_blocks", [None, 64])
def test_staggered_requests_match_generate_alone(name, kv_blocks):
    if kv_blocks and name in ("lfm2", "lfm2_moe"):  # head_dim 6 is not whole 16-byte rows, which a paged cache needs
        with pytest.raises(InputError, match="a paged KV cache cannot run .*head_dim of 6 in float32"):
            BatchScheduler(load(name), char_tokenizer(), max_batch=4, max_model_len=64, kv_blocks=kv_blocks,
                           page_size=4)
        return
    scheduler = serve_staggered(name, kv_blocks, paced=True)
    assert scheduler.metrics.placements >= 1 and scheduler.metrics.peak_live_rows >= 3
    assert not scheduler.prefix_caching  # a state is not in the blocks: nothing to share
    # the states sit in buffers overwritten in place: decode steps replay their recorded plan, the rows' states
    # moved in and out of those buffers as requests join
    assert scheduler.metrics.replayed_steps >= scheduler.metrics.steps // 3


@pytest.mark.parametrize("name", ["mamba", "bamba"])
def test_concurrent_clients_of_a_recurrent_model(name):
    import openai
    import uvicorn

    from vkformers.cli import serve as cli_serve
    tokenizer = char_tokenizer()
    reference = load(name)
    expected = [tokenizer.decode(alone(reference, tokenizer.encode(p, add_special_tokens=False), n),
                                 skip_special_tokens=True) for p, n in zip(PROMPTS, LENGTHS)]
    scheduler = BatchScheduler(load(name), tokenizer, max_batch=8, max_model_len=64).start()
    web = uvicorn.Server(uvicorn.Config(cli_serve.build_app(scheduler, tokenizer, name), host="127.0.0.1",
                                        port=free_port(), log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: web.started, 30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{web.config.port}/v1", api_key="none", max_retries=0)

        def complete(job):
            prompt, count = job
            return client.completions.create(model=name, prompt=prompt, max_tokens=count, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, zip(PROMPTS, LENGTHS)))
    finally:
        web.should_exit = True
        thread.join(30)
        scheduler.close()
    assert scheduler.last_error is None and texts == expected


def test_layer_state_laid_out_by_column_is_still_refused():
    with pytest.raises(InputError, match="index_keys"):
        BatchScheduler(load("axk2"), None)


@pytest.mark.parametrize("name, reason", [
    ("lfm2", "head_dim of 6 in float32 is not a whole number of 16-byte vectors"),
    ("mamba", "the model has no attention layers, no keys or values to page"),
    ("bamba", None)])
def test_where_a_paged_cache_cannot_run_serve_falls_back_to_contiguous_caches(name, reason):
    """A pool sized from memory (vkformers serve's default) where the paged decode attention cannot read the rows
    (LFM2's fixture: head_dim 6), or where there is nothing to page (pure Mamba): contiguous caches, and the line the
    command prints says why."""
    scheduler = BatchScheduler(load(name), char_tokenizer(), max_batch=4, max_model_len=64, gpu_memory_utilization=0.9)
    if reason is None:
        assert scheduler.kv_blocks > 1 and scheduler.kv_cache_summary().startswith("paged KV cache: ")
    else:
        assert scheduler.kv_blocks is None and scheduler.kv_cache_summary() == "contiguous KV caches: " + (
            f"its {reason}, which the paged decode attention reads" if name == "lfm2" else reason)


@pytest.mark.parametrize("name", ["rwkv", "jamba"])
def test_a_paged_batch_of_states_at_its_column_limit_gives_back_spare_columns(name, monkeypatch):
    """Requests come and go while the batch's columns reach the limit: the columns every row has to spare go
    (PagedKVCache.compact), also where the model writes no keys or values (RWKV: the rows' tokens are found in the
    mask, as no blocks are held); outputs equal generate alone."""
    monkeypatch.setattr(batching, "COLUMN_LIMIT", 1)
    monkeypatch.setattr(batching, "COLUMN_ROUNDING", 8)
    prefill_bucket(monkeypatch, 0)
    tokenizer = char_tokenizer()
    lengths = [20, 9, 14, 12, 18, 4, 16, 10]
    jobs = [(tokenizer.encode(p, add_special_tokens=False), SamplingParams(max_tokens=n, temperature=0))
            for p, n in zip(PROMPTS, lengths)]
    reference = load(name)
    expected = [alone(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = BatchScheduler(load(name), tokenizer, max_batch=2, max_model_len=64, kv_blocks=64, page_size=4)
    requests = run_together(scheduler, jobs)  # two rows at a time, the others joining as rows come free
    assert scheduler.error is None and scheduler.last_error is None
    assert [r.generated for r in requests] == expected
    assert scheduler.metrics.compactions >= 1, (scheduler.metrics.compactions, scheduler.metrics.rebuilds)


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefills_of_left_padded_rows_equal_one_prefill(name):
    """A rebuild prefills its left-padded rows in chunks of columns: a row whose tokens begin where a chunk
    begins (all padding before it) carries no state from the padding across the boundary (RWKV's token shift did:
    its state held the last padded column), so the last logits equal one prefill of every column."""
    model = load(name)
    scheduler = BatchScheduler(model, char_tokenizer(), max_batch=4, max_model_len=48)
    histories = [list(range(3, 21)), [7, 9], list(range(20, 36)), [11, 12, 13, 14]]  # 18, 2, 16 and 4 tokens

    def last_logits(chunk):
        ids, mask = scheduler._left_padded(histories, 4)
        cache, _ = scheduler._cache(4, ids.shape[1] + 8)
        positions = model.generation_positions(mask, ids, ids.shape[1])
        with no_grad():
            for start in range(0, ids.shape[1], chunk):
                end = min(start + chunk, ids.shape[1])
                logits = model.prefill(ids[:, start:end], mask[:, :end], positions[:, start:end], cache)
        return logits

    whole, chunked = last_logits(64), last_logits(16)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-5 * float(np.abs(whole).max()))


@pytest.mark.parametrize("name", MODELS)
def test_a_left_padded_row_of_a_batch_equals_the_row_alone(name):
    """On the scheduler's caches padding only lays rows out: a left-padded row's last logits are those of its
    tokens alone (RecurrentGemma's convolution took the padding's inputs, as transformers does with a mask)."""
    model = load(name)
    scheduler = BatchScheduler(model, char_tokenizer(), max_batch=2, max_model_len=48)
    histories = [[18, 11, 30, 30, 30, 30], [7, 16, 9, 3, 18, 5, 16, 15, 15, 17, 6, 11, 17, 5, 9]]
    ids, mask = scheduler._left_padded(histories, 2)
    cache, _ = scheduler._cache(2, ids.shape[1] + 8)
    with no_grad():
        batched = model.prefill(ids, mask, model.generation_positions(mask, ids, ids.shape[1]), cache)
        alone = np.stack([model(np.array([h], np.int64)).logits.numpy()[0, -1] for h in histories])
    np.testing.assert_allclose(batched, alone, rtol=0, atol=1e-5 * float(np.abs(alone).max()))


@pytest.mark.parametrize("name", MODELS)
def test_rebuilds_in_chunks_that_replay_recorded_prefills_equal_each_row_alone(name):
    """Four rebuilds of one layout (rows of 38, 30 and 14 tokens, prefilled 10 columns at a time), so that the
    later ones replay the plans the earlier recorded: every row's last logits are its tokens' alone. (Chunks of one
    width share the engine's plan and differ in the padded positions' keep mask, a constant input: a replayed chunk
    read the mask the chunk after it left in the plan's buffers, and the row all padding in it took its pad tokens
    into its state, in Mamba, Mamba-2 and xLSTM.)"""
    model = load(name)
    scheduler = BatchScheduler(model, char_tokenizer(), max_batch=4, max_model_len=48)
    rng = np.random.default_rng(0)
    with no_grad():
        for _ in range(4):
            histories = [rng.integers(3, 40, n).tolist() for n in (38, 30, 14)]
            ids, mask = scheduler._left_padded(histories, 3)
            cache, _ = scheduler._cache(3, ids.shape[1] + 8)
            positions = model.generation_positions(mask, ids, ids.shape[1])
            for start in range(0, ids.shape[1], 10):
                end = min(start + 10, ids.shape[1])
                logits = scheduler._prefill(ids[:, start:end], mask[:, :end], positions[:, start:end], cache)
            alone = np.stack([model(np.array([h], np.int64)).logits.numpy()[0, -1] for h in histories])
            np.testing.assert_allclose(logits, alone, rtol=0, atol=1e-5 * float(np.abs(alone).max()))
    chunks = -(-ids.shape[1] // 10)  # the width the device lays the rows out at (a GPU rounds 38 up to 64)
    assert scheduler.metrics.prefill_replays == 2 * chunks  # every chunk of the last two rebuilds
