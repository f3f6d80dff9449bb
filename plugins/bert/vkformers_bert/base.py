"""The encoders without their masked-LM head: transformers' BertModel, RobertaModel, ... (``vkformers.AutoModel``),
and the base that core's task heads (``vkformers.models.heads``) sit on, with each architecture's head layout.

Parameters keep the base-model prefix (``bert.embeddings...``), as in transformers' task models.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from vkformers.engine import functional as F
from vkformers.models.heads import (ENCODER_HEADS, BaseModelOutput, SequenceHead, TaskHeadError, TaskHeads,
                                   Transform, base_model_prefix, complete_weights, sequence_summary)
from vkformers.models.layers import Linear
from vkformers.models.module import place

from vkformers_bert.encoder import EncoderForMaskedLM, UnsupportedBaseModel
from vkformers_bert.variants import UnsupportedConfigError

# transformers' classification heads that read the first token: dense, activation, out_proj (RoBERTa, ELECTRA)
ROBERTA_HEADS = TaskHeads(SequenceHead("first", out="classifier.out_proj", dense="classifier.dense", dense_act="tanh"),
                          multiple_choice=SequenceHead("pooler"))
ELECTRA_HEADS = TaskHeads(SequenceHead("first", out="classifier.out_proj", dense="classifier.dense", dense_act="gelu"))
DISTILBERT_HEADS = TaskHeads(SequenceHead("first", out="classifier", dense="pre_classifier", dense_act="relu"),
                             multiple_choice=SequenceHead("first", dense="pre_classifier", dense_act="relu"))


def deberta_heads(config: dict) -> TaskHeads:
    """DeBERTa's ContextPooler (pooler.dense on the first token, then pooler_hidden_act) before the classifier of
    sequences and of choices; token and question-answering heads as BERT's."""
    size = config.get("pooler_hidden_size", config["hidden_size"])
    if size != config["hidden_size"]:
        raise UnsupportedConfigError(f"{config.get('model_type')}: config option pooler_hidden_size={size!r} is not "
                                     "supported by vkformers' heads yet (it must equal hidden_size)")
    pooled = SequenceHead("first", dense="pooler.dense", dense_act=config.get("pooler_hidden_act", "gelu"))
    return TaskHeads(pooled, multiple_choice=pooled)


ELECTRA_SUMMARY = dict(summary_type="first", summary_use_proj=True, summary_activation="gelu",
                       summary_proj_to_labels=False)
XLM_SUMMARY = dict(summary_type="first", summary_use_proj=True, summary_activation=None, summary_proj_to_labels=True)


def electra_heads(config: dict) -> TaskHeads:
    """ELECTRA's classification head (dense, gelu, out_proj on the first token) and its multiple-choice head: the
    sequence summary (first token, projection, gelu by default) and a one-output classifier."""
    return replace(ELECTRA_HEADS, multiple_choice=sequence_summary(config, defaults=ELECTRA_SUMMARY))


def xlm_heads(config: dict) -> TaskHeads:
    """XLM's and FlauBERT's: the sequence summary projected to the labels (first token by default), a token
    classifier, the simple question-answering head (qa_outputs; not the beam-search SQuAD head of
    XLMForQuestionAnswering) and a choice head that scores the summary's label projection with logits_proj."""
    if config.get("summary_use_proj", True) is False or not config.get("summary_proj_to_labels", True):
        raise UnsupportedConfigError(f"{config.get('model_type')}: config options summary_use_proj / "
                                     "summary_proj_to_labels off are not supported by vkformers' heads yet")
    return TaskHeads(sequence_summary(config, "sequence_summary.summary", XLM_SUMMARY),
                     multiple_choice=sequence_summary(config, "logits_proj", XLM_SUMMARY))


def first_token_heads(config: dict) -> TaskHeads:
    """ConvBERT's, RoFormer's and BigBird's classification head: dense and the config's hidden_act on the first
    token, then out_proj; token and question-answering heads as BERT's; ConvBERT's and RoFormer's choice head: the
    sequence summary (the config's summary_* fields; without them, the hidden state at the last position) and a
    one-output classifier (not declared: BigBird's question-answering and choice heads, built otherwise)."""
    big_bird = config.get("model_type") == "big_bird"
    return TaskHeads(SequenceHead("first", out="classifier.out_proj", dense="classifier.dense",
                                  dense_act=config.get("hidden_act", "gelu")),
                     question_answering=None if big_bird else "qa_outputs",
                     multiple_choice=None if big_bird else sequence_summary(config))


def modernbert_heads(config: dict) -> TaskHeads:
    """ModernBERT's prediction head (head.dense, classifier_activation, head.norm) on the first token or the mean
    (classifier_pooling) before the classifier (its choice head takes the first attended token, not the first), and
    on every token before the token and question-answering classifiers."""
    pooling = config.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise UnsupportedConfigError(f"modernbert: config option classifier_pooling={pooling!r} is not supported")
    head = dict(dense="head.dense", dense_act=config.get("classifier_activation", "gelu"), dense_norm="head.norm",
                dense_bias=bool(config.get("classifier_bias", False)), norm_eps=config.get("norm_eps", 1e-5),
                norm_bias=bool(config.get("norm_bias", False)))
    sequence = SequenceHead("first" if pooling == "cls" else "mean", **head)
    choice = replace(sequence, pooling="first_attended") if pooling == "cls" else sequence  # as transformers
    return TaskHeads(sequence, question_answering="classifier", multiple_choice=choice,
                     token_transform=Transform("head.dense", head["dense_act"], "head.norm", head["dense_bias"],
                                               head["norm_eps"], head["norm_bias"]))


