"""The mixture-of-experts decoders without their LM head: transformers' MixtralModel, Qwen2MoeModel, ...
(``vkformers.AutoModel``), and the base of core's task heads (transformers' GenericFor* heads: sequence
classification on the last non-pad token, token classification, and question answering where transformers has
it, under the prefix it keeps). The router's auxiliary loss is not added, as transformers' heads add none."""
from __future__ import annotations

from dataclasses import replace

from vkformers.models.decoder.base import DecoderBaseMixin
from vkformers.models.heads import DECODER_HEADS

from vkformers_moe.model import MoeDecoderForCausalLM

_QA = replace(DECODER_HEADS, question_answering="qa_outputs")
# transformers' <X>ForQuestionAnswering of the family and where each keeps its base
QUESTION_ANSWERING = {
    **dict.fromkeys(("qwen3_moe", "qwen3_next"), replace(_QA, base_prefixes=(("question-answering", "transformer"),))),
    **dict.fromkeys(("mixtral", "qwen2_moe"), _QA),
}


class MoeDecoderModel(DecoderBaseMixin, MoeDecoderForCausalLM):
    """A mixture-of-experts decoder of the family without the LM head."""

    declared_heads = QUESTION_ANSWERING
