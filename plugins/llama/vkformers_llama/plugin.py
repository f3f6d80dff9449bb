"""Registers the dense causal decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_llama.architectures import ALIASES, ARCHITECTURES

plugin = FamilyPlugin("llama", ARCHITECTURES, ALIASES, Path(__file__).parent)
