"""Rerankers on ``vkformers serve``: a cross-encoder (models/cross_encoder.py) answers the rerank API of Jina and
Cohere as vLLM and llama.cpp's server take it (``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``) and vLLM's score
API (``POST /score``, ``/v1/score``), through one worker thread (:class:`Reranker`).

- rerank: ``query`` and ``documents`` (strings, or objects with a ``text``) make one pair per document; the results,
  highest ``relevance_score`` first (ties in the documents' order), are cut to ``top_n`` (0 or none: all) and give
  each document's ``index`` and, unless ``return_documents`` is false, the ``document`` (``{"text": ...}``).
- score: ``text_1`` and ``text_2`` (a string or a list of strings each) pair as vLLM pairs them: one text_1 with every
  text_2, or the lists element by element; ``data`` gives one ``score`` per pair in their order.

The scores are ``CrossEncoder.predict``'s: the logits through the model's activation (Sigmoid for a reranker), or
the logits themselves with vLLM's ``use_activation: false``. Pairs are truncated to the model's max_length, as
predict truncates them; ``usage`` counts the tokens read.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from vkformers.cli.api_schema import ApiError, flag_field, number_field, prometheus_text
from vkformers.errors import VkformersError
from vkformers.models.cross_encoder import IDENTITY, CrossEncoder

MAX_PAIRS = 2048  # pairs of one request, as the embeddings route bounds its inputs
RERANK_ROUTES = ("/rerank", "/v1/rerank", "/v2/rerank")
SCORE_ROUTES = ("/score", "/v1/score")
# fields that would have the pairs cut otherwise than at the model's max_length: refused rather than ignored
TRUNCATION_FIELDS = ("truncate_prompt_tokens", "max_tokens_per_doc")


@dataclass
class RerankMetrics:
    requests: int = 0
    pairs: int = 0
    prompt_tokens: int = 0
    errors: int = 0


class Reranker:
    """A CrossEncoder run on one worker thread (the engine is not shared across threads), requests in turn."""

    def __init__(self, model: CrossEncoder, batch_size: int = 32):
        if model.num_labels != 1:
            raise VkformersError(f"{model.folder} is a cross-encoder of {model.num_labels} labels; vkformers serve "
                                 "serves rerankers (one label): score its pairs with vkformers.CrossEncoder.predict")
        self.model, self.batch_size = model, batch_size
        self.metrics = RerankMetrics()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="vkformers-rerank")

    @classmethod
    def load(cls, model_name: str, dtype: str, batch_size: int = 32) -> Reranker:
        return cls(CrossEncoder(model_name, dtype=dtype), batch_size)

    def score(self, pairs: list, use_activation: bool = True) -> tuple[np.ndarray, int]:
        """predict's scores [len(pairs)] of the pairs, and the tokens read."""
        scores = self.model.predict(pairs, batch_size=self.batch_size,
                                    activation_fn=None if use_activation else IDENTITY)
        return scores, sum(self.model.token_counts(pairs))

    async def __call__(self, pairs: list, use_activation: bool = True) -> tuple[np.ndarray, int]:
        """The scores and tokens of score(), computed on the worker thread; counted in the metrics."""
        try:
            scores, tokens = await asyncio.get_running_loop().run_in_executor(self._worker, self.score, pairs,
                                                                              use_activation)
        except VkformersError as exc:
            self.metrics.errors += 1
            raise ApiError(400, str(exc)) from None
        self.metrics.requests += 1
        self.metrics.pairs += len(pairs)
        self.metrics.prompt_tokens += tokens
        return scores, tokens

    async def rerank(self, body: dict, model: str) -> dict:
        """The answer to a rerank request."""
        query, texts, top_n, return_documents, use_activation = rerank_request(body)
        scores, tokens = await self([[query, text] for text in texts], use_activation)
        return rerank_response(model, scores, texts, top_n, return_documents, tokens)

    async def score_texts(self, body: dict, model: str) -> dict:
        """The answer to a score request."""
        pairs, use_activation = score_request(body)
        scores, tokens = await self(pairs, use_activation)
        return score_response(model, scores, tokens)

    def close(self) -> None:
        self._worker.shutdown()


# ---------------------------------------------------------------- requests

def _common(body: dict) -> bool:
    """use_activation (vLLM's; true by default), after refusing the truncation settings."""
    for name in TRUNCATION_FIELDS:
        if body.get(name) not in (None, -1):
            raise ApiError(400, f"'{name}' is not supported: pairs are truncated to the model's max_length; leave "
                                "it out", param=name)
    return flag_field(body, "use_activation", True)


def _bounded(count: int, param: str) -> None:
    if count > MAX_PAIRS:
        raise ApiError(400, f"'{param}' makes {count} pairs; send at most {MAX_PAIRS} a request", param=param)


def rerank_request(body: dict) -> tuple[str, list[str], int | None, bool, bool]:
    """A rerank request's query, document texts, top_n (None: all), return_documents and use_activation."""
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError(400, "'query' must be a string", param="query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise ApiError(400, "'documents' must be a non-empty list of strings or {\"text\": ...} objects",
                       param="documents")
    texts = []
    for document in documents:
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str):
            raise ApiError(400, "each document must be a string or an object with a 'text' string",
                           param="documents")
        texts.append(text)
    _bounded(len(texts), "documents")
    top_n = number_field(body, "top_n", 0, int, low=0)
    return query, texts, top_n or None, flag_field(body, "return_documents", True), _common(body)


def score_request(body: dict) -> tuple[list[list[str]], bool]:
    """A score request's pairs (vLLM's rules: 1 to 1, 1 to N, N to N) and use_activation."""
    sides = []
    for name in ("text_1", "text_2"):
        value = body.get(name)
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
            raise ApiError(400, f"'{name}' must be a string or a non-empty list of strings", param=name)
        sides.append(value)
    first, second = sides
    if len(first) > 1 and len(first) != len(second):
        raise ApiError(400, f"'text_1' holds {len(first)} texts and 'text_2' {len(second)}: give one text_1 for "
                            "all of text_2, or as many of each (1:1, 1:N or N:N)", param="text_1")
    _bounded(len(second), "text_2")
    firsts = first * len(second) if len(first) == 1 else first
    return [[a, b] for a, b in zip(firsts, second)], _common(body)


# ---------------------------------------------------------------- responses

def rerank_response(model: str, scores: np.ndarray, texts: list[str], top_n: int | None, return_documents: bool,
                    tokens: int) -> dict:
    order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))  # stable: ties keep the documents' order
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": texts[i]}} if return_documents else {})} for i in order[:top_n]]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"prompt_tokens": tokens,
                                                                        "total_tokens": tokens},
            "results": results}


def score_response(model: str, scores: np.ndarray, tokens: int) -> dict:
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def rerank_prometheus(reranker: Reranker, served: str) -> str:
    m = reranker.metrics
    rows = [("requests_total", "counter", "rerank and score requests answered", m.requests),
            ("scored_pairs_total", "counter", "pairs scored", m.pairs),
            ("prompt_tokens_total", "counter", "tokens read", m.prompt_tokens),
            ("request_errors_total", "counter", "rerank and score requests that failed", m.errors)]
    return prometheus_text(rows, f'{{model="{served}"}}')


__all__ = ["MAX_PAIRS", "RERANK_ROUTES", "Reranker", "RerankMetrics", "SCORE_ROUTES", "rerank_prometheus",
           "rerank_request", "rerank_response", "score_request", "score_response"]
