"""Prompt log-probabilities in ``vkformers serve``: OpenAI's ``echo`` on /v1/completions (the prompt's text, and with
``logprobs`` its tokens' entries, before the completion; ``max_tokens`` 0: the prompt alone) and vLLM's
``prompt_logprobs`` (on each completions choice, on a chat response), as lm-evaluation-harness's local-completions
model scores loglikelihood tasks with them. The scheduler scores such prompts apart (BatchScheduler._score_chunk):
every prompt token's log-probability must be the float64 log-softmax of the model's own forward (the vkformers model
called directly, no cache) at the position before it, within LOGPROB_ATOL; a batch of prompts of several lengths
(padded rows, chunks of a few positions) each as the prompt alone; the completion after the prompt as the server
gives it without echo; a prompt that shares full blocks with an earlier one on a prefix-caching paged server gets
every position's entry all the same. On the tiny random GGUF llama of test_serve, and fixtures of models with
recurrent state. The engine is not shared across threads: every reference forward runs while the scheduler is
idle."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_serve import (PROMPTS, SERVED, encode, error_of, openai, reference_tokens, request, scheduler_on,  # noqa: F401
                        serving, serving_tiny, wait_for, web, write_tiny_model)  # (web: a fixture)
from test_serve_recurrent import PROMPTS as RECURRENT_PROMPTS
from test_serve_recurrent import alone, char_tokenizer, load

from vkformers.cli import serve as cli_serve
from vkformers.engine.function import no_grad
from vkformers.models import batching
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.gguf import load_gguf_model
from vkformers.models.loading import AutoModelForCausalLM

# float32 logits of magnitude ~10 computed with another layout (a cache, chunks, padded rows) differ from the whole
# forward's by a few units in their last place: measured up to 4e-6 on these prompts
LOGPROB_ATOL = 2e-5
SYSTEM = "you are a helpful model on any gpu through vulkan compute; answer in one short line. the question: "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("echo"))


@pytest.fixture(scope="module")
def server(tiny, web):  # noqa: F811 (the fixture)
    with serving_tiny(tiny) as served:
        yield served


def model_logprobs(reference, ids) -> np.ndarray:
    """The float64 log-softmax [len(ids), vocab] of the model's own forward over ``ids`` (no cache, one row)."""
    with no_grad():
        logits = reference(np.asarray([ids], np.int64)).logits.numpy()[0].astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def expected_prompt_logprobs(reference, ids) -> np.ndarray:
    """Each prompt token's log-probability after the first, under the position before it."""
    return model_logprobs(reference, ids)[np.arange(len(ids) - 1), ids[1:]]


def text_of(tokenizer, token) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def check_echoed_logprobs(tokenizer, reference, ids, logprobs, top):
    """The first len(ids) entries of an echoed completion's logprobs object are the prompt's: its tokens, null for
    the first, then the model's log-probabilities, each with its ``top`` likeliest tokens and itself; text offsets
    follow the tokens."""
    assert logprobs.tokens[:len(ids)] == [text_of(tokenizer, t) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = model_logprobs(reference, ids)
    np.testing.assert_allclose(logprobs.token_logprobs[1:len(ids)], expected[np.arange(len(ids) - 1), ids[1:]],
                               rtol=0, atol=LOGPROB_ATOL)
    for position, (token, shown) in enumerate(zip(ids[1:], logprobs.top_logprobs[1:len(ids)])):
        row = expected[position]
        likeliest = {text_of(tokenizer, t): row[t] for t in np.argsort(-row, kind="stable")[:top]}
        likeliest.setdefault(text_of(tokenizer, token), row[token])
        assert shown.keys() == likeliest.keys()
        np.testing.assert_allclose([shown[k] for k in likeliest], list(likeliest.values()), rtol=0, atol=LOGPROB_ATOL)
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs.tokens))


