"""Registers the bidirectional encoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_bert.architectures import ALIASES, ARCHITECTURES, STATUSES
from vkformers_bert.encoder import EncoderForMaskedLM

plugin = FamilyPlugin("bert", ARCHITECTURES, ALIASES, Path(__file__).parent,
                      model_classes={"masked-lm": EncoderForMaskedLM}, statuses=STATUSES)
