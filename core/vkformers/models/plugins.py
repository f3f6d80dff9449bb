"""Finding the installed family plugins and building the registry from them.

Plugins are found through the ``vkformers.plugins`` entry point group (each
``vkformers-<family>`` distribution declares one). Tests and third parties can
also add a plugin object at run time with :func:`register_plugin`.
"""
from __future__ import annotations

import pluggy

from vkformers.models import hookspecs
from vkformers.runtime.kernels import add_kernel_dir_provider
from vkformers.models.registry import Registry

ENTRY_POINT_GROUP = "vkformers.plugins"

_plugin_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None


def new_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh plugin manager with the vkformers hooks (and the installed plugins)."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    if load_entry_points:
        manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return manager


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _plugin_manager
    if _plugin_manager is None:
        _plugin_manager = new_plugin_manager()
    return _plugin_manager


def registry() -> Registry:
    """The registry of every installed plugin, built on first use and cached."""
    global _registry
    if _registry is None:
        _registry = Registry(plugin_manager())
    return _registry


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Add a plugin (a module or object with ``@hookimpl`` methods); returns its name.

    ``name`` becomes the plugin's family name for the wrappers it declares.
    """
    global _registry
    manager = plugin_manager()
    registered_name = manager.register(plugin, name=name)
    try:
        # Build now so that a duplicate is reported here, by the call that caused it.
        _registry = Registry(manager)
    except Exception:
        manager.unregister(plugin)
        _registry = None
        raise
    return registered_name


def unregister_plugin(plugin: object) -> None:
    """Remove a plugin added with :func:`register_plugin`."""
    global _registry
    plugin_manager().unregister(plugin)
    _registry = None


def kernel_dirs() -> list:
    """Every plugin's kernel directories, as one flat list."""
    return [directory for dirs in plugin_manager().hook.vkformers_kernel_dirs() for directory in dirs]


# The runtime finds plugin kernels through this provider (it never imports plugins).
add_kernel_dir_provider(kernel_dirs)
