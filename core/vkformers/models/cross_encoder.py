"""sentence-transformers' CrossEncoder: ``CrossEncoder(path_or_repo).predict([(query, document), ...])``.

A cross-encoder reads the two texts of a pair together, ``[CLS] query [SEP] document [SEP]`` (the tokenizer's pair
template), through a model with a sequence-classification head (``AutoModelForSequenceClassification``,
models/heads.py: BERT, XLM-R, ELECTRA, DeBERTa, ModernBERT, ..., and the decoders transformers has the head for),
and gives one score per pair (a reranker: one label, such as cross-encoder/ms-marco-MiniLM-L6-v2 or
BAAI/bge-reranker-base) or one per label (an NLI model).

The folder may be in any layout sentence-transformers reads: its CrossEncoder's ``save_pretrained`` (modules.json
with a single Transformer module, config_sentence_transformers.json naming the activation), config.json's
``sentence_transformers.activation_fn`` (what versions 4 and 5 wrote), ``sbert_ce_default_activation_function``
(before 4), or a plain transformers checkpoint. The scores are the logits through the activation: ``activation_fn``
as given, else the one the checkpoint names, else Sigmoid for one label and Identity otherwise, as
sentence-transformers does. Pairs are truncated longest-first to ``max_length`` (default: the tokenizer's
``model_max_length``, within the model's positions) and sorted by length into padded batches, as
sentence-transformers sorts them; the scores come back in the input order.
"""
from __future__ import annotations

import inspect
import warnings

import numpy as np

from vkformers.engine.function import no_grad
from vkformers.engine.tensor import Tensor
from vkformers.models.heads import head_config
from vkformers.models.loading import (AutoModelForSequenceClassification, AutoTokenizer, load_config, read_json,
                                       resolve_checkpoint)
from vkformers.models.sentence import (PAD_MULTIPLE, SentenceTransformerError, check_batch_size,
                                       is_cross_encoder_checkpoint, length_sorted_batches)
from vkformers.models.tokenizer import LARGE_INTEGER


class CrossEncoderError(SentenceTransformerError):
    """A cross-encoder checkpoint vkformers does not run, or bad arguments to predict or rank."""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


# the activations a checkpoint may name, by the class path of torch's modules that sentence-transformers stores
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": _sigmoid,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.Tanh": np.tanh,
    "torch.nn.modules.activation.ReLU": lambda x: np.maximum(x, np.float32(0)),
    "torch.nn.modules.activation.Softmax": _softmax,  # torch's implicit dim of a [batch, labels] input: the labels
}
SIGMOID, IDENTITY = "torch.nn.modules.activation.Sigmoid", "torch.nn.modules.linear.Identity"


def activation_function(activation):
    """A numpy function of the logits [batch, labels]: a class path of ACTIVATIONS, a torch module of such a class
    (run as its numpy counterpart: no torch at run time), or a callable taking and returning numpy arrays."""
    if isinstance(activation, str) or type(activation).__module__.startswith("torch."):
        path = activation if isinstance(activation, str) else \
            f"{type(activation).__module__}.{type(activation).__qualname__}"
        if path not in ACTIVATIONS:
            raise CrossEncoderError(f"activation_fn {path}: vkformers runs {', '.join(ACTIVATIONS)} (or pass a "
                                    "function of numpy logits)")
        return ACTIVATIONS[path]
    if not callable(activation):
        raise CrossEncoderError(f"activation_fn={activation!r}: pass a function of the logits or a torch "
                                "activation's class path")
    return activation


def _pair(item) -> bool:
    return isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(t, str) for t in item)