def test_an_echoed_prompt_s_logprobs_are_the_model_s_own_and_the_completion_follows_unchanged(server, tiny):
    """A string prompt and the same as token ids: echo gives back the prompt text (a string as sent, ids decoded)
    and its entries, then the completion and its entries as the request without echo gets them; usage alike."""
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    prompt = PROMPTS[2]
    ids = encode(tokenizer, prompt)
    for given, text in ((prompt, prompt), (ids, tokenizer.decode(ids, skip_special_tokens=False))):
        plain = client.completions.create(model=SERVED, prompt=given, max_tokens=6, temperature=0, logprobs=2)
        echoed = client.completions.create(model=SERVED, prompt=given, max_tokens=6, temperature=0, logprobs=2,
                                           echo=True)
        choice, alone = echoed.choices[0], plain.choices[0]
        assert choice.text == text + alone.text and choice.finish_reason == alone.finish_reason
        assert echoed.usage == plain.usage
        check_echoed_logprobs(tokenizer, reference, ids, choice.logprobs, 2)
        generated = choice.logprobs.token_logprobs[len(ids):]
        assert choice.logprobs.tokens[len(ids):] == alone.logprobs.tokens
        np.testing.assert_allclose(generated, alone.logprobs.token_logprobs, rtol=0, atol=LOGPROB_ATOL)
        assert [set(top) for top in choice.logprobs.top_logprobs[len(ids):]] == \
            [set(top) for top in alone.logprobs.top_logprobs]
        # the completion's first token: chosen from the prompt's last position, as the model gives it
        first = model_logprobs(reference, ids)[-1]
        assert abs(generated[0] - first.max()) < LOGPROB_ATOL
        assert choice.model_extra["prompt_logprobs"][0] is None  # (vLLM's: echo's logprobs as prompt_logprobs)
    without_logprobs = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert without_logprobs.choices[0].text == prompt + alone.text and without_logprobs.choices[0].logprobs is None
    status, text = request(server, "GET", "/metrics", key=None)
    counted = re.search(rf'vkformers_prompt_logprob_tokens_total{{model="{SERVED}"}} (\d+)', text)
    assert status == 200 and int(counted.group(1)) >= 2 * len(ids)


def test_max_tokens_0_with_echo_gives_the_prompt_alone(server, tiny):
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    for prompt in PROMPTS[:3]:
        ids = encode(tokenizer, prompt)
        for logprobs in (None, 3):
            response = client.completions.create(model=SERVED, prompt=prompt, max_tokens=0, echo=True,
                                                 logprobs=logprobs)
            choice = response.choices[0]
            assert (choice.text, choice.finish_reason) == (prompt, "length")
            assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)
            if logprobs is None:
                assert choice.logprobs is None
            else:
                assert len(choice.logprobs.tokens) == len(ids)
                check_echoed_logprobs(tokenizer, reference, ids, choice.logprobs, logprobs)
    status, error = error_of(request(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}))
    assert status == 400 and error["param"] == "max_tokens" and "'echo': true" in error["message"]