def eurobert_heads(config: dict) -> TaskHeads:
    """EuroBERT's sequence head: dense, gelu and the classifier on the first token ("bos"), the mean ("mean"), or
    on every token with the logits averaged ("late", the default); a token classifier. transformers has no
    question-answering or choice head for it."""
    pooling = config.get("classifier_pooling", "late")
    kinds = {"bos": "first", "mean": "mean", "late": "late"}
    if pooling not in kinds:
        raise UnsupportedConfigError(f"eurobert: config option classifier_pooling={pooling!r} is not supported")
    return TaskHeads(SequenceHead(kinds[pooling], dense="dense", dense_act="gelu"), question_answering=None)


def first_token_heads_relu_choices(config: dict) -> TaskHeads:
    """Nyströmformer's and YOSO's: the first token through dense, hidden_act and out_proj for sequences; for choices
    through pre_classifier, ReLU and classifier; token and question-answering heads as BERT's. No pooler."""
    return TaskHeads(SequenceHead("first", out="classifier.out_proj", dense="classifier.dense",
                                  dense_act=config.get("hidden_act", "gelu_new")),
                     multiple_choice=SequenceHead("first", dense="pre_classifier", dense_act="relu"))


# architectures whose head layout depends on their config: architecture -> TaskHeads from the config
CONFIGURED = {"deberta-v2": deberta_heads, "convbert": first_token_heads,
              # transformers has DebertaV2ForMultipleChoice, no DebertaForMultipleChoice
              "deberta": lambda config: replace(deberta_heads(config), multiple_choice=None),
              "roformer": first_token_heads, "big_bird": first_token_heads, "electra": electra_heads,
              "xlm": xlm_heads, "flaubert": xlm_heads, "modernbert": modernbert_heads, "eurobert": eurobert_heads,
              "nystromformer": first_token_heads_relu_choices,
              "yoso": first_token_heads_relu_choices}

# architecture -> (its task heads, its pooler's path under the base-model prefix, or None: it has none)
DECLARED = {
    "bert": (ENCODER_HEADS, "pooler.dense"),
    "ernie": (ENCODER_HEADS, "pooler.dense"),
    "megatron-bert": (ENCODER_HEADS, "pooler.dense"),
    "roberta": (ROBERTA_HEADS, "pooler.dense"),
    "xlm-roberta": (ROBERTA_HEADS, "pooler.dense"),
    "camembert": (ROBERTA_HEADS, "pooler.dense"),
    "data2vec-text": (ROBERTA_HEADS, "pooler.dense"),
    "electra": (ELECTRA_HEADS, None),
    "distilbert": (DISTILBERT_HEADS, None),
    "mpnet": (ROBERTA_HEADS, "pooler.dense"),
    # transformers has GTE's sequence and token heads, no question-answering or choice head
    "gte": (replace(ENCODER_HEADS, question_answering=None, multiple_choice=None), "pooler.dense"),
    "albert": (ENCODER_HEADS, "pooler"),  # its pooler is a bare Linear (albert.pooler.weight)
    "squeezebert": (ENCODER_HEADS, "pooler.dense"),
    "rembert": (ENCODER_HEADS, "pooler.dense"),
    "roberta-prelayernorm": (ROBERTA_HEADS, "pooler.dense"),
    "xlm-roberta-xl": (ROBERTA_HEADS, "pooler.dense"),
    # ESM: RoBERTa's sequence head and a token head, no question answering or multiple choice in transformers
    "esm": (TaskHeads(ROBERTA_HEADS.sequence, question_answering=None), None),
    "mobilebert": (ENCODER_HEADS, "pooler.dense"),
    "fnet": (ENCODER_HEADS, "pooler.dense"),
    "roc_bert": (ENCODER_HEADS, "pooler.dense"),
    "ibert": (ROBERTA_HEADS, "pooler.dense"),
    "xmod": (ROBERTA_HEADS, "pooler.dense"),
    "luke": (ENCODER_HEADS, "pooler.dense"),  # words only: the heads read the word tokens' states and pooler
    # sequence (BERT's, on the pooler transformers' NomicBertModel leaves out) and token heads, nothing else
    "nomic_bert": (TaskHeads(SequenceHead("pooler"), question_answering=None), "pooler.dense"),
    # RoBERTa's sequence head and transformers' generic token head (score), nothing else
    "esmc": (TaskHeads(ROBERTA_HEADS.sequence, token="score", question_answering=None), None),
}


