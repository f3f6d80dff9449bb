"""Registers the mixture-of-experts causal decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_moe.base import MoeDecoderModel
from vkformers_moe.model import MoeDecoderForCausalLM
from vkformers_moe.gguf_tables import FAMILY  # the variants, with their GGUF mappings declared

plugin = FamilyPlugin(FAMILY, Path(__file__).parent, model_classes={"causal-lm": MoeDecoderForCausalLM,
                                                                    "base": MoeDecoderModel})
