"""The dense causal LM: the decoder kit's model, configured by this plugin's variants."""
from __future__ import annotations

from vkformers.models.decoder import DecoderForCausalLM

from vkformers_llama.variants import decoder_spec


class DenseDecoderForCausalLM(DecoderForCausalLM):
    """A dense causal decoder of any architecture in :data:`vkformers_llama.variants.VARIANTS`."""

    decoder_spec = staticmethod(decoder_spec)
