"""Sentence embeddings from a sentence-transformers folder: ``SentenceTransformer(path_or_repo).encode(texts)``.

The folder's ``modules.json`` lists the pipeline: a ``Transformer`` (the base model and tokenizer, with
``max_seq_length`` and ``do_lower_case`` from ``sentence_bert_config.json``), a ``Pooling`` (its config.json:
CLS token, mean, max, mean / sqrt(length), last token; several modes are concatenated in sentence-transformers'
order), optional ``Dense`` layers and ``Normalize``. ``encode`` sorts the texts by length, as sentence-transformers
does, so that each batch is padded little, and returns numpy in the input order.

Prompts, as sentence-transformers applies them: ``encode(texts, prompt_name="query")`` puts the text of
``prompts["query"]`` from ``config_sentence_transformers.json`` (or ``prompt="..."`` given) before each text, and
``default_prompt_name`` there names one used when the call gives none. A Pooling module with ``include_prompt``
false leaves the prompt's tokens (all but a trailing special token) out of the pooling. ``encode_query`` and
``encode_document`` take the "query" and "document" prompts where the model has them.

``truncate_dim`` (Matryoshka models) keeps the first dimensions of each embedding, after the model's own modules
(a Normalize module's unit length is not restored unless ``normalize_embeddings``). ``similarity(a, b)`` and
``similarity_pairwise`` score embeddings with the model's ``similarity_fn_name`` (cosine unless the config says
dot, euclidean or manhattan; the distances negated, so that higher is more similar), as sentence-transformers does.
"""
from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.function import no_grad
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.models.heads import head_config, mean_pool, take_tokens
from vkformers.models.gguf import is_gguf_file
from vkformers.models.loading import (AutoModel, AutoTokenizer, load_config, read_json, read_weights,
                                     resolve_checkpoint)
from vkformers.models.plugins import plugin_manager, registry

PAD_MULTIPLE = 16
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "lasttoken")  # concat order
DENSE_ACTIVATIONS = {"torch.nn.modules.activation.Tanh": F.tanh, "torch.nn.modules.linear.Identity": lambda x: x,
                     "torch.nn.modules.activation.ReLU": F.relu, "torch.nn.modules.activation.GELU": F.gelu,
                     "torch.nn.modules.activation.Sigmoid": F.sigmoid}


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


# sentence-transformers' similarity functions: all of a against all of b ([n, m]), and row by row ([n])
SIMILARITY = {
    "cosine": (lambda a, b: _unit(a) @ _unit(b).T, lambda a, b: (_unit(a) * _unit(b)).sum(-1)),
    "dot": (lambda a, b: a @ b.T, lambda a, b: (a * b).sum(-1)),
    "euclidean": (lambda a, b: -np.sqrt(np.maximum(((a[:, None] - b[None]) ** 2).sum(-1), 0)),
                  lambda a, b: -np.sqrt(((a - b) ** 2).sum(-1))),
    "manhattan": (lambda a, b: -np.abs(a[:, None] - b[None]).sum(-1), lambda a, b: -np.abs(a - b).sum(-1)),
}
SIMILARITY["dot_product"] = SIMILARITY["dot"]


class SentenceTransformerError(VkformersError, ValueError):
    """A sentence-transformers folder whose modules vkformers does not run, or bad arguments to encode."""


