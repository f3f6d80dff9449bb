"""Registers the mixture-of-experts causal decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_moe.architectures import ALIASES, ARCHITECTURES

plugin = FamilyPlugin("moe", ARCHITECTURES, ALIASES, Path(__file__).parent)
