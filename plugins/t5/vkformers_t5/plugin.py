"""Registers the encoder-decoders with vkformers (entry point group ``vkformers.plugins``)."""
from vkformers.models.hookspecs import hookimpl
from vkformers.models.registry import architectures_from_table

from vkformers_t5.architectures import ALIASES, ARCHITECTURES

FAMILY = "t5"


@hookimpl
def vkformers_architectures():
    return architectures_from_table(FAMILY, ARCHITECTURES)


@hookimpl
def vkformers_aliases():
    return ALIASES


@hookimpl
def vkformers_kernel_dirs():
    return []  # family kernels will live in plugins/t5/shaders/
