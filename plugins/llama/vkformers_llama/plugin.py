"""Registers the dense causal decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_llama.architectures import ALIASES, ARCHITECTURES, STATUSES
from vkformers_llama.decoder import DecoderForCausalLM

plugin = FamilyPlugin("llama", ARCHITECTURES, ALIASES, Path(__file__).parent,
                      model_classes={"causal-lm": DecoderForCausalLM}, statuses=STATUSES)
