"""Registers the encoder-decoders with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_t5.base import Seq2SeqModel
from vkformers_t5.seq2seq import Seq2SeqForConditionalGeneration
from vkformers_t5.variants import FAMILY

plugin = FamilyPlugin(FAMILY, Path(__file__).parent, model_classes={"seq2seq-lm": Seq2SeqForConditionalGeneration,
                                                                    "base": Seq2SeqModel})