def test_a_batch_of_prompts_of_several_lengths_each_echoes_as_alone(server, tiny):
    """prompt as a list (strings, and token id lists) with n=2: each choice's echo is that of its prompt sent alone,
    its entries the model's."""
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    prompts = [PROMPTS[0], PROMPTS[7], PROMPTS[3], PROMPTS[1]]
    ids = [encode(tokenizer, p) for p in prompts]
    assert len({len(i) for i in ids}) == len(ids)
    alone = [client.completions.create(model=SERVED, prompt=p, max_tokens=3, temperature=0, logprobs=1,
                                       echo=True).choices[0] for p in prompts]
    for given in (prompts, ids):
        batch = client.completions.create(model=SERVED, prompt=given, max_tokens=3, temperature=0, logprobs=1,
                                          echo=True, n=2)
        assert [c.index for c in batch.choices] == list(range(8))
        for index, choice in enumerate(batch.choices):
            single = alone[index // 2]
            text = prompts[index // 2] if given is prompts else tokenizer.decode(ids[index // 2],
                                                                                  skip_special_tokens=False)
            assert choice.text == text + single.text[len(prompts[index // 2]):]
            assert choice.logprobs.tokens == single.logprobs.tokens
            np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], single.logprobs.token_logprobs[1:], rtol=0,
                                       atol=LOGPROB_ATOL)
        assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    for prompt_ids, single in zip(ids, alone):
        check_echoed_logprobs(tokenizer, reference, prompt_ids, single.logprobs, 1)


def test_a_streamed_echo_sends_the_prompt_in_the_first_chunk(server):
    """As vLLM streams it: the first chunk holds the prompt's text and entries; the chunks add up to the whole
    response."""
    client, tokenizer = server["client"], server["tokenizer"]
    ids = encode(tokenizer, PROMPTS[5])
    options = dict(model=SERVED, prompt=PROMPTS[5], max_tokens=5, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**options).choices[0]
    chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **options)]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPTS[5]) and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) >= len(ids)
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == whole.text
    assert [t for p in pieces for t in p.logprobs.tokens] == whole.logprobs.tokens
    np.testing.assert_allclose([lp for p in pieces for lp in p.logprobs.token_logprobs][1:],
                               whole.logprobs.token_logprobs[1:], rtol=0, atol=LOGPROB_ATOL)
    # (the prompt's offsets; a streamed completion's count the text sent so far, which may hold back a character)
    assert first.logprobs.text_offset[:len(ids)] == whole.logprobs.text_offset[:len(ids)]
    assert pieces[-1].finish_reason == whole.finish_reason and chunks[-1].usage.completion_tokens >= 1
    prompt_only = list(client.completions.create(model=SERVED, prompt=PROMPTS[5], max_tokens=0, echo=True,
                                                 stream=True))
    assert "".join(c.choices[0].text for c in prompt_only) == PROMPTS[5]
    assert prompt_only[-1].choices[0].finish_reason == "length"


def check_vllm_prompt_logprobs(tokenizer, reference, ids, listed, top):
    """vLLM's prompt_logprobs: null for the first token; then per token a dict of token id (a string) ->
    {logprob, rank, decoded_token} holding the token itself (its rank among the vocabulary) and the ``top``
    likeliest (ranks 1..top)."""
    assert len(listed) == len(ids) and listed[0] is None
    expected = model_logprobs(reference, ids)
    for position, (token, item) in enumerate(zip(ids[1:], listed[1:])):
        row = expected[position]
        likeliest = [int(t) for t in np.argsort(-row, kind="stable")[:top]]
        assert set(item) == {str(t) for t in likeliest} | {str(token)}
        for key, entry in item.items():
            assert entry["decoded_token"] == text_of(tokenizer, int(key))
            assert abs(entry["logprob"] - row[int(key)]) < LOGPROB_ATOL
        for rank, t in enumerate(likeliest, 1):
            assert item[str(t)]["rank"] == rank
        mine = row[token]  # its rank: the tokens at least as likely (ties in float32 of the model's counted alike)
        assert np.sum(row > mine + LOGPROB_ATOL) + 1 <= item[str(token)]["rank"] <= np.sum(row >= mine - LOGPROB_ATOL)


def test_vllm_s_prompt_logprobs_on_completions_and_chat(server, tiny):
    tokenizer, reference, client = server["tokenizer"], tiny[2], server["client"]
    ids = encode(tokenizer, PROMPTS[4])
    status, text = request(server, "POST", "/v1/completions", {"model": SERVED, "prompt": PROMPTS[4], "max_tokens": 2,
                                                               "temperature": 0, "prompt_logprobs": 3, "n": 2})
    assert status == 200
    body = json.loads(text)
    for choice in body["choices"]:  # on each choice, as vLLM's; no echo: the text is the completion alone
        check_vllm_prompt_logprobs(tokenizer, reference, ids, choice["prompt_logprobs"], 3)
        assert choice["logprobs"] is None and not choice["text"].startswith(PROMPTS[4])
    assert "prompt_logprobs" not in body
    response = client.completions.create(model=SERVED, prompt=ids, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 0})
    check_vllm_prompt_logprobs(tokenizer, reference, ids, response.choices[0].model_extra["prompt_logprobs"], 0)
    messages = [{"role": "user", "content": "hello"}]
    chat_ids = [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                              return_tensors="np")["input_ids"][0]]
    answer = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=3, temperature=0, n=2,
                                            extra_body={"prompt_logprobs": 2})
    check_vllm_prompt_logprobs(tokenizer, reference, chat_ids, answer.model_extra["prompt_logprobs"], 2)
    plain = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=3, temperature=0)
    assert answer.choices[0].message.content == plain.choices[0].message.content
    assert "prompt_logprobs" not in (plain.model_extra or {})


