"""transformers' ProphetNetForCausalLM: ProphetNet's decoder alone (``prophetnet.word_embeddings``,
``prophetnet.decoder...`` and ``lm_head``), as ``AutoModelForCausalLM`` loads a ``prophetnet`` checkpoint.

``model(input_ids, attention_mask=None, labels=None, encoder_hidden_states=None, encoder_attention_mask=None)``
returns ``.logits`` [B, T, vocab], predicting stream 0's (token t's logits predict token t + 1), and with labels
the n-gram loss of the seq2seq model: labels are not shifted (labels[t] is the token after t, as transformers reads
them), every stream reads them, with eps label smoothing. ``attention_mask`` hides padded keys from every stream
(the main stream's keys); positions count from the first token whatever the padding, as transformers' do.
``encoder_hidden_states``: the decoder's cross-attention (add_cross_attention) attends to them; without them it is
skipped, as there.

``generate`` is the decoder-only loop (GenerationMixin): the prompt runs every stream into an empty cache, which
keeps the main stream's keys; each later step feeds one token and runs stream 0 over every stored key, its padding
included, as transformers' cached step does.
"""
from __future__ import annotations

import numpy as np

from vkformers.errors import InputError, VkformersError
from vkformers.models.generation import GenerationMixin
from vkformers.models.inputs import InputLimits, id_array
from vkformers.models.loading import CausalLMOutput

from vkformers_t5.base import _drop
from vkformers_t5.seq2seq import Seq2SeqForConditionalGeneration


class ProphetNetForCausalLM(GenerationMixin, Seq2SeqForConditionalGeneration):
    """The seq2seq model's decoder, shared table and head, its encoder left out."""

    capture_decode = False  # each step's n-gram masks and relative buckets are built on the host for its position
    needs_encoder = False

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        _drop(self, self.names["encoder"])
        object.__setattr__(self, "encoder", None)

    # -- what GenerationMixin reads

    @property
    def num_layers(self) -> int:
        return self.spec.decoder_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.decoder_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def max_position_embeddings(self) -> int:
        return self.decoder.max_length()

    def generation_positions(self, mask: np.ndarray, tokens: np.ndarray, prompt_length: int) -> np.ndarray:
        """0, 1, ... in every row, padded or not: the positions the decoder counts itself."""
        return np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.int64)

    def input_limits(self) -> InputLimits:
        return InputLimits(vocab_size=self.spec.vocab_size, max_length=self.decoder.max_length())

    def forward(self, input_ids, attention_mask=None, labels=None, encoder_hidden_states=None,
                encoder_attention_mask=None, position_ids=None, cache=None):
        """``position_ids``, where given (generate gives them), must be the positions the decoder counts: 0, 1, ...
        after the cache's tokens."""
        ids = id_array(input_ids)
        past = cache.position if cache is not None else 0
        if position_ids is not None and not np.array_equal(
                np.broadcast_to(id_array(position_ids), ids.shape), np.broadcast_to(past + np.arange(ids.shape[1]),
                                                                                    ids.shape)):
            raise InputError(f"{self.architecture_name}: the decoder counts its positions from the first token, "
                             "whatever the padding (transformers' ProphetNetForCausalLM reads no position_ids); "
                             "leave position_ids out")
        if encoder_hidden_states is not None and not self.spec.cross_attention:
            raise VkformersError(f"{self.architecture_name}: encoder_hidden_states need a decoder with cross-attention "
                                 "(add_cross_attention)")
        mask = None if attention_mask is None or past else id_array(attention_mask)  # a step ignores padding
        encoder_mask = None if encoder_attention_mask is None else id_array(encoder_attention_mask)
        if labels is None:
            return CausalLMOutput(logits=self.decode(ids, encoder_hidden_states, encoder_mask, cache=cache,
                                                     decoder_mask=mask))
        streams = self.decode(ids, encoder_hidden_states, encoder_mask, cache=cache, all_streams=True,
                              decoder_mask=mask)                                            # [B, n, T, V]
        return CausalLMOutput(logits=streams[:, 0], loss=self._ngram_loss(streams, id_array(labels)))
