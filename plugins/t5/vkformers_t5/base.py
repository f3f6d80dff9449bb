"""The encoder-decoders without their LM head: transformers' T5Model, BartModel, ... (``vkformers.AutoModel``).

``forward(input_ids, attention_mask=None, decoder_input_ids=None)`` returns the decoder's last hidden state and the
encoder's (``Seq2SeqModelOutput``); decoder_input_ids default to the input shifted right, as transformers' BART-likes
and the task heads of both families take them. Parameters keep the checkpoint's paths (``model.encoder...`` for BART, ``encoder...`` for T5). The BART-likes
and T5 declare transformers' sequence head, classification_head (dense, tanh, out_proj) on the decoder state of
the last eos token, and the question-answering head qa_outputs on the decoder states; the T5s also the token head,
classifier on the states of the encoder alone (:class:`Seq2SeqEncoderModel`, transformers' T5EncoderModel).
"""
from __future__ import annotations

from dataclasses import replace

from vkformers.errors import VkformersError
from vkformers.models.heads import BaseModelOutput, Seq2SeqModelOutput, SequenceHead, TaskHeads, base_model_prefix
from vkformers.models.inputs import id_array

from vkformers_t5.seq2seq import Seq2SeqForConditionalGeneration


_EOS_HEAD = SequenceHead("eos", out="classification_head.out_proj", dense="classification_head.dense",
                         dense_act="tanh")
BART_HEADS = TaskHeads(_EOS_HEAD, token=None, question_answering="qa_outputs")


def _drop(model, path: str) -> None:
    """Remove the submodule at dotted ``path`` (an LM head or a stack the model does not run)."""
    *parents, leaf = path.split(".")
    node = model
    for part in parents:
        node = node._modules[part]
    del node._modules[leaf]


class Seq2SeqModel(Seq2SeqForConditionalGeneration):
    """An encoder-decoder of the family without the LM head."""

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = False):
        super().__init__(config, architecture)
        _drop(self, self.names["lm_head"])
        self.base_model_prefix = base_model_prefix(self.names["encoder"])

    @classmethod
    def task_heads(cls, config: dict, spelling: str) -> TaskHeads | None:
        return DECLARED.get(spelling)

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, output_hidden_states=False,
                global_attention_mask=None):
        ids = id_array(input_ids)
        mask = None if attention_mask is None else id_array(attention_mask)
        if output_hidden_states and self.spec.global_tokens:
            raise VkformersError(f"{self.architecture_name}: output_hidden_states is not implemented with global "
                                 "tokens; last_hidden_state and encoder_last_hidden_state are returned without it")
        stacks = (self.encoder, self.decoder)
        for stack in stacks:
            stack.recorded = [] if output_hidden_states else None
        try:
            encoder_states = self.encode(ids, mask, global_attention_mask)
            if decoder_input_ids is None:  # the input shifted right, as transformers' task heads (T5's too) take it
                decoder_input_ids = self.shift_right(ids)
            x = self.decoder_hidden_states(self.decoder_inputs(ids, decoder_input_ids), encoder_states, mask)
        finally:
            (encoder_hidden, decoder_hidden), self.encoder.recorded, self.decoder.recorded = \
                (tuple(s.recorded) if s.recorded is not None else None for s in stacks), None, None
        return Seq2SeqModelOutput(last_hidden_state=x, encoder_last_hidden_state=encoder_states,
                                  decoder_hidden_states=decoder_hidden, encoder_hidden_states=encoder_hidden)


class Seq2SeqEncoderModel(Seq2SeqModel):
    """The encoder alone (transformers' T5EncoderModel): what T5ForTokenClassification runs, its parameters the
    shared embedding and the encoder's."""

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = False):
        super().__init__(config, architecture)
        _drop(self, self.names["decoder"])

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        if output_hidden_states and self.spec.global_tokens:
            raise VkformersError(f"{self.architecture_name}: output_hidden_states is not implemented with global "
                                 "tokens")
        self.encoder.recorded = [] if output_hidden_states else None
        try:
            x = self.encode(input_ids, attention_mask)
        finally:
            recorded, self.encoder.recorded = self.encoder.recorded, None
        return BaseModelOutput(last_hidden_state=x, hidden_states=tuple(recorded) if recorded is not None else None)


# T5ForSequenceClassification holds its T5Model under "transformer."; T5ForQuestionAnswering holds it bare;
# T5ForTokenClassification holds a T5EncoderModel under "transformer." (mT5 and UMT5 alike)
T5_HEADS = TaskHeads(_EOS_HEAD, token="classifier", question_answering="qa_outputs",
                     base_prefixes=(("sequence-classification", "transformer"), ("token-classification", "transformer")),
                     base_classes=(("token-classification", Seq2SeqEncoderModel),))
# spelling -> its task heads (transformers' XForSequenceClassification / XForQuestionAnswering / ...)
DECLARED = {"bart": BART_HEADS, "mbart": BART_HEADS, "mvp": BART_HEADS, "plbart": replace(BART_HEADS, question_answering=None),
            "t5": T5_HEADS, "mt5": T5_HEADS, "umt5": T5_HEADS}
