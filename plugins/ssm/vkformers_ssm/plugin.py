"""Registers the state-space models with vkformers (entry point group ``vkformers.plugins``)."""
from pathlib import Path

from vkformers.models.family import FamilyPlugin

from vkformers_ssm.model import MambaForCausalLM
from vkformers_ssm.variants import FAMILY

plugin = FamilyPlugin(FAMILY, Path(__file__).parent, model_classes={"causal-lm": MambaForCausalLM})
