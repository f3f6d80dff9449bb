"""``vkformers serve`` with a reranker: the rerank API (``/rerank``, ``/v1/rerank``, ``/v2/rerank``) and vLLM's score
API (``/score``, ``/v1/score``) over HTTP on a local port, on the tiny BERT reranker of tests/fixtures/cross_encoder
(tools/make_cross_encoder_reference.py). Scores equal CrossEncoder.predict's in the same batches within float32
rounding (SAME: a batch's recorded plan may replay in another order of additions), and sentence-transformers' within
test_cross_encoder's tolerances; results sorted, cut to top_n, with or without the
documents; usage exact; the errors of bad requests and of the other kinds' routes."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from test_cross_encoder import ATOL, FIXTURES, LOGITS_ATOL, PAIRS, REFERENCE
from test_serve import API_KEY, free_port, request, serve_command, wait_for

import vkformers
from vkformers.cli import main
from vkformers.cli import serve as cli_serve
from vkformers.cli.rerank import Reranker

try:  # the [serve] extra
    import uvicorn
except ImportError:
    uvicorn = None

SERVED = "tiny-reranker"
BATCH = 4
QUERY, DOCUMENTS = REFERENCE["query"], REFERENCE["documents"]
COUNTS = REFERENCE["bert-reranker"]["token_counts"]  # PAIRS: the query with each document first
SAME = 2e-7  # probabilities in [0, 1]: a couple of float32 ulps


@pytest.fixture(scope="module")
def model():
    return vkformers.CrossEncoder(FIXTURES / "bert-reranker")


@pytest.fixture(scope="module")
def server(model):
    if uvicorn is None:
        pytest.fail("the serve tests need pip install 'vkformers[serve,test]'", pytrace=False)
    reranker = Reranker(model, batch_size=BATCH)
    app = cli_serve.build_app(None, model.tokenizer, SERVED, api_key=API_KEY, reranker=reranker)
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    wait_for(lambda: web.started, 30)
    yield {"port": port, "reranker": reranker}
    web.should_exit = True
    thread.join(30)
    reranker.close()


def post(server, route, body, key=API_KEY):
    status, text = request(server, "POST", route, body, key=key)
    return status, json.loads(text)


def test_rerank_sorts_the_documents_by_predicts_scores(server, model):
    expected = model.predict([[QUERY, d] for d in DOCUMENTS], batch_size=BATCH)
    status, answer = post(server, "/v1/rerank", {"model": SERVED, "query": QUERY, "documents": DOCUMENTS})
    assert status == 200 and answer["model"] == SERVED and answer["id"].startswith("rerank-")
    results = answer["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected[[r["index"] for r in results]],
                               atol=SAME, rtol=0)
    assert [r["document"] for r in results] == [{"text": DOCUMENTS[r["index"]]} for r in results]
    assert [r["index"] for r in results] == [r["corpus_id"] for r in REFERENCE["bert-reranker"]["rank"]]
    np.testing.assert_allclose([r["relevance_score"] for r in results],
                               [r["score"] for r in REFERENCE["bert-reranker"]["rank"]], atol=ATOL, rtol=0)
    assert answer["usage"]["total_tokens"] == sum(COUNTS[:len(DOCUMENTS)])


def test_top_n_return_documents_and_the_other_rerank_routes(server):
    full = post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS})[1]["results"]
    status, answer = post(server, "/v2/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
                                                 "top_n": 2, "return_documents": False})
    assert status == 200 and answer["results"] == [{k: r[k] for k in ("index", "relevance_score")} for r in full[:2]]
    for top_n in (0, None, 9):
        assert post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": top_n})[1]["results"] \
            == full
    logits = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "use_activation": False})[1]
    expected = np.asarray(REFERENCE["bert-reranker"]["logits"], np.float32)
    np.testing.assert_allclose([r["relevance_score"] for r in logits["results"]],
                               expected[[r["index"] for r in logits["results"]]], atol=LOGITS_ATOL, rtol=0)
    assert [r["index"] for r in logits["results"]] == [r["index"] for r in full]  # sigmoid keeps the order


def test_score_pairs_as_vllm_does(server, model):
    """text_1 against text_2: N:N pairs element by element, 1:N the one text_1 with each, 1:1 one pair."""
    status, answer = post(server, "/v1/score", {"model": SERVED, "text_1": [p[0] for p in PAIRS],
                                                "text_2": [p[1] for p in PAIRS]})
    assert status == 200 and answer["object"] == "list" and answer["model"] == SERVED
    assert [(d["index"], d["object"]) for d in answer["data"]] == [(i, "score") for i in range(len(PAIRS))]
    scores = [d["score"] for d in answer["data"]]
    np.testing.assert_allclose(scores, model.predict(PAIRS, batch_size=BATCH), atol=SAME, rtol=0)
    np.testing.assert_allclose(scores, REFERENCE["bert-reranker"]["predict"], atol=ATOL, rtol=0)
    assert answer["usage"] == {"prompt_tokens": sum(COUNTS), "total_tokens": sum(COUNTS), "completion_tokens": 0}
    one_to_many = post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})[1]["data"]
    np.testing.assert_allclose([d["score"] for d in one_to_many], scores[:len(DOCUMENTS)], atol=SAME, rtol=0)
    single = post(server, "/score", {"text_1": [PAIRS[5][0]], "text_2": PAIRS[5][1]})[1]
    assert len(single["data"]) == 1 and single["usage"]["total_tokens"] == COUNTS[5]
    assert abs(single["data"][0]["score"] - scores[5]) <= SAME


def test_bad_requests_and_the_other_routes(server):
    documents = {"query": QUERY, "documents": DOCUMENTS}
    for route, body, param in [
            ("/v1/rerank", {"documents": DOCUMENTS}, "query"),
            ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
            ("/v1/rerank", {"query": QUERY, "documents": ["a", 3]}, "documents"),
            ("/v1/rerank", {"query": QUERY, "documents": [{"content": "a"}]}, "documents"),
            ("/v1/rerank", {**documents, "top_n": -1}, "top_n"),
            ("/v1/rerank", {**documents, "return_documents": "yes"}, "return_documents"),
            ("/v1/rerank", {**documents, "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
            ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 2049}, "documents"),
            ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
            ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
            ("/v1/score", {"text_1": "a"}, "text_2"),
            ("/v1/score", {"text_1": "a", "text_2": "b", "use_activation": 1}, "use_activation")]:
        status, answer = post(server, route, body)
        assert status == 400 and answer["error"]["param"] == param, (route, body, answer)
    status, answer = post(server, "/v1/rerank", {"model": "other", **documents})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, answer = post(server, "/v1/score", {"text_1": "a", "text_2": "b"}, key=None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/embeddings", {"input": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, answer = post(server, route, body)
        assert status == 400 and "a reranker: it answers POST /v1/rerank and /v1/score" in answer["error"]["message"]
    status, text = request(server, "GET", "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["max_model_len"] == 24
    assert request(server, "GET", "/health", key=None)[0] == 200
    status, text = request(server, "GET", "/metrics", key=None)
    metrics = server["reranker"].metrics
    assert status == 200 and f'vkformers_scored_pairs_total{{model="{SERVED}"}} {metrics.pairs}' in text
    assert metrics.requests > 0 and metrics.errors == 0  # refused requests never reach the model


def test_the_command_serves_a_reranker_and_refuses_a_classifier(tmp_path, capsys, model):
    """`vkformers serve --model <cross-encoder folder>`: /v1/rerank answers with predict's scores; a cross-encoder
    of three labels is refused before the server starts."""
    if uvicorn is None:
        pytest.fail("the serve tests need pip install 'vkformers[serve,test]'", pytrace=False)
    assert main(["serve", "--model", str(FIXTURES / "xlm-roberta-nli"), "--port", str(free_port())]) == 1
    assert "cross-encoder of 3 labels; vkformers serve serves rerankers" in capsys.readouterr().err
    with serve_command("--model", FIXTURES / "bert-reranker", "--served-model-name", SERVED) as (port, (line,)):
        assert line.startswith(f"vkformers serve: {SERVED} on http://127.0.0.1:{port}/v1")
        status, answer = post({"port": port}, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[:3]}, key=None)
    assert status == 200
    expected = model.predict([[QUERY, d] for d in DOCUMENTS[:3]])
    results = sorted(answer["results"], key=lambda r: r["index"])
    assert [r["index"] for r in results] == [0, 1, 2]
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected, atol=SAME, rtol=0)
