"""Base-model outputs and the task heads every family shares: sequence classification, token classification and
extractive question answering, with transformers' parameter names, losses and ``problem_type`` semantics.

A family plugin provides one *base model* class (task ``"base"`` of the ``vkformers_model_class`` hook): its
model without the language-modelling head, whose parameters keep the checkpoint's paths under the base-model
prefix (``bert.embeddings...``, ``model.layers...``), and whose forward returns :class:`BaseModelOutput`. Its
class declares

- ``task_heads(config, spelling) -> TaskHeads | None`` (a classmethod): for a ``model_type`` spelling that runs
  on this base (the architecture's own name, an alias or a multimodal wrapper), the heads transformers has for that
  spelling, where it puts each and how the sequence head pools (None: no task head). Only heads transformers has
  are declared (tests/test_heads_table.py compares them with its table, tools/write_head_table.py);
- ``__init__(config, architecture, add_pooling_layer=True)``: whether to build the pooler (transformers'
  RoBERTa classifier drops it, BERT's reads it);
- ``base_model_prefix``: the first path component of its parameters ("" when they have none).

The head models here then wrap any such base: :class:`ModelForSequenceClassification`,
:class:`ModelForTokenClassification` and :class:`ModelForQuestionAnswering` (``vkformers.AutoModelFor...``).
A head model holds the base's modules under their own names and adds its head's beside them, so the names are
transformers' (``bert.encoder.layer.0...`` and ``classifier.weight``; ``model.layers.0...`` and ``score.weight``).
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, replace

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.models.inputs import IGNORE_INDEX, InputLimits
from vkformers.models.layers import LayerNorm, Linear
from vkformers.models.lazy_weights import LazyWeights
from vkformers.models.module import Module, place

PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


class TaskHeadError(VkformersError, ValueError):
    """A task head the architecture does not declare, or labels / a config the head cannot use."""


# ---------------------------------------------------------------- outputs (transformers' field names)

@dataclass
class BaseModelOutput:
    last_hidden_state: object = None
    pooler_output: object = None      # tanh(dense(first token)) where the architecture has a pooler
    hidden_states: tuple | None = None  # embeddings, then each layer's output (output_hidden_states=True)


@dataclass
class Seq2SeqModelOutput:
    last_hidden_state: object = None          # the decoder's
    encoder_last_hidden_state: object = None
    hidden_states: tuple | None = None
    decoder_hidden_states: tuple | None = None  # output_hidden_states=True: each stack's embeddings, layer outputs
    encoder_hidden_states: tuple | None = None


@dataclass
class SequenceClassifierOutput:
    loss: object = None
    logits: object = None
    hidden_states: tuple | None = None


@dataclass
class TokenClassifierOutput:
    loss: object = None
    logits: object = None
    hidden_states: tuple | None = None


@dataclass
class QuestionAnsweringModelOutput:
    loss: object = None
    start_logits: object = None
    end_logits: object = None
    hidden_states: tuple | None = None


# ---------------------------------------------------------------- what an architecture declares

@dataclass(frozen=True)
class SequenceHead:
    """How a sequence-classification head reads the base model's output, under transformers' names.

    ``pooling``: "pooler" (the base's pooler_output: BERT), "first" (the first token's hidden state: RoBERTa,
    ELECTRA, DistilBERT), "first_attended" (the first token the attention mask keeps: ModernBERT's choice head),
    "final" (the hidden state at the last position, padding or not: the sequence summary
    transformers' RoFormer and ConvBERT choice heads take), "mean" (the mean over the attended tokens: ModernBERT),
    "late" (dense, activation and ``out`` on every token, then the mean of the logits over the attended tokens:
    EuroBERT's default),
    "last" (the last token that is not the pad id, as transformers' decoders take it) or "eos" (the last
    end-of-sequence token of each row, as BART's; every row must hold as many).
    ``dense``: an optional hidden -> hidden projection (hidden -> num_labels with ``dense_to_labels``: XLM's
    summary projected to the labels, then scored by ``out``), its activation (None: none) and an optional
    LayerNorm ``dense_norm`` after it, before the output projection ``out``.
    """

    pooling: str
    out: str = "classifier"
    out_bias: bool = True
    dense: str | None = None
    dense_act: str | None = "tanh"
    dense_to_labels: bool = False
    dense_norm: str | None = None
    dense_bias: bool = True
    norm_eps: float = 1e-5
    norm_bias: bool = True


@dataclass(frozen=True)
class Transform:
    """A projection run on every token before the token-classification and question-answering projections
    (ModernBERT's head: dense, activation, LayerNorm)."""

    dense: str
    act: str = "gelu"
    norm: str | None = None
    bias: bool = True
    norm_eps: float = 1e-5
    norm_bias: bool = True


@dataclass(frozen=True)
class TaskHeads:
    """Where an architecture's task heads live: the sequence head, the token-classification projection and the
    question-answering projection (None: transformers has no such head for it)."""

    sequence: SequenceHead | None
    token: str | None = "classifier"
    token_bias: bool = True
    question_answering: str | None = "qa_outputs"
    multiple_choice: SequenceHead | None = None  # one score per choice (its out projection has one output)
    # (task, prefix): the head models whose base sits under another prefix than the base model's own, as
    # transformers' T5ForSequenceClassification ("transformer.shared...") and LlamaForQuestionAnswering
    # ("transformer.layers..." where LlamaModel's task models say "model.layers...")
    base_prefixes: tuple = ()
    # (task, base class): the head models whose base is another class than the family's base model, as
    # transformers' T5ForTokenClassification runs T5EncoderModel (the encoder alone)
    base_classes: tuple = ()
    token_transform: Transform | None = None  # run before the token and question-answering projections


# BERT's: classifier on the pooler (for sequences and for each choice), token classifier, qa_outputs
ENCODER_HEADS = TaskHeads(SequenceHead("pooler"), multiple_choice=SequenceHead("pooler"))
# transformers' GenericForSequenceClassification of a decoder: score (no bias) on the last non-pad token
DECODER_SEQUENCE = SequenceHead("last", out="score", out_bias=False)
# with GenericForTokenClassification (score, with a bias); a decoder plugin declares these per spelling
DECODER_HEADS = TaskHeads(DECODER_SEQUENCE, token="score", question_answering=None)


def offered_tasks(heads: TaskHeads | None) -> tuple[str, ...]:
    """The tasks ("sequence-classification", ...) a declaration offers a head for, in HEAD_MODELS order."""
    return tuple(task for task, model in HEAD_MODELS.items() if heads is not None and model.head_of(heads) is not None)


# transformers' SequenceSummary defaults where a config has no summary_* fields (getattr's defaults there)
SUMMARY_DEFAULTS = dict(summary_type="last", summary_use_proj=False, summary_activation=None,
                        summary_proj_to_labels=False)
SUMMARY_POOLING = {"first": "first", "last": "final"}


def sequence_summary(config: dict, out: str = "classifier", defaults: dict = SUMMARY_DEFAULTS) -> SequenceHead:
    """transformers' SequenceSummary (``sequence_summary.summary``: the first or the last position, an optional
    projection, an optional activation) before ``out``; with summary_proj_to_labels the projection gives the labels
    and ``out`` is itself (``out="sequence_summary.summary"``) or follows it (XLM's logits_proj)."""
    def get(key):
        return config.get(key, defaults[key])
    kind = get("summary_type")
    if kind not in SUMMARY_POOLING:
        raise TaskHeadError(f"{config.get('model_type')}: config option summary_type={kind!r} is not supported by "
                            "vkformers' heads yet (first or last)")
    act = get("summary_activation") or None
    if not get("summary_use_proj"):
        return SequenceHead(SUMMARY_POOLING[kind], out=out)
    to_labels = bool(get("summary_proj_to_labels"))
    if out == "sequence_summary.summary":  # the projection is the output
        if act:
            raise TaskHeadError(f"{config.get('model_type')}: config option summary_activation={act!r} after the "
                                "label projection is not supported by vkformers' heads yet")
        return SequenceHead(SUMMARY_POOLING[kind], out=out)
    return SequenceHead(SUMMARY_POOLING[kind], out=out, dense="sequence_summary.summary", dense_act=act,
                        dense_to_labels=to_labels)


def base_model_prefix(path: str) -> str:
    """The first component of a dotted parameter path ("bert" of "bert.embeddings"), "" for a top-level one."""
    return path.split(".", 1)[0] if "." in path else ""


# ---------------------------------------------------------------- labels and losses

def head_config(config: dict, num_labels: int | None = None, id2label: dict | None = None,
                label2id: dict | None = None, problem_type: str | None = None) -> dict:
    """``config`` with transformers' label fields settled: ``num_labels`` (from the argument, ``id2label`` or the
    default 2), ``id2label`` / ``label2id`` (``LABEL_i`` names unless given) and ``problem_type``."""
    config = dict(config)
    stored = config.get("id2label")
    if id2label is not None:
        stored = {str(k): v for k, v in id2label.items()}
    if num_labels is None:
        num_labels = len(stored) if stored else int(config.get("num_labels", 2))
    if not isinstance(num_labels, int) or num_labels < 1:
        raise TaskHeadError(f"num_labels={num_labels!r}: pass a positive number of labels")
    if not stored or len(stored) != num_labels:
        stored = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    config["id2label"] = {str(k): v for k, v in stored.items()}
    config["label2id"] = ({str(k): int(v) for k, v in label2id.items()} if label2id is not None
                          else {v: int(k) for k, v in config["id2label"].items()})
    config["num_labels"] = num_labels
    if problem_type is not None:
        config["problem_type"] = problem_type
    if config.get("problem_type") not in (None,) + PROBLEM_TYPES:
        raise TaskHeadError(f"problem_type={config['problem_type']!r}; use one of {', '.join(PROBLEM_TYPES)}")
    return config


def _host(labels) -> np.ndarray:
    return labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)


def _target(labels, dtype) -> Tensor:
    """The labels flattened to ``dtype`` as a graph input; a captured training step (engine.lazy.StepCapture)
    derives it anew from the next batch's labels."""
    def derive(array):
        return np.ascontiguousarray(np.asarray(array).reshape(-1), dtype=dtype)
    return Tensor(lazy.derived_input(derive(_host(labels)), labels, derive))


def _float_target(labels) -> tuple[Tensor, Tensor]:
    """Float labels flattened as two graph inputs: the values, a missing one (NaN) as 0, and 1 where a value is
    present, 0 where it is missing (the filler rows of an epoch's last batch, training/data.py's Batches)."""
    def values(array):
        return np.nan_to_num(np.asarray(array, np.float32).reshape(-1), nan=0.0)

    def present(array):
        return (~np.isnan(np.asarray(array, np.float32).reshape(-1))).astype(np.float32)
    host = _host(labels)
    return (Tensor(lazy.derived_input(values(host), labels, values)),
            Tensor(lazy.derived_input(present(host), labels, present)))


def _present_mean(values: Tensor, present: Tensor) -> Tensor:
    """The mean of ``values`` where ``present`` is 1 (0 when none is: no NaN for the gradients to carry)."""
    return (values * present).sum() / present.sum().clamp(min=1.0)


def problem_type_of(config: dict, labels: np.ndarray) -> str:
    """transformers' rule when the config names none: one label is regression, integer labels single-label
    classification, anything else multi-label."""
    if config.get("problem_type"):
        return config["problem_type"]
    if config["num_labels"] == 1:
        return "regression"
    return "single_label_classification" if labels.dtype.kind in "iu" else "multi_label_classification"


def sequence_classification_loss(logits, labels, config: dict):
    """transformers' loss for a sequence head: MSE (regression; one label squeezed), cross-entropy (single label,
    -100 ignored) or binary cross-entropy with logits (multi-label), each a mean in float32. A NaN float label (a
    filler row's) is left out of the MSE and BCE means, as -100 is out of the cross-entropy."""
    host = _host(labels)
    kind = problem_type_of(config, host)
    num_labels = config["num_labels"]
    logits = logits.float()
    if kind == "regression":
        target, present = _float_target(labels)
        diff = logits.reshape(-1) - target  # transformers squeezes one label; several compare elementwise
        return _present_mean(diff * diff, present)
    if kind == "single_label_classification":
        bad = host[(host != IGNORE_INDEX) & ((host < 0) | (host >= num_labels))]
        if host.dtype.kind not in "iu" or bad.size:
            raise TaskHeadError(f"labels must be class ids in [0, {num_labels}) (or -100); got "
                                f"{bad.reshape(-1)[0] if bad.size else host.dtype}")
        return F.cross_entropy(logits.reshape(-1, num_labels), _target(labels, np.int32), ignore_index=IGNORE_INDEX)
    if host.shape != tuple(logits.shape):
        raise TaskHeadError(f"multi-label labels have shape {host.shape}; they must be [batch, num_labels] = "
                            f"{tuple(logits.shape)} (0/1 per label)")
    logits = logits.reshape(-1)
    target, present = _float_target(labels)
    return _present_mean(F.softplus(logits) - logits * target, present)  # BCE with logits: log(1 + e^x) - x y


def token_classification_loss(logits, labels, num_labels: int):
    """Cross-entropy over every token whose label is not -100 (transformers' ForTokenClassification)."""
    return F.cross_entropy(logits.float().reshape(-1, num_labels), _target(labels, np.int32), ignore_index=IGNORE_INDEX)


def question_answering_loss(start_logits, end_logits, start_positions=None, end_positions=None, labels=None):
    """The mean of the start and end cross-entropies; positions are clamped to [0, T] and T is ignored (an answer
    outside the window), as transformers does. ``labels`` [B, 2]: both positions in one array (the Trainer's
    batches), where -100 too is ignored (a filler row of an epoch's last batch, training/data.py's Batches)."""
    length = start_logits.shape[1]
    sources = ((start_positions, None), (end_positions, None)) if labels is None else ((labels, 0), (labels, 1))
    losses = []
    for logits, (positions, column) in zip((start_logits, end_logits), sources):
        def derive(array, column=column):  # a captured training step derives it anew from the next batch
            array = np.asarray(array)
            if column is not None:
                array = np.where(array[..., column] == IGNORE_INDEX, length, array[..., column])
            return np.ascontiguousarray(np.clip(array.reshape(-1).astype(np.int64), 0, length), dtype=np.int32)
        target = Tensor(lazy.derived_input(derive(_host(positions)), positions, derive))
        losses.append(F.cross_entropy(logits.float(), target, ignore_index=length))
    return (losses[0] + losses[1]) * 0.5


# ---------------------------------------------------------------- pooling

def last_non_pad_index(input_ids: np.ndarray, pad_token_id: int | None) -> np.ndarray:
    """Per row, the index of the rightmost token that is not the pad id (left or right padding alike; 0 for a
    row of pads), as transformers' decoders' sequence head picks it; the last token when there is no pad id."""
    batch, length = input_ids.shape
    if pad_token_id is None:
        if batch != 1:
            raise TaskHeadError("a batch of more than one sequence needs a pad token to find each row's last "
                                "token; set config pad_token_id (e.g. to the tokenizer's pad or eos id)")
        return np.full(batch, length - 1, np.int64)
    real = (input_ids != pad_token_id).astype(np.int64)
    return (np.arange(length) * real).argmax(-1)


def first_attended_index(attention_mask) -> np.ndarray:
    """Per row, the index of the first attended token (left or right padding alike), as ModernBERT's choice head
    finds its CLS token."""
    return np.asarray(attention_mask).argmax(-1)


def last_eos_index(input_ids: np.ndarray, eos_token_id) -> np.ndarray:
    """Per row, the index of the last end-of-sequence token (BART's sequence head reads its hidden state)."""
    eos = np.isin(input_ids, np.atleast_1d(np.asarray(eos_token_id if eos_token_id is not None else [])))
    counts = eos.sum(1)
    if eos_token_id is None or counts.min() == 0 or len(set(counts.tolist())) > 1:
        raise TaskHeadError("every row must hold the same number (at least one) of end-of-sequence tokens "
                            f"(eos_token_id {eos_token_id}); add the eos token to each text, as the tokenizer does")
    return input_ids.shape[1] - 1 - np.argmax(eos[:, ::-1], axis=1)


def _gather_indices(index: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    batch = len(index)
    flat = (np.arange(batch) * length + index).astype(np.int32)
    inverse = np.full(batch * length, -1, np.int32)
    inverse[flat] = np.arange(batch, dtype=np.int32)
    return flat, inverse


def take_tokens(hidden, index: np.ndarray, source=None, pick=None):
    """hidden[b, index[b]] for hidden [B, T, D]: [B, D], its gradient flowing back to those rows only.
    ``source`` and ``pick``: the input ``index`` comes from and ``pick(source) -> index``, so that a captured
    training step (engine.lazy.StepCapture) derives the indices anew from its next batch."""
    batch, length, width = hidden.shape
    flat, inverse = _gather_indices(index, length)
    if source is not None:
        flat = lazy.derived_input(flat, source, lambda a: _gather_indices(pick(a), length)[0])
        inverse = lazy.derived_input(inverse, source, lambda a: _gather_indices(pick(a), length)[1])
    return F.gather_rows(hidden.reshape(batch * length, width), Tensor(flat), Tensor(inverse))


def _mean_weights(mask) -> np.ndarray:
    mask = np.asarray(mask).astype(np.float32)
    return (mask / np.maximum(mask.sum(1, keepdims=True), 1e-9))[:, None, :].astype(np.float32)


def mean_pool(hidden, attention_mask=None):
    """Mean of the hidden states of the attended tokens (sentence-transformers' mean pooling), in float32: [B, D].
    A captured training step (engine.lazy.StepCapture) derives the weights anew from its next batch's mask."""
    batch, length, _ = hidden.shape
    if attention_mask is None:
        weights = _mean_weights(np.ones((batch, length), np.float32))
    else:
        weights = lazy.derived_input(_mean_weights(_host(attention_mask)), attention_mask, _mean_weights)
    return (Tensor(weights) @ hidden.float()).reshape(batch, -1)


# ---------------------------------------------------------------- head models

def complete_weights(model, modules: dict, arrays, source: str = "", seed: int = 0) -> LazyWeights:
    """``arrays`` with the weights of ``modules`` (path -> Linear or LayerNorm: a new task head, a pooler the
    checkpoint lacks) that it does not hold initialised as transformers' _init_weights does (normal(0,
    initializer_range), zero biases, LayerNorms at one), said in one line on stderr."""
    arrays = LazyWeights.of(arrays)
    missing = [f"{path}.{slot}" for path, module in modules.items() for slot in module._slots
               if f"{path}.{slot}" not in arrays]
    if not missing:
        return arrays
    rng = np.random.default_rng(seed)
    std = float(model.config.get("initializer_range", 0.02))
    fresh = {}
    for path, module in modules.items():
        if isinstance(module, LayerNorm):  # ones and zeros
            width = module._slots["weight"].shape[0]
            fresh[f"{path}.weight"] = np.ones(width, np.float32)
            if module.has_bias:
                fresh[f"{path}.bias"] = np.zeros(width, np.float32)
            continue
        fresh[f"{path}.weight"] = rng.normal(0.0, std, (module.out_features, module.in_features)).astype(np.float32)
        if module.has_bias:
            fresh[f"{path}.bias"] = np.zeros(module.out_features, np.float32)
    print(f"vkformers: {type(model).__name__} ({model.architecture_name}): weights not in the checkpoint"
          f"{' ' + source if source else ''}, freshly initialised: {', '.join(missing)}; train them before using "
          "the model's predictions", file=sys.stderr)
    return arrays.updated({name: fresh[name] for name in missing})


class TaskModel(Module):
    """A base model of any family with a task head (what every head model below shares)."""

    task = ""
    supports_gradient_checkpointing = True

    def __init__(self, config: dict, architecture, base_class, spelling: str | None = None):
        """``spelling``: the config's model_type as registered (an alias or a wrapper: its own heads), by default
        the architecture's name."""
        super().__init__()
        name = getattr(architecture, "name", architecture)
        spelling = spelling or name
        heads = base_class.task_heads(config, spelling)
        head = self.head_of(heads)
        if head is None:
            what = repr(spelling) if spelling == name else f"{spelling!r} (run as {name!r})"
            raise TaskHeadError(f"architecture {what} has no {self.task} head in vkformers (its task heads: "
                                f"{', '.join(offered_tasks(heads)) or 'none'}); use AutoModel for its hidden "
                                "states and put your own head on them")
        self.config = head_config(config)
        base_class = dict(heads.base_classes).get(self.task, base_class)
        base = base_class(self.config, architecture, add_pooling_layer=self.uses_pooler(head))
        object.__setattr__(self, "base", base)
        self.base_model_prefix = base.base_model_prefix
        own, prefix = base.base_model_prefix, dict(heads.base_prefixes).get(self.task)
        # checkpoint names of the base's parameters -> the base's own ("transformer.x" -> "model.x" or "x")
        self._base_rename = None if prefix is None else (prefix + ".", own + "." if own else "")
        if prefix is not None and not own:  # the whole base under the prefix
            self.add(prefix, base)
        else:  # the base's modules keep their own names (the prefixed one renamed)
            for child, module in base._modules.items():
                self.add(prefix if prefix is not None and child == own else child, module)
            self._slots.update(base._slots)
        if prefix is not None:
            self.base_model_prefix = prefix
        object.__setattr__(self, "head_modules", {})
        self.heads = heads
        self.build_head(head, self.config["num_labels"], self.hidden_size(base))
        self._base_arguments = set(inspect.signature(base.forward).parameters)
        self.architecture_name = name
        self.supports_gradient_checkpointing = base.supports_gradient_checkpointing

    # -- declared by each head model
    @staticmethod
    def head_of(heads: TaskHeads):
        raise NotImplementedError

    def uses_pooler(self, head) -> bool:
        return False

    def build_head(self, head, num_labels: int, hidden: int) -> None:
        raise NotImplementedError

    # -- shared
    @staticmethod
    def hidden_size(base) -> int:
        """The width of the base's last hidden state: its ``output_size`` if it declares one, else its spec's or
        config's hidden_size / d_model."""
        if isinstance(getattr(base, "output_size", None), int):
            return base.output_size
        for source in (base.spec, base.config):
            for name in ("hidden_size", "d_model"):
                value = getattr(source, name, None) if source is base.spec else source.get(name)
                if isinstance(value, int):
                    return value
        raise TaskHeadError(f"{type(base).__name__}: no hidden_size or d_model to size the head with")

    def add_head_linear(self, path: str, in_features: int, out_features: int, bias: bool) -> Linear:
        module = place(self, path, Linear(in_features, out_features, bias=bias))
        self.head_modules[path] = module
        return module

    def add_head_norm(self, path: str, width: int, eps: float, bias: bool) -> LayerNorm:
        module = place(self, path, LayerNorm(width, eps=eps, bias=bias))
        self.head_modules[path] = module
        return module

    def build_transform(self, hidden: int):
        """The declared per-token transform (dense, activation, norm) as a function of the hidden states, or None."""
        t = self.heads.token_transform
        if t is None:
            return None
        dense = self.add_head_linear(t.dense, hidden, hidden, t.bias)
        norm = self.add_head_norm(t.norm, hidden, t.norm_eps, t.norm_bias) if t.norm else None

        def transform(h):
            h = F.activation(t.act)(dense(h))
            return norm(h) if norm is not None else h
        return transform

    @property
    def dtype(self):
        return self.base.dtype

    @dtype.setter
    def dtype(self, value):
        self.base.dtype = value

    @property
    def ignored_checkpoint_keys(self):
        return getattr(self.base, "ignored_checkpoint_keys", ())

    @property
    def num_labels(self) -> int:
        return self.config["num_labels"]

    def train(self, mode: bool = True):
        super().train(mode)
        self.base.train(mode)
        return self

    def _set_gradient_checkpointing(self, on: bool) -> None:
        super()._set_gradient_checkpointing(on)
        self.base._set_gradient_checkpointing(on)

    def input_limits(self) -> InputLimits:
        return replace(self.base.input_limits(), labels_like=None)  # labels are checked by the head's loss

    def complete_head(self, arrays: dict, source: str = "", ignore_mismatched_sizes: bool = False) -> dict:
        """``arrays`` with the head's missing weights freshly initialised, said in one line on stderr; head weights
        of another shape (a head trained for other labels) are refused, or replaced with
        ``ignore_mismatched_sizes`` (transformers' option)."""
        arrays = LazyWeights.of(arrays)
        shapes = {f"{path}.{slot}": module._slots[slot].shape for path, module in self.head_modules.items()
                  for slot in module._slots}
        mismatched = [name for name, shape in shapes.items() if name in arrays and arrays.shape(name) != shape]
        if mismatched and not ignore_mismatched_sizes:
            name = mismatched[0]
            raise TaskHeadError(f"the checkpoint's {name} has shape {arrays.shape(name)}, this head "
                                f"{shapes[name]} ({self.num_labels} labels); pass ignore_mismatched_sizes=True to "
                                "start a new head")
        return complete_weights(self, self.head_modules, arrays.without(mismatched), source)

    def load_state_dict(self, arrays, dtype="float32", strict: bool = True, requires_grad: bool = True, ignore=()):
        arrays = LazyWeights.of(arrays)
        head_names = {f"{path}.{slot}" for path, module in self.head_modules.items() for slot in module._slots}
        base_arrays = arrays.without(head_names)
        if self._base_rename is not None:
            ours, theirs = self._base_rename
            base_arrays = base_arrays.renamed(lambda k: theirs + k[len(ours):] if k.startswith(ours) else k)
        self.base.load_state_dict(base_arrays, dtype=dtype, strict=strict, requires_grad=requires_grad, ignore=ignore)
        holder = Module()
        for path, module in self.head_modules.items():
            place(holder, path, module)
        holder.load_state_dict(arrays.filtered(lambda k: k in head_names), dtype=dtype, requires_grad=requires_grad)

    def run_base(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 output_hidden_states=False, global_attention_mask=None) -> BaseModelOutput:
        """The base's forward with the inputs it takes; one it does not take (Longformer's global_attention_mask
        elsewhere) is refused."""
        given = dict(attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
                     output_hidden_states=output_hidden_states, global_attention_mask=global_attention_mask)
        unknown = [k for k, v in given.items() if v is not None and v is not False and k not in self._base_arguments]
        if unknown:
            raise TaskHeadError(f"{self.architecture_name} takes no {unknown[0]}; leave it out")
        return self.base.forward(input_ids, **{k: v for k, v in given.items() if k in self._base_arguments})


class ModelForSequenceClassification(TaskModel):
    """transformers' XForSequenceClassification: one label (or one vector of scores) per sequence."""

    task = "sequence-classification"

    @staticmethod
    def head_of(heads):
        return heads.sequence if heads is not None else None

    def uses_pooler(self, head) -> bool:
        return head.pooling == "pooler"

    def build_head(self, head: SequenceHead, num_labels, hidden):
        self.head = head
        width = self.config["num_labels"] if head.dense_to_labels else hidden
        object.__setattr__(self, "dense", self.add_head_linear(head.dense, hidden, width, head.dense_bias)
                           if head.dense else None)
        object.__setattr__(self, "dense_norm", self.add_head_norm(head.dense_norm, width, head.norm_eps,
                                                                  head.norm_bias) if head.dense_norm else None)
        object.__setattr__(self, "out", self.add_head_linear(head.out, width if head.dense else hidden, num_labels,
                                                             head.out_bias))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, global_attention_mask=None):
        out = self.run_base(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                            global_attention_mask)
        h = out.last_hidden_state
        if self.head.pooling == "late":
            logits = mean_pool(self.out(F.activation(self.head.dense_act)(self.dense(h))), attention_mask)
            loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
            return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)
        if self.head.pooling == "pooler":
            pooled = out.pooler_output
        elif self.head.pooling == "first":
            pooled = h[:, 0]
        elif self.head.pooling == "first_attended":
            if attention_mask is None:
                pooled = h[:, 0]
            else:
                pooled = take_tokens(h, first_attended_index(_host(attention_mask)), attention_mask,
                                     first_attended_index)
        elif self.head.pooling == "final":
            pooled = h[:, h.shape[1] - 1]
        elif self.head.pooling == "mean":
            pooled = mean_pool(h, attention_mask)
            pooled = pooled if pooled.dtype == h.dtype else pooled.cast(h.dtype)
        elif self.head.pooling == "eos":
            eos = self.base.config.get("eos_token_id")
            pooled = take_tokens(h, last_eos_index(_host(input_ids), eos), input_ids,
                                 lambda ids: last_eos_index(np.asarray(ids), eos))
        else:
            pad = self.base.config.get("pad_token_id")
            pooled = take_tokens(h, last_non_pad_index(_host(input_ids), pad), input_ids,
                                 lambda ids: last_non_pad_index(np.asarray(ids), pad))
        if self.dense is not None:
            pooled = self.dense(pooled)
            if self.head.dense_act:
                pooled = F.activation(self.head.dense_act)(pooled)
        if self.dense_norm is not None:
            pooled = self.dense_norm(pooled)
        logits = self.out(pooled)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


class ModelForTokenClassification(TaskModel):
    """transformers' XForTokenClassification: one label per token (NER); -100 labels take no part in the loss."""

    task = "token-classification"

    @staticmethod
    def head_of(heads):
        return heads.token if heads is not None else None

    def build_head(self, head: str, num_labels, hidden):
        object.__setattr__(self, "transform", self.build_transform(hidden))
        object.__setattr__(self, "out", self.add_head_linear(head, hidden, num_labels, self.heads.token_bias))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, global_attention_mask=None):
        out = self.run_base(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                            global_attention_mask)
        h = out.last_hidden_state
        logits = self.out(self.transform(h) if self.transform is not None else h)
        loss = token_classification_loss(logits, labels, self.num_labels) if labels is not None else None
        return TokenClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


class ModelForQuestionAnswering(TaskModel):
    """transformers' XForQuestionAnswering: start and end logits of the answer span over the tokens."""

    task = "question-answering"

    @staticmethod
    def head_of(heads):
        return heads.question_answering if heads is not None else None

    def build_head(self, head: str, num_labels, hidden):
        object.__setattr__(self, "transform", self.build_transform(hidden))
        object.__setattr__(self, "out", self.add_head_linear(head, hidden, 2, True))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, start_positions=None,
                end_positions=None, output_hidden_states=False, labels=None, global_attention_mask=None):
        """``labels`` [B, 2]: start and end positions in one array, as the Trainer's batches hold them."""
        out = self.run_base(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states,
                            global_attention_mask)
        h = out.last_hidden_state
        logits = self.out(self.transform(h) if self.transform is not None else h)
        start_logits, end_logits = logits[..., 0].contiguous(), logits[..., 1].contiguous()
        loss = None
        if labels is not None:
            loss = question_answering_loss(start_logits, end_logits, labels=labels)
        elif start_positions is not None and end_positions is not None:
            loss = question_answering_loss(start_logits, end_logits, start_positions, end_positions)
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                                            hidden_states=out.hidden_states)


