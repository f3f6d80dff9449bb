"""The mixture-of-experts causal LM: the llama plugin's shared decoder, configured by this plugin's variants."""
from __future__ import annotations

from collections import ChainMap

import numpy as np
from vkformers_llama.decoder import DecoderForCausalLM

from vkformers_moe.variants import decoder_spec


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """A causal decoder of any architecture in :data:`vkformers_moe.variants.VARIANTS`. An architecture whose
    residual stream is not one hidden state (DeepSeek-V4's streams) declares its own subclass as its
    ``model_class``."""

    decoder_spec = staticmethod(decoder_spec)

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        # a composed layer may build inputs on the host from the position (Llama 4's chunk mask)
        self.capture_decode = self.capture_decode and all(getattr(layer, "capture_decode", True)
                                                          for layer in self.layers)

    @property
    def num_layers(self) -> int:
        """KV-cache slots: one per layer, or what a composed layer asks for (LongCat: two)."""
        return sum(getattr(layer, "cache_slots", 1) for layer in self.layers)

    def load_state_dict(self, arrays, *args, **kwargs):
        # weights a block declares but never runs (LongCat's identity experts): zeros when the checkpoint lacks them
        zeros = {f"{path}.{name}": np.zeros((module.moe.expert_size, module.hidden), np.float32)
                 for path, module in self.named_modules() for name in getattr(module, "unused_weights", ())}
        super().load_state_dict(ChainMap(arrays, {n: z for n, z in zeros.items() if n not in arrays}), *args, **kwargs)
