"""The encoder-decoders without their LM head: transformers' T5Model, BartModel, ... (``vkformers.AutoModel``).

``forward(input_ids, attention_mask=None, decoder_input_ids=None)`` returns the decoder's last hidden state and the
encoder's (``Seq2SeqModelOutput``); decoder_input_ids default to the input shifted right, as transformers' BART-likes
and the task heads of both families take them. Parameters keep the checkpoint's paths (``model.encoder...`` for BART, ``encoder...`` for T5). The BART-likes
and T5 declare transformers' sequence head, classification_head (dense, tanh, out_proj) on the decoder state of
the last eos token, and the question-answering head qa_outputs on the decoder states.
"""
from __future__ import annotations

from vkformers.errors import VkformersError
from vkformers.models.heads import Seq2SeqModelOutput, SequenceHead, TaskHeads, base_model_prefix

from vkformers_t5.seq2seq import Seq2SeqForConditionalGeneration, _ids


_EOS_HEAD = SequenceHead("eos", out="classification_head.out_proj", dense="classification_head.dense",
                         dense_act="tanh")
BART_HEADS = TaskHeads(_EOS_HEAD, token=None, question_answering="qa_outputs")
# T5ForSequenceClassification holds its T5Model under "transformer."; T5ForQuestionAnswering holds it bare.
# (T5ForTokenClassification runs the encoder alone: not declared.)
T5_HEADS = TaskHeads(_EOS_HEAD, token=None, question_answering="qa_outputs",
                     base_prefixes=(("sequence-classification", "transformer"),))
# architecture -> its task heads (transformers' XForSequenceClassification / XForQuestionAnswering)
DECLARED = {"bart": BART_HEADS, "mbart": BART_HEADS, "t5": T5_HEADS, "mt5": T5_HEADS, "umt5": T5_HEADS}


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

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, output_hidden_states=False,
                global_attention_mask=None):
        ids = _ids(input_ids)
        mask = None if attention_mask is None else _ids(attention_mask)
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
