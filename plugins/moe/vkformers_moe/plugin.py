"""Registers the mixture-of-experts causal decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_moe.architectures import ALIASES, ARCHITECTURES, STATUSES
from vkformers_moe.model import MoeDecoderForCausalLM

plugin = FamilyPlugin("moe", ARCHITECTURES, ALIASES, Path(__file__).parent,
                      model_classes={"causal-lm": MoeDecoderForCausalLM}, statuses=STATUSES)
