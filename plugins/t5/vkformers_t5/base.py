"""The encoder-decoders without their LM head: transformers' T5Model, BartModel, ... (``vkformers.AutoModel``).

``forward(input_ids, attention_mask=None, decoder_input_ids=None)`` returns the decoder's last hidden state and the
encoder's (``Seq2SeqModelOutput``); decoder_input_ids default, as in transformers' BART-likes, to the input shifted
right. Parameters keep the checkpoint's paths (``model.encoder...`` for BART, ``encoder...`` for T5). The BART-likes
declare transformers' sequence head: classification_head (dense, tanh, out_proj) on the decoder state of the last
eos token.
"""
from __future__ import annotations

from vkformers.errors import VkformersError
from vkformers.models.heads import Seq2SeqModelOutput, SequenceHead, TaskHeads, base_model_prefix

from vkformers_t5.seq2seq import Seq2SeqForConditionalGeneration, _ids


BART_HEADS = TaskHeads(SequenceHead("eos", out="classification_head.out_proj", dense="classification_head.dense",
                                    dense_act="tanh"), token=None, question_answering=None)
# architecture -> its task heads (transformers' XForSequenceClassification of the BART family)
DECLARED = {"bart": BART_HEADS, "mbart": BART_HEADS}


class Seq2SeqModel(Seq2SeqForConditionalGeneration):
    """An encoder-decoder of the family without the LM head."""

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = False):
        super().__init__(config, architecture)
        head = self.names["lm_head"]
        *parents, leaf = head.split(".")
        node = self
        for part in parents:
            node = node._modules[part]
        del node._modules[leaf]
        self.base_model_prefix = base_model_prefix(self.names["encoder"])

    @classmethod
    def task_heads(cls, config: dict, architecture) -> TaskHeads | None:
        return DECLARED.get(getattr(architecture, "name", architecture))

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, output_hidden_states=False):
        if output_hidden_states:
            raise VkformersError(f"{self.architecture_name}: output_hidden_states is not implemented for "
                                 "encoder-decoders; last_hidden_state and encoder_last_hidden_state are returned")
        ids = _ids(input_ids)
        mask = None if attention_mask is None else _ids(attention_mask)
        encoder_states = self.encode(ids, mask)
        x = self.decoder_hidden_states(self.decoder_inputs(ids, decoder_input_ids), encoder_states, mask)
        return Seq2SeqModelOutput(last_hidden_state=x, encoder_last_hidden_state=encoder_states)
