"""The pluggy hooks a family plugin implements to register itself with vkformers.

A plugin is a module (or object) exposed through the entry point group
``vkformers.plugins``; it implements any of the hooks below with ``@hookimpl``.
Core never imports a plugin: it only calls these hooks.
"""
from __future__ import annotations

import pluggy

PROJECT = "vkformers"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def vkformers_architectures():
    """Return a list of :class:`vkformers.models.registry.Architecture` this plugin provides.

    A :class:`vkformers.models.family.FamilyPlugin` answers it from the plugin's
    :class:`~vkformers.models.family.Family` declarations. A canonical name
    registered by two plugins is refused (``DuplicateArchitectureError``).
    """


@hookspec
def vkformers_aliases():
    """Return a dict mapping Hugging Face ``model_type`` spellings to canonical architecture names.

    A value may instead be a :class:`vkformers.models.registry.NestedConfig`
    (usually ``NESTED_TEXT_CONFIG``) for a wrapper whose backbone is named by a
    nested config, e.g. LLaVA's ``config["text_config"]["model_type"]``. The
    target may belong to another plugin; a spelling claimed twice is refused.
    """


@hookspec
def vkformers_kernel_dirs():
    """Return a list of :class:`vkformers.runtime.kernels.KernelDir`: the plugin's GLSL sources and compiled SPIR-V."""


@hookspec(firstresult=True)
def vkformers_model_class(architecture, task):
    """The Module class that runs ``architecture`` (a registry Architecture) for ``task``
    ("causal-lm", "masked-lm", "seq2seq-lm", or "base": the model without its LM head, which core's task heads
    in :mod:`vkformers.models.heads` sit on; see that module for what a base class declares), or None. Called as
    ``cls(config: dict, architecture)``."""


@hookspec
def vkformers_gguf_architectures():
    """Return a list of :class:`vkformers.models.gguf.GGUFArchitecture`: how a llama.cpp ``.gguf`` file of a
    ``general.architecture`` this plugin runs becomes a Hugging Face config and checkpoint (metadata keys to
    config keys, GGUF tensor names to HF names, and the tensor transforms llama.cpp's converter applied).

    A :class:`vkformers.models.family.FamilyPlugin` answers it from ``Family.gguf(...)`` declarations. One
    GGUF name may have several entries (llama with experts is Mixtral): the first whose ``applies`` holds wins.
    """
