"""Registers the bidirectional encoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_bert.base import EncoderModel
from vkformers_bert.encoder import EncoderForMaskedLM
from vkformers_bert.variants import FAMILY

plugin = FamilyPlugin(FAMILY, Path(__file__).parent, model_classes={"masked-lm": EncoderForMaskedLM,
                                                                    "base": EncoderModel})
