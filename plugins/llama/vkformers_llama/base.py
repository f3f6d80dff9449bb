"""The decoders without their LM head: transformers' LlamaModel, Qwen2Model, GPT2Model, ... (``vkformers.AutoModel``),
and the base that core's task heads (``vkformers.models.heads``) sit on, for the spellings transformers has each head
for: sequence classification reads the last token that is not the pad id, token classification every token
(transformers' GenericFor* heads), and question answering (GenericForQuestionAnswering: qa_outputs, the base under
``transformer.`` for Llama, Qwen2, ... as transformers keeps it for old checkpoints, under ``model.`` for Mistral).

Parameters keep the base-model prefix (``model.layers...``), as in transformers' task models.
"""
from __future__ import annotations

from dataclasses import replace

from vkformers.models.decoder.base import DecoderBaseMixin
from vkformers.models.heads import DECODER_HEADS, DECODER_SEQUENCE, SequenceHead, TaskHeads

from vkformers_llama.model import DenseDecoderForCausalLM

_QA = replace(DECODER_HEADS, question_answering="qa_outputs")
_QA_UNDER_TRANSFORMER = replace(_QA, base_prefixes=(("question-answering", "transformer"),))
# the GPT-2 generation of transformers' heads: the token head is classifier (with a bias), not score
_CLASSIFIER_TOKENS = replace(DECODER_HEADS, token="classifier")
_SEQUENCE_ONLY = replace(DECODER_HEADS, token=None)


def _modernbert_decoder_heads(config: dict) -> TaskHeads:
    """ModernBERT-decoder's: its prediction head (head.dense, classifier_activation, head.norm) and the classifier on
    the last non-pad token (transformers runs them on every token, then picks that one: the same logits)."""
    bias = bool(config.get("classifier_bias", False))
    return TaskHeads(SequenceHead("last", out="classifier", out_bias=bias, dense="head.dense",
                                  dense_act=config.get("classifier_activation", "gelu"), dense_norm="head.norm",
                                  dense_bias=bias, norm_eps=config.get("norm_eps", 1e-5),
                                  norm_bias=bool(config.get("norm_bias", False))),
                     token=None, question_answering=None)


# spelling -> the heads transformers has for it (<X>ForSequenceClassification, ...), where each keeps its base;
# a spelling not listed (Cohere, Granite, EXAONE 3, an alias such as qwen2_vl, ...) has none in transformers, nor here
DECLARED = {
    **dict.fromkeys(("arcee", "diffllama", "exaone4", "llama", "ministral", "nemotron", "qwen2", "qwen3", "seed_oss",
                     "smollm3"), _QA_UNDER_TRANSFORMER),
    **dict.fromkeys(("ministral3", "mistral"), _QA),
    **dict.fromkeys(("gemma", "gemma2", "glm", "glm4", "helium", "persimmon", "phi", "phi3", "stablelm",
                     "starcoder2"), DECODER_HEADS),
    # sequence and question-answering heads, no token-classification one
    **dict.fromkeys(("gptj", "opt"), replace(_QA, token=None)),
    **dict.fromkeys(("bloom", "falcon", "gpt2", "gpt_neo", "gpt_neox", "mpt"),
                    replace(_CLASSIFIER_TOKENS, question_answering="qa_outputs")),
    **dict.fromkeys(("biogpt", "gpt-sw3", "gpt_bigcode"), _CLASSIFIER_TOKENS),  # GPT-SW3 runs GPT-2's classes
    **dict.fromkeys(("cohere_compass_text", "doge", "gemma3_text", "hunyuan_v1_dense", "minicpm3", "olmo", "olmo2",
                     "olmo3", "openai-gpt", "qwen3_5_text"), _SEQUENCE_ONLY),
    "apertus": TaskHeads(None, token="score", question_answering=None),  # a token head alone
    # CTRL scores sequences with classifier (no bias) on the last non-pad token
    "ctrl": replace(_SEQUENCE_ONLY, sequence=replace(DECODER_SEQUENCE, out="classifier")),
    "modernbert-decoder": _modernbert_decoder_heads,
}


class DecoderModel(DecoderBaseMixin, DenseDecoderForCausalLM):
    """A decoder of the family without the LM head."""

    declared_heads = DECLARED