class Pooling:
    """sentence-transformers' Pooling module over the token embeddings [B, T, D] and the attention mask."""

    def __init__(self, config: dict, where: str):
        self.modes = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}")]
        others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v
                  and k[len("pooling_mode_"):] not in POOLING_MODES]
        if others or not self.modes:
            raise SentenceTransformerError(f"{where}: pooling {', '.join(others) or 'none'} is not supported; "
                                           f"vkformers pools with {', '.join(POOLING_MODES)}")
        self.include_prompt = bool(config.get("include_prompt", True))

    def __call__(self, hidden, mask: np.ndarray):
        parts = []
        for mode in self.modes:
            if mode == "cls_token":
                parts.append(hidden[:, 0].float())
            elif mode == "mean_tokens":
                parts.append(mean_pool(hidden, mask))
            elif mode == "mean_sqrt_len_tokens":
                lengths = np.maximum(mask.sum(1), 1e-9).astype(np.float32)
                scale = (lengths / np.sqrt(lengths))[:, None].astype(np.float32)
                parts.append(mean_pool(hidden, mask) * Tensor(scale))
            elif mode == "lasttoken":  # the last attended token (left or right padding)
                last = np.where(mask.any(1), mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
                parts.append(take_tokens(hidden.float(), last))
            else:  # max over the attended tokens (padding set to -1e9, as sentence-transformers)
                bias = np.where(mask[:, :, None] > 0, np.float32(0), np.float32(-1e9)).astype(np.float32)
                parts.append((hidden.float() + Tensor(bias)).max(1))
        return parts[0] if len(parts) == 1 else F.cat(parts, -1)


class Dense:
    """sentence-transformers' Dense module: activation(x @ W.T + b), weights in its folder's model.safetensors
    (or pytorch_model.bin)."""

    def __init__(self, folder: Path):
        config = read_json(folder / "config.json")
        act = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in DENSE_ACTIVATIONS:
            raise SentenceTransformerError(f"{folder}: Dense activation {act} is not supported; known: "
                                           f"{', '.join(sorted(DENSE_ACTIVATIONS))}")
        weights = read_weights(folder)  # model.safetensors or pytorch_model.bin
        self.activation = DENSE_ACTIVATIONS[act]
        self.weight = Tensor(np.ascontiguousarray(weights["linear.weight"], np.float32))
        self.bias = Tensor(weights["linear.bias"].astype(np.float32)) if "linear.bias" in weights else None

    def __call__(self, x):
        return self.activation(F.linear(x, self.weight, self.bias))


def _normalize(x):
    """x / max(||x||, 1e-12) per row (torch.nn.functional.normalize)."""
    norm = (x * x).sum(-1, keepdim=True).sqrt().maximum(1e-12)
    return x / norm


class SentenceTransformer:
    """A sentence-transformers model: ``encode(texts)`` gives one embedding per text (numpy float32)."""

    def __init__(self, model_name_or_path, *, dtype="float32", revision: str | None = None, cache_dir=None,
                 trust_remote_code: bool = False, truncate_dim: int | None = None,
                 similarity_fn_name: str | None = None):
        if trust_remote_code:
            raise SentenceTransformerError("vkformers never runs code from a checkpoint (trust_remote_code=True "
                                           "refused)")
        folder = resolve_checkpoint(model_name_or_path, revision=revision, cache_dir=cache_dir)
        listing = folder / "modules.json"
        modules = read_json(listing) if listing.is_file() else [
            {"type": "sentence_transformers.models.Transformer", "path": ""},  # a plain model: mean pooling
            {"type": "sentence_transformers.models.Pooling", "path": None}]
        self.folder, self.pipeline, self.normalize = folder, [], False
        self.model = self.tokenizer = self.pooling = None
        settings = folder / "config_sentence_transformers.json"
        settings = read_json(settings) if settings.is_file() else {}
        self.truncate_dim = _check_truncate_dim(truncate_dim)
        self.similarity_fn_name = similarity_fn_name or settings.get("similarity_fn_name") or "cosine"
        if self.similarity_fn_name not in SIMILARITY:
            raise SentenceTransformerError(f"similarity_fn_name {self.similarity_fn_name!r}: use one of "
                                           f"{', '.join(SIMILARITY)}")
        self.prompts = dict(settings.get("prompts") or {})
        self.default_prompt_name = settings.get("default_prompt_name")
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise SentenceTransformerError(f"{folder}: default_prompt_name {self.default_prompt_name!r} is not one "
                                           f"of the prompts ({', '.join(self.prompts) or 'none'})")
        for entry in modules:
            kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
            path = folder / entry["path"] if entry.get("path") else folder
            if kind == "Transformer":
                self._load_transformer(path, dtype)
            elif kind == "Pooling":
                config = read_json(path / "config.json") if entry.get("path") else {"pooling_mode_mean_tokens": True}
                self.pooling = Pooling(config, str(path))
                self.pipeline.append(self.pooling)
            elif kind == "Dense":
                self.pipeline.append(Dense(path))
            elif kind == "Normalize":
                self.pipeline.append(_normalize)
                self.normalize = True
            else:
                raise SentenceTransformerError(f"{listing}: module {entry.get('type')!r} is not supported; vkformers "
                                               "runs Transformer, Pooling, Dense and Normalize")
        if self.model is None or self.pooling is None:
            raise SentenceTransformerError(f"{folder}: modules.json needs a Transformer and a Pooling module")

    def _load_transformer(self, path: Path, dtype) -> None:
        settings = read_json(path / "sentence_bert_config.json") if (path / "sentence_bert_config.json").is_file() else {}
        self.model = AutoModel.from_pretrained(path, dtype=dtype, requires_grad=False)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        limit = self.model.input_limits().max_length
        self.max_seq_length = settings.get("max_seq_length") or min(
            x for x in (getattr(self.tokenizer, "model_max_length", None), limit, 512) if x)
        self.do_lower_case = bool(settings.get("do_lower_case", False))

    def get_sentence_embedding_dimension(self) -> int:
        """The length of the embeddings encode returns (truncate_dim where set)."""
        return int(self.encode(["a"]).shape[-1])

    def tokenize(self, texts: list[str]) -> dict:
        if self.do_lower_case:
            texts = [text.lower() for text in texts]
        # batch lengths rounded up to a multiple of 16 (masked keys change no real token's output), so that a
        # stream of texts meets few shapes and their recorded plans replay
        multiple = PAD_MULTIPLE if self.max_seq_length % PAD_MULTIPLE == 0 else None
        return self.tokenizer(texts, padding=True, truncation="longest_first", max_length=self.max_seq_length,
                              pad_to_multiple_of=multiple, return_tensors="np")

    def prompt_length(self, prompt: str) -> int:
        """The prompt's tokens at the start of each text, a trailing special token (SEP, EOS) not counted."""
        ids = self.tokenizer(prompt.lower() if self.do_lower_case else prompt, truncation="longest_first",
                             max_length=self.max_seq_length)["input_ids"]
        return len(ids) - 1 if ids and ids[-1] in self.tokenizer.all_special_ids else len(ids)

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's input ids as the model reads them (special tokens added, truncated to max_seq_length)."""
        features = self.tokenize(texts)
        return [[int(t) for t in ids[mask > 0]] for ids, mask in zip(features["input_ids"], features["attention_mask"])]

    def _padded_ids(self, ids: list[list[int]]) -> dict:
        """Token id lists right-padded into a batch, rounded up as tokenize() pads texts."""
        longest = max(len(i) for i in ids)
        if self.max_seq_length % PAD_MULTIPLE == 0:
            longest = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, self.max_seq_length)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = np.full((len(ids), longest), pad, np.int64)
        mask = np.zeros((len(ids), longest), np.int64)
        for row, tokens in enumerate(ids):
            input_ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
        return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(input_ids)}

    def _embed_batch(self, texts: list[str], prompt_length: int = 0) -> np.ndarray:
        return self._embed_features(self.tokenize(texts), prompt_length)

    def _embed_ids(self, ids: list[list[int]]) -> np.ndarray:
        return self._embed_features(self._padded_ids(ids))

    def _embed_features(self, features: dict, prompt_length: int = 0) -> np.ndarray:
        mask = features["attention_mask"]
        pooled_mask = mask
        if prompt_length:  # pool without the prompt: its tokens (after any left padding) masked out
            first = np.argmax(mask, axis=1)[:, None] if mask.any() else 0
            pooled_mask = np.where(np.arange(mask.shape[1])[None, :] < first + prompt_length, 0, mask)
        inputs = {"input_ids": features["input_ids"], "attention_mask": mask}
        if "token_type_ids" in features and "token_type_ids" in inspect.signature(self.model.forward).parameters:
            inputs["token_type_ids"] = features["token_type_ids"]
        with no_grad():
            x = self.model(**inputs).last_hidden_state
            for module in self.pipeline:
                x = module(x, pooled_mask) if module is self.pooling else module(x)
            return x.float().numpy()

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """The prompt a call uses: ``prompt`` as given, else ``prompts[prompt_name]``, else the default prompt."""
        if prompt is not None:
            if prompt_name is not None:
                warnings.warn("encode() got both prompt and prompt_name; the prompt is used", stacklevel=3)
            return prompt
        if prompt_name is not None:
            if prompt_name not in self.prompts:
                raise SentenceTransformerError(f"prompt_name={prompt_name!r}: the model's prompts are "
                                               f"{', '.join(map(repr, self.prompts)) or 'none'} "
                                               "(config_sentence_transformers.json); or pass prompt='...'")
            return self.prompts[prompt_name]
        return self.prompts.get(self.default_prompt_name) if self.default_prompt_name is not None else None

    def encode(self, sentences, prompt_name: str | None = None, prompt: str | None = None, batch_size: int = 32,
               show_progress_bar: bool | None = None, convert_to_numpy: bool = True,
               normalize_embeddings: bool = False, truncate_dim: int | None = None) -> np.ndarray:
        """Embeddings [len(sentences), D] float32 (one text: [D]), in the input order. ``prompt_name`` (a key of
        the model's ``prompts``) or ``prompt`` is put before each text. ``truncate_dim`` (default: the model's)
        keeps the first dimensions; ``normalize_embeddings`` then scales each to unit length (the model's own
        Normalize module does so before any truncation)."""
        truncate_dim = _check_truncate_dim(truncate_dim) or self.truncate_dim
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        if not all(isinstance(t, str) for t in texts):
            raise SentenceTransformerError("encode() takes a text or a list of texts")
        prompt = self.resolve_prompt(prompt, prompt_name)
        prompt_length = 0
        if prompt:
            texts = [prompt + text for text in texts]
            if not self.pooling.include_prompt:
                prompt_length = self.prompt_length(prompt)
        out = self._batched(texts, lambda batch: self._embed_batch(batch, prompt_length), batch_size,
                            show_progress_bar)
        if truncate_dim:
            out = np.ascontiguousarray(out[:, :truncate_dim])
        if normalize_embeddings:
            out = _unit(out)
        return out[0] if single else out

    def encode_query(self, sentences, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """encode with the model's "query" prompt where it has one (and no prompt is given)."""
        if prompt is None and prompt_name is None and "query" in self.prompts:
            prompt_name = "query"
        return self.encode(sentences, prompt_name=prompt_name, prompt=prompt, **kwargs)

    def encode_document(self, sentences, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """encode with the model's "document" prompt (else "passage", else "corpus") where it has one."""
        if prompt is None and prompt_name is None:
            prompt_name = next((n for n in ("document", "passage", "corpus") if n in self.prompts), None)
        return self.encode(sentences, prompt_name=prompt_name, prompt=prompt, **kwargs)

    def similarity(self, a, b) -> np.ndarray:
        """Every embedding of ``a`` [n, D] (or [D]) against every one of ``b``: [n, m] float32, by the model's
        similarity function."""
        a, b = _matrix(a), _matrix(b)
        if a.shape[-1] != b.shape[-1]:
            raise SentenceTransformerError(f"similarity: embeddings of {a.shape[-1]} and {b.shape[-1]} dimensions")
        return SIMILARITY[self.similarity_fn_name][0](a, b).astype(np.float32)

    def similarity_pairwise(self, a, b) -> np.ndarray:
        """Row i of ``a`` against row i of ``b``: [n] float32."""
        a, b = _matrix(a), _matrix(b)
        if a.shape != b.shape:
            raise SentenceTransformerError(f"similarity_pairwise: {a.shape} and {b.shape} embeddings; give as many "
                                           "of one length")
        return SIMILARITY[self.similarity_fn_name][1](a, b).astype(np.float32)

    def encode_token_ids(self, ids: list[list[int]], batch_size: int = 32) -> np.ndarray:
        """Embeddings [len(ids), D] float32 of token id lists as the model reads them (special tokens included, as
        token_ids() gives them), each of at most max_seq_length tokens."""
        if not ids or not all(isinstance(i, list) and i and all(isinstance(t, int) for t in i) for i in ids):
            raise SentenceTransformerError("encode_token_ids() takes non-empty lists of token ids")
        longest = max(len(i) for i in ids)
        if longest > self.max_seq_length:
            raise SentenceTransformerError(f"an input of {longest} tokens exceeds max_seq_length "
                                           f"{self.max_seq_length}; shorten it")
        return self._batched(ids, self._embed_ids, batch_size, False)

    def _batched(self, items: list, embed, batch_size: int, show_progress_bar) -> np.ndarray:
        check_batch_size(batch_size, SentenceTransformerError)
        return length_sorted_batches(items, embed, batch_size, show_progress_bar)

    __call__ = encode


def check_batch_size(batch_size, error: type[VkformersError]) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise error(f"batch_size={batch_size!r}: pass a positive integer")


def length_sorted_batches(items: list, run, batch_size: int, show_progress_bar, length=len) -> np.ndarray:
    """``run(batch)`` ([len(batch), D] float32) over ``items`` in batches of ``batch_size``, longest first by
    ``length`` (as sentence-transformers sorts them, so that each batch is padded little): [len(items), D] in the
    input order."""
    order = np.argsort([-length(item) for item in items], kind="stable")
    chunks = []
    starts = range(0, len(items), batch_size)
    for start in _progress(starts, show_progress_bar and len(starts) > 1):
        chunks.append(run([items[i] for i in order[start:start + batch_size]]))
    out = np.zeros((len(items), chunks[0].shape[-1] if chunks else 0), np.float32)
    if chunks:
        out[order] = np.concatenate(chunks)
    return out


def _check_truncate_dim(value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise SentenceTransformerError(f"truncate_dim={value!r}: pass a positive integer (or None for every "
                                       "dimension)")
    return None if value is None else int(value)


def _matrix(x) -> np.ndarray:
    try:
        x = np.asarray(x.numpy() if hasattr(x, "numpy") else x, np.float64)
    except (TypeError, ValueError):
        x = None
    if x is None or x.ndim not in (1, 2) or x.size == 0:
        raise SentenceTransformerError("similarity takes embeddings: a [D] or [n, D] array of numbers (what encode "
                                       "returns)")
    return x[None] if x.ndim == 1 else x


def is_cross_encoder_checkpoint(name_or_path) -> bool:
    """Whether a checkpoint is a cross-encoder (models/cross_encoder.py): one sentence-transformers' CrossEncoder
    saved (config_sentence_transformers.json's model_type, or the activation its earlier versions wrote into
    config.json), or a sequence classifier of one label that no modules.json makes a SentenceTransformer (a
    reranker such as BAAI/bge-reranker-base). A GGUF file is taken as a causal LM."""
    if is_gguf_file(name_or_path):
        return False
    folder = resolve_checkpoint(name_or_path)
    settings = folder / "config_sentence_transformers.json"
    if settings.is_file() and read_json(settings).get("model_type") == "CrossEncoder":
        return True
    if (folder / "modules.json").is_file() or not (folder / "config.json").is_file():
        return False
    config = load_config(folder)
    if "activation_fn" in (config.get("sentence_transformers") or {}) or \
            config.get("sbert_ce_default_activation_function"):
        return True
    architectures = config.get("architectures") or [""]
    return str(architectures[0]).endswith("ForSequenceClassification") and head_config(config)["num_labels"] == 1


def is_embedding_checkpoint(name_or_path) -> bool:
    """Whether a checkpoint is an embedding model: a sentence-transformers folder (modules.json), or an encoder (an
    architecture with no causal LM, and no encoder-decoder) that is no cross-encoder. A GGUF file is taken as a
    causal LM."""
    if is_gguf_file(name_or_path) or is_cross_encoder_checkpoint(name_or_path):
        return False
    folder = resolve_checkpoint(name_or_path)
    if (folder / "modules.json").is_file():
        return True
    config = load_config(folder)
    if config.get("is_encoder_decoder"):  # T5, BART, Marian, ...: they generate
        return False
    architecture = registry().resolve(config)
    return plugin_manager().hook.vkformers_model_class(architecture=architecture, task="causal-lm") is None


def _progress(items, show: bool):
    if not show:
        return items
    from tqdm.auto import tqdm  # huggingface_hub's dependency; loaded only when a bar is shown
    return tqdm(items, desc="Batches", file=sys.stderr)


__all__ = ["Dense", "Pooling", "SentenceTransformer", "SentenceTransformerError", "check_batch_size",
           "is_cross_encoder_checkpoint", "is_embedding_checkpoint", "length_sorted_batches"]