def test_lm_evaluation_harness_loglikelihood_requests(server, tiny):
    """lm-evaluation-harness's local-completions payload for loglikelihood: context and continuation token ids as
    one prompt each, echo, max_tokens 1, logprobs 1; read as it reads them, token_logprobs[ctxlen:-1] sum to the
    continuation's log-likelihood and are greedy where each is the likeliest token (its check: the token's logprob
    equal to the top one's)."""
    tokenizer, reference = server["tokenizer"], tiny[2]
    context = encode(tokenizer, PROMPTS[0])
    greedy = reference_tokens(reference, context, 3).tolist()
    likelihood = model_logprobs(reference, context + greedy)
    unlikely = [int(np.argsort(likelihood[len(context) - 1])[0])] + greedy[1:]  # the least likely first token
    requests = [context + greedy, context + unlikely]
    payload = {"model": SERVED, "prompt": requests, "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True,
               "seed": 1234}
    status, text = request(server, "POST", "/v1/completions", payload)
    assert status == 200
    choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
    ctxlen = len(context)
    for choice, tokens, expected_greedy in zip(choices, requests, (True, False)):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(tokens) + 1
        continuation = logprobs["token_logprobs"][ctxlen:-1]
        expected = expected_prompt_logprobs(reference, tokens)[ctxlen - 1:]
        assert abs(sum(continuation) - expected.sum()) < LOGPROB_ATOL * len(expected)
        is_greedy = all(token == max(top.values())
                        for token, top in zip(continuation, logprobs["top_logprobs"][ctxlen:-1]))
        assert is_greedy == expected_greedy


