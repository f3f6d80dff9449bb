"""The encoders without their masked-LM head: transformers' BertModel, RobertaModel, ... (``vkformers.AutoModel``),
and the base that core's task heads (``vkformers.models.heads``) sit on, with each architecture's head layout.

Parameters keep the base-model prefix (``bert.embeddings...``), as in transformers' task models.
"""
from __future__ import annotations

from vkformers.engine import functional as F
from vkformers.models.heads import (ENCODER_HEADS, BaseModelOutput, SequenceHead, TaskHeads, base_model_prefix,
                                   complete_weights)
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


def first_token_heads(config: dict) -> TaskHeads:
    """ConvBERT's, RoFormer's and BigBird's classification head: dense and the config's hidden_act on the first
    token, then out_proj; token and question-answering heads as BERT's (not declared: their multiple-choice heads,
    and BigBird's question-answering head, which are built otherwise)."""
    return TaskHeads(SequenceHead("first", out="classifier.out_proj", dense="classifier.dense",
                                  dense_act=config.get("hidden_act", "gelu")),
                     question_answering=None if config.get("model_type") == "big_bird" else "qa_outputs")


def first_token_heads_relu_choices(config: dict) -> TaskHeads:
    """Nyströmformer's and YOSO's: the first token through dense, hidden_act and out_proj for sequences; for choices
    through pre_classifier, ReLU and classifier; token and question-answering heads as BERT's. No pooler."""
    return TaskHeads(SequenceHead("first", out="classifier.out_proj", dense="classifier.dense",
                                  dense_act=config.get("hidden_act", "gelu_new")),
                     multiple_choice=SequenceHead("first", dense="pre_classifier", dense_act="relu"))


# architectures whose head layout depends on their config: architecture -> TaskHeads from the config
CONFIGURED = {"deberta-v2": deberta_heads, "deberta": deberta_heads, "convbert": first_token_heads,
              "roformer": first_token_heads, "big_bird": first_token_heads, "nystromformer": first_token_heads_relu_choices,
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
    "gte": (ENCODER_HEADS, "pooler.dense"),
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
}


def _name(architecture) -> str:
    return getattr(architecture, "name", architecture)


class EncoderModel(EncoderForMaskedLM):
    """An encoder of the family without the masked-LM head; ``forward`` returns
    :class:`~vkformers.models.heads.BaseModelOutput`. Architectures not in :data:`DECLARED` have no pooler and no
    task heads here yet (their hidden states are the same)."""

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = True):
        super().__init__(config, architecture)
        prefix = base_model_prefix(self.spec.embeddings)
        if not prefix or self.spec.scattered_layers:
            raise UnsupportedBaseModel(f"{self.architecture_name}: its checkpoint has no base-model prefix to "
                                       "separate the encoder from its head; use AutoModelForMaskedLM")
        self.base_model_prefix = prefix
        for child in [name for name in self._modules if name != prefix]:  # the masked-LM head's modules
            del self._modules[child]
        _, pooler = DECLARED.get(self.architecture_name, (None, None))
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
    def task_heads(cls, config: dict, architecture) -> TaskHeads | None:
        name = _name(architecture)
        if name in CONFIGURED:
            return CONFIGURED[name](config)
        return DECLARED.get(name, (None, None))[0]

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_hidden_states=False):
        recorded = [] if output_hidden_states else None
        x = self.encode(input_ids, attention_mask, token_type_ids, hidden_states=recorded)
        pooled = F.tanh(self.pooler(x[:, 0])) if self.pooler is not None else None
        return BaseModelOutput(last_hidden_state=x, pooler_output=pooled,
                               hidden_states=tuple(recorded) if recorded is not None else None)
