"""The decoders without their LM head: transformers' LlamaModel, Qwen2Model, GPT2Model, ... (``vkformers.AutoModel``),
and the base that core's task heads (``vkformers.models.heads``) sit on: sequence classification reads the last
token that is not the pad id, token classification every token (transformers' GenericFor* heads), and question
answering where transformers has it (GenericForQuestionAnswering: qa_outputs, the base under ``transformer.``
for Llama, Qwen2, ... as transformers keeps it for old checkpoints, under ``model.`` for Mistral).

Parameters keep the base-model prefix (``model.layers...``), as in transformers' task models.
"""
from __future__ import annotations

from dataclasses import replace

from vkformers.models.decoder.base import DecoderBaseMixin
from vkformers.models.heads import DECODER_HEADS, SequenceHead

from vkformers_llama.model import DenseDecoderForCausalLM

_QA = replace(DECODER_HEADS, question_answering="qa_outputs")
_QA_UNDER_TRANSFORMER = replace(_QA, base_prefixes=(("question-answering", "transformer"),))
# the GPT-2 generation of transformers' heads: the token head is classifier (with a bias), not score
_CLASSIFIER_TOKENS = replace(DECODER_HEADS, token="classifier")
# transformers' <X>ForQuestionAnswering (and token heads) of the family and where each keeps its base
DECLARED = {
    **dict.fromkeys(("arcee", "diffllama", "exaone4", "llama", "ministral", "nemotron", "qwen2", "qwen3", "seed_oss",
                     "smollm3"), _QA_UNDER_TRANSFORMER),
    **dict.fromkeys(("ministral3", "mistral"), _QA),
    # transformers has sequence and question-answering heads for these, no token-classification one
    **dict.fromkeys(("gptj", "opt"), replace(_QA, token=None)),
    **dict.fromkeys(("bloom", "falcon", "gpt2", "gpt_neo", "gpt_neox", "mpt"),
                    replace(_CLASSIFIER_TOKENS, question_answering="qa_outputs")),
    **dict.fromkeys(("biogpt", "gpt_bigcode"), _CLASSIFIER_TOKENS),
    # CTRL scores sequences with classifier (no bias) on the last non-pad token
    "ctrl": replace(DECODER_HEADS, sequence=SequenceHead("last", out="classifier", out_bias=False)),
}


class DecoderModel(DecoderBaseMixin, DenseDecoderForCausalLM):
    """A decoder of the family without the LM head."""

    declared_heads = DECLARED