def test_bad_echo_and_prompt_logprobs_requests_get_openai_errors(server):
    route, chat = "/v1/completions", {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
    for body, param, words in (({"echo": True}, "echo", "/v1/completions"),
                               ({"max_tokens": 0}, "max_tokens", ">= 1"),
                               ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "streaming")):
        status, error = error_of(request(server, "POST", "/v1/chat/completions", {**chat, **body}))
        assert status == 400 and error["param"] == param and words in error["message"], (body, error)
    for body, param, words in (({"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
                               ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
                               ({"prompt_logprobs": "2"}, "prompt_logprobs", "integer"),
                               ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "streaming"),
                               ({"echo": "yes"}, "echo", "true or false"),
                               ({"max_tokens": 0, "logprobs": 1}, "max_tokens", "'echo': true")):
        status, error = error_of(request(server, "POST", route, {"model": SERVED, "prompt": "hi", **body}))
        assert status == 400 and error["param"] == param and words in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        server["client"].completions.create(model=SERVED, prompt="hi", max_tokens=0)
    # prompt_logprobs 0 streamed: vLLM takes it and sends nothing for it
    status, text = request(server, "POST", route, {"model": SERVED, "prompt": "hi", "max_tokens": 2, "stream": True,
                                                   "prompt_logprobs": 0})
    assert status == 200 and text.endswith("data: [DONE]\n\n") and "prompt_logprobs" not in text
    assert server["client"].completions.create(model=SERVED, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("paged", [False, True])
def test_the_scheduler_scores_a_padded_batch_in_chunks_as_each_prompt_alone(tiny, paged, monkeypatch):
    """Four prompts of several lengths submitted together are scored as one batch (padded rows; paged with prefix
    caching: a gap between their full blocks and the rest), in chunks of at most PROMPT_LOGITS logits (here a
    few positions); each entry is the model's own (its top tokens and rank too), each request's tokens are
    generate's alone, a request of max_tokens 1 or 0 is done without joining the batch, and every KV block comes
    back."""
    path, tokenizer, reference = tiny
    prompts = [encode(tokenizer, p) for p in (PROMPTS[2], PROMPTS[1], SYSTEM + PROMPTS[0], SYSTEM + PROMPTS[5])]
    vocab = reference.config["vocab_size"]
    monkeypatch.setattr(batching, "PROMPT_LOGITS", 4 * 5 * vocab)  # 4 rows: 5 columns a chunk
    shapes = []

    def scores(logits):
        shapes.append(logits.shape)
        return logits.astype(np.float32)
    monkeypatch.setattr(batching, "to_scores", scores)
    layouts, score_chunk = [], BatchScheduler._score_chunk

    def scored(self):
        layouts.append(self._scoring.layout.mask)
        return score_chunk(self)
    monkeypatch.setattr(BatchScheduler, "_score_chunk", scored)
    tokens = [6, 1, 0, 4]
    updates = [[] for _ in prompts]
    scheduler = scheduler_on(path, tokenizer, max_batch=4, **({"kv_blocks": 160, "page_size": 4} if paged else {}))
    requests = [scheduler.submit(Request(ids, SamplingParams(max_tokens=count, temperature=0, prompt_logprobs=3,
                                                             logprobs=1), updates[i].append, []))
                for i, (ids, count) in enumerate(zip(prompts, tokens))]
    scheduler.start()
    try:
        wait_for(lambda: all(r.finished for r in requests))
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.error is None and scheduler.last_error is None
    assert shapes and all(rows * columns * width <= batching.PROMPT_LOGITS for rows, columns, width in shapes)
    assert {rows for rows, _, _ in shapes} == {4} and len(shapes) >= max(len(p) for p in prompts) // 5
    assert not layouts[0].all()  # rows of padding (or, paged, a gap)
    assert scheduler.metrics.prompt_logprob_tokens == sum(len(p) for p in prompts)
    assert scheduler.metrics.rebuilds + scheduler.metrics.placements >= 1  # the requests of more tokens joined
    for ids, count, job, sent in zip(prompts, tokens, requests, updates):
        assert job.generated == reference_tokens(reference, ids, count).tolist()
        assert job.finish_reason == "length"
        scored = [u.prompt_logprobs for u in sent if u.prompt_logprobs is not None]
        assert len(scored) == 1 and sent[0].prompt_logprobs is not None  # once, before any token
        entries = scored[0]
        assert [e.token for e in entries] == ids and entries[0].logprob is None
        expected = model_logprobs(reference, ids)
        np.testing.assert_allclose([e.logprob for e in entries[1:]], expected[np.arange(len(ids) - 1), ids[1:]],
                                   rtol=0, atol=LOGPROB_ATOL)
        for row, entry in zip(expected, entries[1:]):
            assert [t for t, _ in entry.top] == [int(t) for t in np.argsort(-row, kind="stable")[:3]]
            np.testing.assert_allclose([lp for _, lp in entry.top], row[[t for t, _ in entry.top]], rtol=0,
                                       atol=LOGPROB_ATOL)
            mine = row[entry.token]  # its rank: the tokens at least as likely (near ties counted either way)
            assert np.sum(row > mine + LOGPROB_ATOL) + 1 <= entry.rank <= np.sum(row >= mine - LOGPROB_ATOL)
        assert sum(len(u.logprobs) for u in sent) == count
    if paged:  # the scored prompts' full blocks were offered: the one that went on joined on them
        assert scheduler.metrics.prefix_hit_tokens > 0


@pytest.fixture(scope="module")
def prefix_server(tiny):
    path, tokenizer, _ = tiny
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    scheduler = BatchScheduler(model, tokenizer, max_batch=4, kv_blocks=96, page_size=4,
                               eos=cli_serve.eos_ids(model, tokenizer)).start()
    assert scheduler.prefix_caching
    with serving(scheduler, tokenizer) as served:
        yield served


def test_a_prompt_sharing_a_cached_prefix_still_gets_every_position_s_logprobs(prefix_server, tiny):
    """On a paged server with prefix caching, a request whose prompt starts with the full blocks of an earlier one
    (a shared system prompt) takes its keys and values from the cache; one asking for its prompt's logprobs gets
    every position's all the same, and its completion is the one the server gives without them."""
    tokenizer, reference, client = prefix_server["tokenizer"], tiny[2], prefix_server["client"]
    metrics = prefix_server["scheduler"].metrics
    first, second = SYSTEM + PROMPTS[0], SYSTEM + PROMPTS[2]
    client.completions.create(model=SERVED, prompt=first, max_tokens=4, temperature=0)
    hits = metrics.prefix_hit_tokens
    plain = client.completions.create(model=SERVED, prompt=second, max_tokens=4, temperature=0).choices[0]
    assert metrics.prefix_hit_tokens > hits  # the shared prefix came from the cache
    ids = encode(tokenizer, second)
    echoed = client.completions.create(model=SERVED, prompt=second, max_tokens=4, temperature=0, logprobs=2,
                                       echo=True, extra_body={"prompt_logprobs": 2}).choices[0]
    assert echoed.text == second + plain.text
    check_echoed_logprobs(tokenizer, reference, ids, echoed.logprobs, 2)
    check_vllm_prompt_logprobs(tokenizer, reference, ids, echoed.model_extra["prompt_logprobs"], 2)
    wait_for(lambda: metrics.kv_blocks_used == 0, 30)


def test_a_request_cancelled_while_its_prompt_is_scored_leaves_at_once(tiny, monkeypatch):
    """A client gone while its prompt is scored (in chunks of one position here): the scoring ends at the next
    chunk, no entries are sent, its blocks come back, and the next request is answered."""
    path, tokenizer, reference = tiny
    monkeypatch.setattr(batching, "PROMPT_LOGITS", reference.config["vocab_size"])
    ids = encode(tokenizer, SYSTEM + PROMPTS[2])
    sent = []
    scheduler = scheduler_on(path, tokenizer, max_batch=2, kv_blocks=96, page_size=4).start()
    try:
        first = scheduler.submit(Request(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1),
                                         sent.append, []))
        wait_for(lambda: scheduler.metrics.prefills >= 2)
        first.cancel()
        wait_for(lambda: first.finished)
        after = scheduler.metrics.prefills
        second = scheduler.submit(Request(ids[:5], SamplingParams(max_tokens=2, temperature=0), lambda u: None, []))
        wait_for(lambda: second.finished)
        wait_for(lambda: scheduler.metrics.kv_blocks_used == 0, 30)
    finally:
        scheduler.close()
    assert scheduler.last_error is None and first.finish_reason == "cancelled" and second.finish_reason == "length"
    assert after < len(ids) and all(u.prompt_logprobs is None for u in sent)
    assert scheduler.metrics.prompt_logprob_tokens == 0 and scheduler.metrics.cancelled == 1


@pytest.mark.parametrize("name", ["mamba", "jamba", "recurrent_gemma", "rwkv"])
def test_prompts_of_models_with_recurrent_state_score_as_their_own_forward(name, monkeypatch):
    """Models whose layers keep a state per row (a pure Mamba, a hybrid, RecurrentGemma's recurrent blocks and local
    attention, RWKV): prompts of several lengths scored together (left-padded rows: the padding leaves the state at
    zeros) in chunks of three positions, each entry the model's own forward's; tokens generate's alone."""
    tokenizer = char_tokenizer()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in RECURRENT_PROMPTS[:4]]
    reference = load(name)
    expected = [expected_prompt_logprobs(reference, ids) for ids in prompts]
    tokens = [alone(reference, ids, 3) for ids in prompts]
    monkeypatch.setattr(batching, "PROMPT_LOGITS", 4 * 3 * reference.config["vocab_size"])
    updates = [[] for _ in prompts]
    scheduler = BatchScheduler(load(name), tokenizer, max_batch=4, max_model_len=64)
    requests = [scheduler.submit(Request(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1),
                                         updates[i].append, [])) for i, ids in enumerate(prompts)]
    scheduler.start()
    try:
        wait_for(lambda: all(r.finished for r in requests))
    finally:
        scheduler.close()
    assert scheduler.last_error is None and [r.generated for r in requests] == tokens
    for sent, logprobs in zip(updates, expected):
        entries = sent[0].prompt_logprobs
        np.testing.assert_allclose([e.logprob for e in entries[1:]], logprobs, rtol=0, atol=LOGPROB_ATOL)
