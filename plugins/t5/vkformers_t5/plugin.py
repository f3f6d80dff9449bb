"""Registers the encoder-decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_t5.architectures import ALIASES, ARCHITECTURES

plugin = FamilyPlugin("t5", ARCHITECTURES, ALIASES, Path(__file__).parent)
