"""The mixture-of-experts causal LM: the llama plugin's shared decoder, configured by this plugin's variants."""
from __future__ import annotations

from vkformers_llama.decoder import DecoderForCausalLM

from vkformers_moe.variants import decoder_spec


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """A causal decoder of any architecture in :data:`vkformers_moe.variants.VARIANTS`."""

    decoder_spec = staticmethod(decoder_spec)
