"""A family plugin declared as data: what a plugin's entry point usually exposes.

    plugin = FamilyPlugin("llama", ARCHITECTURES, ALIASES, Path(__file__).parent)

registers the architecture table, the alias map and the plugin's kernels
(GLSL in ``<distribution>/shaders/``, SPIR-V in ``<package>/_spirv/``).
"""
from __future__ import annotations

from pathlib import Path

from vkformers.models.hookspecs import hookimpl
from vkformers.models.registry import architectures_from_table
from vkformers.runtime.kernels import KernelDir


class FamilyPlugin:
    def __init__(self, family: str, architectures, aliases, package_dir: Path):
        self.family = family
        self.table = architectures
        self.aliases = aliases
        self.package_dir = Path(package_dir)

    @hookimpl
    def vkformers_architectures(self):
        return architectures_from_table(self.family, self.table)

    @hookimpl
    def vkformers_aliases(self):
        return self.aliases

    @hookimpl
    def vkformers_kernel_dirs(self):
        source = self.package_dir.parent / "shaders"
        has_sources = source.is_dir() and any(source.glob("*.comp"))
        return [KernelDir(self.family, source if has_sources else None, self.package_dir / "_spirv")]
