"""Continuous batching of models with recurrent state (models/batching.py, ROW_STATES of models/cache.py): a pure
Mamba, hybrids of attention and Mamba layers (Zamba's shared blocks too), a hybrid with Gated DeltaNet layers, LFM2's
short convolutions and RecurrentGemma's recurrent blocks each keep a conv (and scan) state per row. Requests joining at different steps (prefilled apart and placed into free rows, or rebuilt with the batch)
and concurrent requests through the openai client against a real server give the tokens ``model.generate`` gives
each alone."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_serve import free_port, run_staggered, wait_for
from tokenizers import Tokenizer, decoders, models

from vkformers.errors import InputError
from vkformers.models.batching import BatchScheduler, SamplingParams
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.tokenizer import PreTrainedTokenizer

FIXTURES = Path(__file__).parent / "fixtures"
# one character a token, covering the fixtures' 48 ids (0-2: pad, bos, eos), so that every output decodes
CHARACTERS = "abcdefghijklmnopqrstuvwxyz .,?0123456789!-:;'"
PROMPTS = ["the state of each row", "a", "mamba on vulkan, batched", "hello there", "gpu", "one two three four five",
           "x y", "continuous batching keeps a state per row"]
LENGTHS = [5, 8, 3, 7, 6, 4, 9, 5]
MODELS = ["mamba", "mamba2", "bamba", "jamba", "qwen3_next", "lfm2", "zamba", "zamba2", "recurrent_gemma", "lfm2_moe", "kimi_linear"]


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


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kv_blocks", [None, 64])
def test_staggered_requests_match_generate_alone(name, kv_blocks):
    if kv_blocks and name in ("lfm2", "lfm2_moe"):
        pytest.skip(f"the {name} fixture's head_dim of 6 is not whole 16-byte rows, which a paged cache needs")
    tokenizer = char_tokenizer()
    reference = load(name)
    jobs = [(tokenizer.encode(p, add_special_tokens=False), SamplingParams(max_tokens=n, temperature=0))
            for p, n in zip(PROMPTS, LENGTHS)]
    expected = [alone(reference, ids, p.max_tokens) for ids, p in jobs]
    scheduler = BatchScheduler(load(name), tokenizer, max_batch=4, max_model_len=64, kv_blocks=kv_blocks,
                               page_size=4).start()
    try:
        requests = run_staggered(scheduler, jobs)
    finally:
        scheduler.close()
    assert scheduler.error is None and scheduler.last_error is None
    assert [r.generated for r in requests] == expected
    assert scheduler.metrics.placements >= 1 and scheduler.metrics.peak_live_rows >= 3
    assert not scheduler.prefix_caching  # a state is not in the blocks: nothing to share


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
