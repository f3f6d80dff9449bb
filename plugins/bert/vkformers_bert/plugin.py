"""Registers the bidirectional encoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_bert.base import EncoderModel
from vkformers_bert.encoder import EncoderForMaskedLM
from vkformers_bert.variants import FAMILY

# "cross-decoder": BERT with is_decoder and add_cross_attention (BertLMHeadModel), the decoder of an encoder-decoder
plugin = FamilyPlugin(FAMILY, Path(__file__).parent, model_classes={"masked-lm": EncoderForMaskedLM,
                                                                    "base": EncoderModel,
                                                                    "cross-decoder": EncoderForMaskedLM})
