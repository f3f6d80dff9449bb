"""The mixture-of-experts causal LM: the llama plugin's shared decoder, configured by this plugin's variants."""
from __future__ import annotations

from vkformers_llama.decoder import DecoderForCausalLM

from vkformers_moe.variants import decoder_spec


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """A causal decoder of any architecture in :data:`vkformers_moe.variants.VARIANTS`."""

    decoder_spec = staticmethod(decoder_spec)

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        # a composed layer may build inputs on the host from the position (Llama 4's chunk mask)
        self.capture_decode = self.capture_decode and all(getattr(layer, "capture_decode", True)
                                                          for layer in self.layers)
