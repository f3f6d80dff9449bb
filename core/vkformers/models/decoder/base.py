"""A decoder without its LM head (transformers' LlamaModel, MixtralModel, ...): what ``vkformers.AutoModel`` and
the task heads of ``vkformers.models.heads`` run. A plugin makes its base class from its causal LM class::

    class DecoderModel(DecoderBaseMixin, DenseDecoderForCausalLM):
        declared_heads = {...}      # model_type spelling -> its TaskHeads (those transformers has)

Parameters keep the base-model prefix (``model.layers...``), as in transformers' task models.
"""
from __future__ import annotations

from vkformers.errors import VkformersError
from vkformers.models.heads import BaseModelOutput, TaskHeads, base_model_prefix


class UnsupportedBaseModel(VkformersError, ValueError):
    """A decoder whose checkpoint layout does not separate the base model from its LM head."""


class DecoderBaseMixin:
    """Before a :class:`~vkformers.models.decoder.DecoderForCausalLM` subclass in the bases: drops the LM head,
    ``forward`` returns :class:`~vkformers.models.heads.BaseModelOutput` (``last_hidden_state`` after the final
    norm, ``hidden_states`` with ``output_hidden_states=True``)."""

    # model_type spelling -> TaskHeads (or a function of the config giving them): the heads transformers has for
    # that spelling; a spelling not listed has none
    declared_heads: dict = {}

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = False):
        super().__init__(config, architecture)
        prefix = base_model_prefix(self.spec.embed)
        if not prefix or base_model_prefix(self.spec.lm_head) == prefix:
            raise UnsupportedBaseModel(f"{self.architecture_name}: its checkpoint has no base-model prefix to "
                                       "separate the decoder from its LM head; use AutoModelForCausalLM")
        self.base_model_prefix = prefix
        # the last hidden state's width: OPT's project_out maps the hidden size back to the embedding width
        self.output_size = self.spec.embed_dim if self.spec.project_out else self.spec.hidden_size
        for child in [name for name in self._modules if name != prefix]:  # the LM head (and its transform)
            del self._modules[child]

    @classmethod
    def task_heads(cls, config: dict, spelling: str) -> TaskHeads | None:
        heads = cls.declared_heads.get(spelling)
        return heads(config) if callable(heads) else heads

    def forward(self, input_ids, attention_mask=None, position_ids=None, output_hidden_states=False):
        x, recorded = self.recorded_stream(output_hidden_states,
                                           lambda: self.residual_stream(input_ids, attention_mask, position_ids))
        x = self.final_hidden_states(x)
        if recorded is not None:
            recorded[-1] = x  # transformers' last hidden state is the normed one
        return BaseModelOutput(last_hidden_state=x, hidden_states=tuple(recorded) if recorded is not None else None)