class EncoderModel(EncoderForMaskedLM):
    """An encoder of the family without the masked-LM head; ``forward`` returns
    :class:`~vkformers.models.heads.BaseModelOutput`. Architectures not in :data:`DECLARED` have no pooler and no
    task heads here yet (their hidden states are the same)."""

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = True):
        super().__init__(config, architecture)
        prefix = base_model_prefix(f"{self.spec.embeddings}.{self.spec.word}")  # XLM: transformer.embeddings
        if not prefix:
            raise UnsupportedBaseModel(f"{self.architecture_name}: its checkpoint has no base-model prefix to "
                                       "separate the encoder from its head; use AutoModelForMaskedLM")
        self.base_model_prefix = prefix
        for child in [name for name in self._modules if name != prefix]:  # the masked-LM head's modules
            del self._modules[child]
        _, pooler = DECLARED.get(self.architecture_name, (None, None))
        if pooler:  # a pooler the masked-LM model declares unused (LUKE, SqueezeBERT) gives way to this one, or goes
            *parents, leaf = f"{prefix}.{pooler}".split(".")
            node = self
            for part in parents:
                node = node._modules.get(part) if node is not None else None
            if node is not None:
                node._modules.pop(leaf, None)
        self.pooler_path = f"{prefix}.{pooler}" if pooler and add_pooling_layer else None
        pooler = place(self, self.pooler_path, Linear(self.spec.hidden_size, self.spec.hidden_size)) \
            if self.pooler_path else None
        object.__setattr__(self, "pooler", pooler)  # plain reference: place() registered it

    def complete_head(self, arrays: dict, source: str = "") -> dict:
        """A checkpoint saved without the pooler (RoBERTa's classifiers drop it): the pooler starts fresh, as in
        transformers."""
        return complete_weights(self, {self.pooler_path: self.pooler} if self.pooler is not None else {}, arrays,
                                source)

    @classmethod
    def task_heads(cls, config: dict, spelling: str) -> TaskHeads | None:
        if spelling in CONFIGURED:
            return CONFIGURED[spelling](config)
        return DECLARED.get(spelling, (None, None))[0]

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_hidden_states=False,
                global_attention_mask=None):
        recorded = [] if output_hidden_states else None
        x = self.encode(input_ids, attention_mask, token_type_ids, hidden_states=recorded,
                        global_attention_mask=global_attention_mask)
        pooled = F.tanh(self.pooler(x[:, 0])) if self.pooler is not None else None
        return BaseModelOutput(last_hidden_state=x, pooler_output=pooled,
                               hidden_states=tuple(recorded) if recorded is not None else None)


class GlobalFirstTokenModel(EncoderModel):
    """Longformer's base under its sequence classifier: global attention on the first token unless the caller's
    global_attention_mask says otherwise, as LongformerForSequenceClassification."""

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_hidden_states=False,
                global_attention_mask=None):
        if global_attention_mask is None:
            shape = (input_ids.numpy() if hasattr(input_ids, "numpy") else np.asarray(input_ids)).shape
            global_attention_mask = np.zeros(shape, np.int64)
            global_attention_mask[:, 0] = 1
        return super().forward(input_ids, attention_mask, token_type_ids, output_hidden_states, global_attention_mask)


class GlobalQuestionModel(EncoderModel):
    """Longformer's base under its question-answering head: global attention on the question's tokens (those before
    the first of each row's three separators) unless the caller's global_attention_mask says otherwise, as
    LongformerForQuestionAnswering; under its choice head (``before_separator`` False) on the tokens after the
    second separator, as LongformerForMultipleChoice."""

    before_separator = True

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_hidden_states=False,
                global_attention_mask=None):
        if global_attention_mask is None:
            global_attention_mask = question_tokens(
                input_ids.numpy() if hasattr(input_ids, "numpy") else np.asarray(input_ids),
                self.config.get("sep_token_id", 2), self.before_separator)
        return super().forward(input_ids, attention_mask, token_type_ids, output_hidden_states, global_attention_mask)


class GlobalChoiceModel(GlobalQuestionModel):
    before_separator = False


def question_tokens(ids: np.ndarray, sep: int, before: bool) -> np.ndarray:
    """1 at the positions before each row's first separator (``before``), else after its second one."""
    counts = (ids == sep).sum(-1)
    if (counts != 3).any():
        raise TaskHeadError(f"Longformer's heads find the question by its separators: every row must hold exactly "
                            f"three (sep_token_id {sep}; a row holds {int(counts[counts != 3][0])}); pass "
                            "global_attention_mask yourself otherwise")
    first = np.argmax(ids == sep, axis=-1)[:, None]
    positions = np.arange(ids.shape[-1])[None]
    return (positions < first if before else positions > first + 1).astype(np.int64)


# Longformer: RoBERTa's heads over global attention on the first token (sequences), on the question's tokens
# (answers, choices), and none for the token classifier unless a global_attention_mask is given
LONGFORMER_HEADS = replace(ROBERTA_HEADS, base_classes=(("sequence-classification", GlobalFirstTokenModel),
                                                         ("question-answering", GlobalQuestionModel),
                                                         ("multiple-choice", GlobalChoiceModel)))
DECLARED["longformer"] = (LONGFORMER_HEADS, "pooler.dense")
