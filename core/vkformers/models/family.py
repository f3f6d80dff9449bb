"""A family plugin declared as data: what a plugin's entry point usually exposes.

    plugin = FamilyPlugin("llama", ARCHITECTURES, ALIASES, Path(__file__).parent,
                          model_classes={"causal-lm": DecoderForCausalLM}, statuses=STATUSES)

registers the architecture table, the alias map, the verification statuses its tests
prove (the rest stay "registered"), the model classes (one class per
task serves every architecture of the family, configured by its name) and the
plugin's kernels (GLSL in ``<distribution>/shaders/``, SPIR-V in ``<package>/_spirv/``).
"""
from __future__ import annotations

from pathlib import Path

from vkformers.models.hookspecs import hookimpl
from vkformers.models.registry import architectures_from_table
from vkformers.runtime.kernels import KernelDir


class FamilyPlugin:
    def __init__(self, family: str, architectures, aliases, package_dir: Path, model_classes=None, statuses=None):
        self.family = family
        self.statuses = dict(statuses or {})  # name -> "verified" / "forward-verified" (proven by its tests)
        self.model_classes = dict(model_classes or {})
        self.table = architectures
        self.aliases = aliases
        self.package_dir = Path(package_dir)

    @hookimpl
    def vkformers_architectures(self):
        return architectures_from_table(self.family, self.table, self.statuses)

    @hookimpl
    def vkformers_aliases(self):
        return self.aliases

    @hookimpl
    def vkformers_model_class(self, architecture, task):
        if architecture.family != self.family:
            return None
        return self.model_classes.get(task)

    @hookimpl
    def vkformers_kernel_dirs(self):
        source = self.package_dir.parent / "shaders"
        has_sources = source.is_dir() and any(source.glob("*.comp"))
        return [KernelDir(self.family, source if has_sources else None, self.package_dir / "_spirv")]
