"""Model architectures: the registry that family plugins fill in.

``registry().resolve(config)`` tells which architecture a Hugging Face
``config.json`` runs as; see :mod:`vkformers.models.registry`.
"""
from vkformers.models.family import Family, FamilyPlugin
from vkformers.models.plugins import kernel_dirs, plugin_manager, register_plugin, registry, unregister_plugin
from vkformers.models.registry import NESTED_TEXT_CONFIG, Alias, Architecture, NestedConfig, Registry

__all__ = [
    "NESTED_TEXT_CONFIG",
    "Alias",
    "Architecture",
    "Family",
    "FamilyPlugin",
    "NestedConfig",
    "Registry",
    "kernel_dirs",
    "plugin_manager",
    "register_plugin",
    "registry",
    "unregister_plugin",
]
