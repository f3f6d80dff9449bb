"""Registers the dense causal decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_llama.base import DecoderModel
from vkformers_llama.gguf_tables import FAMILY  # the variants, with their GGUF mappings declared
from vkformers_llama.model import DenseDecoderForCausalLM

# "cross-decoder": a decoder with add_cross_attention (GPT-2), the decoder of an encoder-decoder
plugin = FamilyPlugin(FAMILY, Path(__file__).parent, model_classes={"causal-lm": DenseDecoderForCausalLM,
                                                                    "base": DecoderModel,
                                                                    "cross-decoder": DenseDecoderForCausalLM})
