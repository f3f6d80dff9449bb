"""The mixture-of-experts decoders without their LM head: transformers' MixtralModel, Qwen2MoeModel, ...
(``vkformers.AutoModel``), and the base of core's task heads for the spellings transformers has each head for
(its GenericFor* heads: sequence classification on the last non-pad token, token classification, question
answering, under the prefix it keeps). The router's auxiliary loss is not added, as transformers' heads add none."""
from __future__ import annotations

from dataclasses import replace

from vkformers.models.decoder.base import DecoderBaseMixin
from vkformers.models.heads import DECODER_HEADS

from vkformers_moe.model import MoeDecoderForCausalLM

_QA = replace(DECODER_HEADS, question_answering="qa_outputs")
# spelling -> the heads transformers has for it (<X>ForSequenceClassification, ...), where each keeps its base;
# a spelling not listed (DBRX, OLMoE, Granite-MoE, ...) has none in transformers, nor here
DECLARED = {
    **dict.fromkeys(("qwen3_moe", "qwen3_next"), replace(_QA, base_prefixes=(("question-answering", "transformer"),))),
    **dict.fromkeys(("mixtral", "qwen2_moe"), _QA),
    **dict.fromkeys(("axk1", "axk2", "deepseek_v3", "gpt_oss", "mistral4"), DECODER_HEADS),
    **dict.fromkeys(("deepseek_v2", "hunyuan_v1_moe", "jetmoe", "phimoe"), replace(DECODER_HEADS, token=None)),
}


class MoeDecoderModel(DecoderBaseMixin, MoeDecoderForCausalLM):
    """A mixture-of-experts decoder of the family without the LM head."""

    declared_heads = DECLARED