@dataclass
class MultipleChoiceModelOutput:
    loss: object = None
    logits: object = None   # [batch, choices]
    hidden_states: tuple | None = None


class ModelForMultipleChoice(ModelForSequenceClassification):
    """transformers' XForMultipleChoice: ``input_ids`` [batch, choices, length]; each choice is scored by the
    sequence head with one output, ``labels`` [batch] name the right choice (cross-entropy over the choices)."""

    task = "multiple-choice"

    @staticmethod
    def head_of(heads):
        return heads.multiple_choice if heads is not None else None

    def build_head(self, head: SequenceHead, num_labels, hidden):
        super().build_head(head, 1, hidden)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                 output_hidden_states=False, global_attention_mask=None):
        ids = _host(input_ids)
        if ids.ndim != 3:
            raise TaskHeadError(f"input_ids has shape {ids.shape}; a multiple-choice model takes [batch, choices, "
                                "length]")

        def flat(value):
            return None if value is None else _host(value).reshape(-1, ids.shape[-1])
        self._choices = ids.shape[1]
        return super().__call__(flat(ids), flat(attention_mask), flat(token_type_ids), flat(position_ids),
                                labels=labels, output_hidden_states=output_hidden_states,
                                global_attention_mask=flat(global_attention_mask))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=False, global_attention_mask=None):
        out = super().forward(input_ids, attention_mask, token_type_ids, position_ids, None, output_hidden_states,
                              global_attention_mask)
        logits = out.logits.reshape(-1, self._choices)
        loss = None
        if labels is not None:
            host = _host(labels).reshape(-1)
            loss = F.cross_entropy(logits.float(), Tensor(host.astype(np.int32)), ignore_index=IGNORE_INDEX)
        return MultipleChoiceModelOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


HEAD_MODELS = {cls.task: cls for cls in (ModelForSequenceClassification, ModelForTokenClassification,
                                          ModelForQuestionAnswering, ModelForMultipleChoice)}

__all__ = ["BaseModelOutput", "Transform", "DECODER_HEADS", "DECODER_SEQUENCE", "ENCODER_HEADS", "HEAD_MODELS",
           "ModelForMultipleChoice", "ModelForQuestionAnswering", "MultipleChoiceModelOutput",
           "ModelForSequenceClassification", "ModelForTokenClassification", "QuestionAnsweringModelOutput",
           "Seq2SeqModelOutput", "SequenceClassifierOutput", "SequenceHead", "TaskHeadError", "TaskHeads", "TaskModel",
           "TokenClassifierOutput", "base_model_prefix", "complete_weights", "head_config", "last_eos_index",
           "last_non_pad_index", "mean_pool", "offered_tasks", "problem_type_of", "question_answering_loss",
           "sequence_classification_loss", "sequence_summary", "take_tokens", "token_classification_loss"]
