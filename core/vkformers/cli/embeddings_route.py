"""Embedding models on ``vkformers serve`` (``POST /v1/embeddings``): a SentenceTransformer run on one worker
thread (:class:`Embedder`), an embeddings request's inputs and format read, its data shaped as OpenAI's, and the
Prometheus text of /metrics.
"""
from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from vkformers.cli.api_schema import ApiError, number_field, prometheus_text
from vkformers.models.sentence import SentenceTransformer

MAX_EMBEDDING_INPUTS = 2048     # OpenAI's bound on the inputs of one embeddings request


def embedding_inputs(body: dict) -> list:
    """An embeddings request's inputs: a string, a list of strings, a list of token ids or a list of such lists
    (the model's input ids, special tokens included). Returns a list of strings and token id lists."""
    value = body.get("input")

    def ids(item):
        return isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
    if isinstance(value, str) or ids(value):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) or ids(v) for v in value):
        raise ApiError(400, "'input' must be a string, a list of strings, a list of token ids or a list of such "
                            "lists (none empty)", param="input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise ApiError(400, f"'input' holds {len(value)} items; send at most {MAX_EMBEDDING_INPUTS} a request",
                       param="input")
    return value


def embedding_format(body: dict, width: int) -> tuple[str, int | None]:
    """encoding_format ("float" or "base64") and dimensions (None: all ``width``) of an embeddings request."""
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        dimensions = number_field(body, "dimensions", None, int, 1, width)
    return encoding, dimensions


@dataclass
class EmbeddingMetrics:
    requests: int = 0
    inputs: int = 0
    prompt_tokens: int = 0
    errors: int = 0


class Embedder:
    """A SentenceTransformer run on one worker thread (the engine is not shared across threads), requests in turn."""

    def __init__(self, model: SentenceTransformer, batch_size: int = 32):
        self.model, self.batch_size = model, batch_size
        self.width = int(model.encode("a").shape[-1])
        self.metrics = EmbeddingMetrics()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="vkformers-embed")

    def embed(self, inputs: list) -> tuple[np.ndarray, int]:
        """The embeddings [len(inputs), D] of texts (truncated to max_seq_length, as encode does) and token id
        lists, and the tokens read."""
        texts = [item for item in inputs if isinstance(item, str)]
        tokenized = iter(self.model.token_ids(texts) if texts else [])
        ids = [next(tokenized) if isinstance(item, str) else item for item in inputs]
        return self.model.encode_token_ids(ids, batch_size=self.batch_size), sum(len(i) for i in ids)

    async def __call__(self, inputs: list) -> tuple[np.ndarray, int]:
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.embed, inputs)

    def close(self) -> None:
        self._worker.shutdown()


def embedding_data(embeddings: np.ndarray, encoding: str, dimensions: int | None, normalize: bool) -> list[dict]:
    """/v1/embeddings' data: each embedding cut to ``dimensions`` (scaled to unit length again when the model
    normalizes, as OpenAI's shortened embeddings are), as floats or base64 of little-endian float32."""
    if dimensions is not None and dimensions < embeddings.shape[-1]:
        embeddings = embeddings[:, :dimensions]
        if normalize:
            embeddings = embeddings / np.maximum(np.linalg.norm(embeddings, axis=-1, keepdims=True), 1e-12)
    embeddings = np.ascontiguousarray(embeddings, "<f4")
    return [{"object": "embedding", "index": index,
             "embedding": base64.b64encode(row.tobytes()).decode() if encoding == "base64" else row.tolist()}
            for index, row in enumerate(embeddings)]


def embedding_prometheus(embedder: Embedder, served: str) -> str:
    m = embedder.metrics
    label = f'{{model="{served}"}}'
    rows = [("requests_total", "counter", "embeddings requests answered", m.requests),
            ("embedding_inputs_total", "counter", "inputs embedded", m.inputs),
            ("prompt_tokens_total", "counter", "tokens embedded", m.prompt_tokens),
            ("request_errors_total", "counter", "embeddings requests that failed", m.errors)]
    return prometheus_text(rows, label)