class CrossEncoder:
    """A sentence-transformers cross-encoder: ``predict(pairs)`` scores each (query, document) pair, ``rank(query,
    documents)`` sorts the documents by score."""

    def __init__(self, model_name_or_path, *, max_length: int | None = None, activation_fn=None,
                 num_labels: int | None = None, dtype="float32", revision: str | None = None, cache_dir=None,
                 trust_remote_code: bool = False):
        if trust_remote_code:
            raise CrossEncoderError("vkformers never runs code from a checkpoint (trust_remote_code=True refused)")
        folder = resolve_checkpoint(model_name_or_path, revision=revision, cache_dir=cache_dir)
        self.folder = folder
        config = load_config(folder)
        settings = _check_layout(folder, config)
        stored_labels = head_config(config)["num_labels"]
        if num_labels is not None and num_labels != stored_labels and \
                str((config.get("architectures") or [""])[0]).endswith("ForSequenceClassification"):
            raise CrossEncoderError(f"num_labels={num_labels!r}: the checkpoint's classifier scores {stored_labels} "
                                    "label(s); leave num_labels out (a new head starts untrained)")
        head = {} if num_labels is None else {"num_labels": num_labels}
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype, requires_grad=False,
                                                                        **head)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.config = self.model.config
        self._token_types = "token_type_ids" in inspect.signature(self.model.base.forward).parameters
        limit = self.model.input_limits().max_length
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or not 1 <= max_length <= (limit or max_length)):
            raise CrossEncoderError(f"max_length={max_length!r}: pass a number of tokens up to the model's "
                                    f"{limit} positions")
        stored = getattr(self.tokenizer, "model_max_length", None)
        stored = stored if isinstance(stored, int) and 0 < stored <= LARGE_INTEGER else None
        self.max_length = max_length or min((x for x in (stored, limit) if x), default=512)
        self.activation_fn = activation_fn if activation_fn is not None else self._stored_activation(settings, config)
        activation_function(self.activation_fn)  # refused now, not at the first predict

    def _stored_activation(self, settings: dict, config: dict):
        """The activation the checkpoint names (as sentence-transformers reads it), else Sigmoid for one label and
        Identity otherwise. A path outside torch is left for the default, with a warning, as sentence-transformers
        does without trust_remote_code."""
        path = settings.get("activation_fn") or (config.get("sentence_transformers") or {}).get("activation_fn") \
            or config.get("sbert_ce_default_activation_function")
        if path and not str(path).startswith("torch."):
            warnings.warn(f"{self.folder}: activation {path} is not torch's; the default is used", stacklevel=3)
            path = None
        return path or (SIGMOID if self.num_labels == 1 else IDENTITY)

    @property
    def num_labels(self) -> int:
        return self.model.num_labels

    @property
    def max_seq_length(self) -> int:
        return self.max_length

    def tokenize(self, pairs: list) -> dict:
        """The pairs as one padded batch: each tokenized together, truncated longest-first to max_length."""
        # batch lengths rounded up to a multiple of 16 (masked keys change no real token's output), so that a
        # stream of pairs meets few shapes and their recorded plans replay
        multiple = PAD_MULTIPLE if self.max_length % PAD_MULTIPLE == 0 else None
        return self.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], padding=True, truncation="longest_first",
                              max_length=self.max_length, pad_to_multiple_of=multiple, return_tensors="np")

    def token_counts(self, pairs: list) -> list[int]:
        """The tokens the model reads of each pair (special tokens included, after truncation)."""
        pairs = self._pairs(pairs)[0]
        if not pairs:
            return []
        ids = self.tokenizer([p[0] for p in pairs], [p[1] for p in pairs], truncation="longest_first",
                             max_length=self.max_length)["input_ids"]
        return [len(row) for row in ids]

    def _logits(self, pairs: list) -> np.ndarray:
        features = self.tokenize(pairs)
        inputs = {"input_ids": features["input_ids"], "attention_mask": features["attention_mask"]}
        if self._token_types and "token_type_ids" in features:
            inputs["token_type_ids"] = features["token_type_ids"]
        with no_grad():
            return self.model(**inputs).logits.float().numpy()

    @staticmethod
    def _pairs(sentence_pairs) -> tuple[list, bool]:
        """The pairs as a list, and whether one pair alone was given (its score comes back alone)."""
        if _pair(sentence_pairs):
            return [sentence_pairs], True
        pairs = list(sentence_pairs) if isinstance(sentence_pairs, (list, tuple)) else None
        if pairs is None or not all(_pair(p) for p in pairs):
            raise CrossEncoderError("predict() takes a pair of texts [query, document] or a list of such pairs")
        return pairs, False

    def predict(self, sentence_pairs, batch_size: int = 32, show_progress_bar: bool | None = None,
                activation_fn=None, apply_softmax: bool = False, convert_to_numpy: bool = True,
                convert_to_tensor: bool = False):
        """The scores of the pairs, in their order: float32 [pairs] for one label, [pairs, labels] otherwise (one
        pair: its score or row). ``activation_fn`` (default: the model's) runs on the logits, then
        ``apply_softmax`` normalizes each row of several labels. ``convert_to_tensor``: a vkformers Tensor;
        ``convert_to_numpy`` False: a list of the rows."""
        pairs, single = self._pairs(sentence_pairs)
        check_batch_size(batch_size, CrossEncoderError)
        activation = activation_function(activation_fn if activation_fn is not None else self.activation_fn)
        if pairs:
            logits = length_sorted_batches(pairs, self._logits, batch_size, show_progress_bar,
                                           length=lambda p: len(p[0]) + len(p[1]))
            scores = np.asarray(activation(logits), np.float32)
        else:
            scores = np.zeros((0, self.num_labels), np.float32)
        if self.num_labels == 1 and scores.ndim > 1:
            scores = scores[:, 0]
        if apply_softmax and scores.ndim > 1:
            scores = _softmax(scores)
        if convert_to_tensor:
            return Tensor(np.ascontiguousarray(scores[0] if single else scores))
        if not convert_to_numpy:
            scores = list(scores)
        return scores[0] if single else scores

    def rank(self, query: str, documents: list[str], top_k: int | None = None, return_documents: bool = False,
             batch_size: int = 32, show_progress_bar: bool | None = None, activation_fn=None) -> list[dict]:
        """The documents by their score against the query, highest first (ties in their order): dicts of
        ``corpus_id`` (the document's index), ``score`` and with ``return_documents`` its ``text``; the first
        ``top_k``."""
        if self.num_labels != 1:
            raise CrossEncoderError(f"rank() scores with one label; this model has {self.num_labels}: use predict() "
                                    "with the pairs")
        if not isinstance(query, str) or not isinstance(documents, (list, tuple)) or \
                not all(isinstance(d, str) for d in documents):
            raise CrossEncoderError("rank() takes a query text and a list of document texts")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise CrossEncoderError(f"top_k={top_k!r}: pass a number of documents (or None for all)")
        scores = self.predict([[query, d] for d in documents], batch_size=batch_size,
                              show_progress_bar=show_progress_bar, activation_fn=activation_fn)
        results = [{"corpus_id": i, "score": float(s), **({"text": documents[i]} if return_documents else {})}
                   for i, s in enumerate(np.atleast_1d(scores))]
        return sorted(results, key=lambda r: r["score"], reverse=True)[:top_k]

    __call__ = predict


