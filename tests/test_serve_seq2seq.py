"""`vkformers serve` on an encoder-decoder (the BART fixture, with a word-level tokenizer of its 48 tokens): each
request's tokens equal ``model.generate`` on its prompt alone, greedy and seeded, in groups of several requests of
different lengths; stop strings, cancelled requests and the checks of the route hold as for a decoder-only model;
served over HTTP to the openai client."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_serve import SERVED, free_port, serving, wait_for, web  # noqa: F401 (web: a fixture)
from tokenizers import Tokenizer, models, pre_tokenizers

from vkformers.cli import main
from vkformers.cli import serve as cli_serve
from vkformers.errors import InputError
from vkformers.models.batching import Request, SamplingParams
from vkformers.models.loading import AutoModelForSeq2SeqLM, AutoTokenizer
from vkformers.models.seq2seq_serving import EncoderDecoderScheduler

FIXTURE = Path(__file__).parent / "fixtures" / "seq2seq" / "bart"
WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, 48)]
PROMPTS = ["w5 w9 w13 w40 </s>", "w7 w7 w21 </s>", "w30 w12 w44 w8 w16 w23 w11 </s>", "w4 </s>"]


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    """The BART fixture's folder with a tokenizer of its 48 tokens: (folder, tokenizer, model)."""
    folder = tmp_path_factory.mktemp("bart")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, folder / name)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return folder, tokenizer, AutoModelForSeq2SeqLM.from_pretrained(folder, requires_grad=False)


def ids_of(tokenizer, text):
    return [int(t) for t in tokenizer(text)["input_ids"]]


def generated(model, prompt, max_tokens, **sampling):
    """generate's new tokens for one prompt alone, cut after its end token (the fixture's generation config forces
    the end token at the last step, as the server does too)."""
    tokens = model.generate(np.asarray([prompt], np.int64), max_new_tokens=max_tokens, **sampling)[0, 1:].tolist()
    return tokens[:tokens.index(2) + 1] if 2 in tokens else tokens


def run_together(scheduler, jobs):
    """Submit the jobs before the scheduler starts (its groups then take them in order), wait for all."""
    requests = scheduler.submit_all([Request(ids, params, lambda update: None, [2]) for ids, params in jobs])
    scheduler.start()
    wait_for(lambda: all(r.finished for r in requests))
    return requests


def test_grouped_requests_match_generate_alone(bart):
    """Greedy and seeded requests of different prompts and lengths, run in groups (max_batch 3: a fourth waits for
    the next group), each give generate's tokens for its prompt alone."""
    _, tokenizer, model = bart
    scheduler = EncoderDecoderScheduler(model, tokenizer, max_batch=3, eos=[2])
    try:
        jobs = [(ids_of(tokenizer, p), SamplingParams(max_tokens=n, temperature=0.0))
                for p, n in zip(PROMPTS, (6, 9, 4, 7))]
        jobs.append((ids_of(tokenizer, PROMPTS[1]), SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8,
                                                                   seed=11)))
        requests = run_together(scheduler, jobs)
        for (ids, params), request in zip(jobs, requests):
            sampling = {} if params.temperature == 0 else dict(do_sample=True, temperature=0.9, top_p=0.8, top_k=0,
                                                               seed=11)
            assert request.generated == generated(model, ids, params.max_tokens, **sampling)
            assert request.finish_reason == ("stop" if request.generated[-1] == 2 else "length")
        assert scheduler.metrics.prefills == 2 and scheduler.metrics.generation_tokens == sum(
            len(r.generated) for r in requests)
    finally:
        scheduler.close()


def test_bad_requests_are_refused_before_they_run(bart):
    _, tokenizer, model = bart
    scheduler = EncoderDecoderScheduler(model, tokenizer, eos=[2])
    with pytest.raises(InputError, match="encoder's 24 positions"):
        scheduler.submit(Request([5] * 30, SamplingParams(max_tokens=2), lambda update: None, [2]))
    with pytest.raises(InputError, match="max_tokens \\(30\\) and the decoder's start token exceed"):
        scheduler.submit(Request([5, 2], SamplingParams(max_tokens=30), lambda update: None, [2]))
    scheduler.submit(Request([5] * 20, SamplingParams(max_tokens=20), lambda update: None, [2]))  # each fits its side
    with pytest.raises(InputError, match="prompt log-probabilities"):
        scheduler.submit(Request([5, 2], SamplingParams(max_tokens=2, prompt_logprobs=1), lambda update: None, [2]))
    with pytest.raises(InputError, match="exceeds the decoder's"):
        EncoderDecoderScheduler(model, tokenizer, max_model_len=100)


def test_served_to_the_openai_client(bart, web):  # noqa: F811
    """Over HTTP: a completion and its streamed form equal generate's text; a stop string ends the text before it;
    the usage counts are exact; /v1/models answers."""
    _, tokenizer, model = bart
    scheduler = EncoderDecoderScheduler(model, tokenizer, max_batch=4, eos=cli_serve.eos_ids(model, tokenizer))
    with serving(scheduler.start(), tokenizer) as served:
        client = served["client"]
        prompt = "w41 w6 w27 w38 w19 </s>"  # greedy: w46 four times, then w30, then the forced end token
        tokens = generated(model, ids_of(tokenizer, prompt), 8)
        assert tokens[-1] == 2
        text = tokenizer.decode(tokens[:-1], skip_special_tokens=True)
        assert "w30" in text and not text.startswith("w30")
        answer = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0)
        assert answer.choices[0].text == text and answer.choices[0].finish_reason == "stop"
        assert answer.usage.prompt_tokens == len(ids_of(tokenizer, prompt))
        assert answer.usage.completion_tokens == len(tokens) == 8
        streamed = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text
        stopped = client.completions.create(model=SERVED, prompt=prompt, max_tokens=8, temperature=0, stop=["w30"])
        assert stopped.choices[0].text == text[:text.index("w30")]
        assert stopped.choices[0].finish_reason == "stop"
        assert [m.id for m in client.models.list().data] == [SERVED]


def test_the_command_refuses_what_an_encoder_decoder_cannot_serve(bart, web, capsys):  # noqa: F811
    """`vkformers serve` on an encoder-decoder: a paged KV cache size is refused by name, before serving."""
    folder, _, _ = bart
    assert main(["serve", "--model", str(folder), "--port", str(free_port()), "--kv-cache-tokens", "256"]) == 1
    assert "an encoder-decoder is served without --kv-cache-tokens" in capsys.readouterr().err