def _check_layout(folder, config: dict) -> dict:
    """config_sentence_transformers.json's settings ({} without one), after checking that the folder holds what a
    CrossEncoder of vkformers runs: no causal LM, and in a modules.json no module but its Transformer."""
    settings = folder / "config_sentence_transformers.json"
    settings = read_json(settings) if settings.is_file() else {}
    listing = folder / "modules.json"
    if listing.is_file():
        modules = read_json(listing)
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        if settings.get("model_type") not in (None, "CrossEncoder") or kinds != ["Transformer"]:
            raise CrossEncoderError(f"{folder}: a {settings.get('model_type') or 'SentenceTransformer'} of modules "
                                    f"{', '.join(kinds)}; a cross-encoder has one Transformer module (use "
                                    "SentenceTransformer for an embedding model)")
        transformer = folder / (modules[0].get("path") or "") / "sentence_bert_config.json"
        task = (read_json(transformer) if transformer.is_file() else {}).get("transformer_task",
                                                                             "sequence-classification")
        if task != "sequence-classification":
            raise CrossEncoderError(f"{folder}: a cross-encoder of transformer_task {task!r}; vkformers runs those "
                                    "with a sequence-classification head")
    if settings.get("default_prompt_name"):
        raise CrossEncoderError(f"{folder}: default_prompt_name {settings['default_prompt_name']!r}: vkformers' "
                                "CrossEncoder puts no prompt before the pairs; remove it from "
                                "config_sentence_transformers.json")
    architectures = config.get("architectures") or [""]
    if str(architectures[0]).endswith("ForCausalLM"):  # sentence-transformers scores "yes" against "no" with it
        raise CrossEncoderError(f"{folder}: a {architectures[0]}; vkformers' CrossEncoder runs checkpoints with a "
                                "sequence-classification head, not a causal LM's logits")
    return settings


__all__ = ["ACTIVATIONS", "CrossEncoder", "CrossEncoderError", "activation_function", "is_cross_encoder_checkpoint"]
