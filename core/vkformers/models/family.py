"""A family plugin declared as data: each architecture once, next to the variant function that builds it.

A plugin makes one :class:`Family` and declares every architecture on its variant function::

    FAMILY = Family("llama", kind="causal-decoder")
    architecture = FAMILY.architecture

    @architecture("mistral", norm="rms", llama_layout=True, status="verified",
                  notes="native KV-cache generation",
                  aliases=["mistral3"])
    def mistral(config: dict) -> DecoderSpec:
        ...

From those declarations come the registry rows, the alias table, the verification statuses (what the
plugin's parity tests prove; ``tests/test_verified_claims*.py`` check each claim against a fixture), the
``variants()`` table the plugin's model looks a name up in, and the model class of an architecture that
needs its own. Spellings whose backbone is named by a nested config (multimodal wrappers) are declared with
:meth:`Family.wrappers`. The plugin's entry point is then::

    plugin = FamilyPlugin(FAMILY, Path(__file__).parent, model_classes={"causal-lm": DecoderForCausalLM})

which registers all of it and the plugin's kernels (GLSL in ``<distribution>/shaders/``, SPIR-V in
``<package>/_spirv/``) through the hooks of :mod:`vkformers.models.hookspecs`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from vkformers.errors import ArchitectureDeclarationError, DuplicateArchitectureError
from vkformers.models.gguf import GGUFArchitecture
from vkformers.models.hookspecs import hookimpl
from vkformers.models.registry import KINDS, STATUSES, TASKS_BY_KIND, AliasTarget, Architecture, NestedConfig
from vkformers.runtime.kernels import KernelDir

# A model class, or where to find it as "package.module:ClassName" (the entry point syntax): a class that
# subclasses the plugin's shared model usually lives in a module that imports the variants, so the
# declaration beside the variant can only name it.
ModelClass = type | str


@dataclass(frozen=True)
class Declaration:
    """What one ``Family.architecture(...)`` call declares."""

    architecture: Architecture
    variant: Callable
    aliases: tuple[str, ...]
    model_class: ModelClass | Mapping[str, ModelClass] | None


class Family:
    """Every architecture one plugin provides, each declared once (see the module docstring).

    ``kind``, ``norm``, ``moe`` and ``llama_layout`` given here are the defaults of the family's
    declarations; a declaration may override any of them.
    """

    def __init__(self, name: str, *, kind: str, norm: str | None = None, moe: bool = False,
                 llama_layout: bool = False) -> None:
        self.name = name
        self._defaults = dict(kind=kind, norm=norm, moe=moe, llama_layout=llama_layout)
        self._declarations: dict[str, Declaration] = {}
        self._wrappers: dict[str, NestedConfig] = {}
        self._gguf: list[GGUFArchitecture] = []

    def architecture(self, name: str, *, kind: str | None = None, norm: str | None = None,
                     moe: bool | None = None, llama_layout: bool | None = None, notes: str = "",
                     aliases: Iterable[str] = (), status: str = "registered",
                     model_class: ModelClass | Mapping[str, ModelClass] | None = None,
                     variant: Callable | None = None):
        """Declare the canonical architecture ``name`` (its Hugging Face ``model_type``).

        Used as a decorator on its variant function (several may stack on one function), or called with
        ``variant=`` for a variant that is not a named function. ``aliases``: other spellings that run as
        it. ``status``: how far the plugin's tests prove it, one of ``STATUSES``; a claim ("verified",
        "forward-verified") needs a fixture the parity tests run. ``model_class``: the class that runs it
        when not the plugin's shared one (a class, or "package.module:ClassName"), or a mapping of tasks ("masked-lm",
        "base", ...) to such classes when it has its own class for each.
        """
        traits = dict(self._defaults)
        traits.update({key: value for key, value in dict(kind=kind, norm=norm, moe=moe,
                                                          llama_layout=llama_layout).items() if value is not None})
        if traits["norm"] is None:
            raise ArchitectureDeclarationError(f"plugin {self.name!r}: architecture {name!r} declares no norm and "
                                               f"the Family has no default; pass norm=\"rms\" or norm=\"layer\"")
        if status not in STATUSES:
            raise ArchitectureDeclarationError(f"plugin {self.name!r}: architecture {name!r} has status {status!r}; "
                                               f"use one of {', '.join(STATUSES)}")
        if traits["kind"] not in KINDS:
            raise ArchitectureDeclarationError(f"plugin {self.name!r}: architecture {name!r} has kind "
                                               f"{traits['kind']!r}; use one of {', '.join(KINDS)}")
        if name in self._declarations:
            raise DuplicateArchitectureError(f"plugin {self.name!r} declares architecture {name!r} twice; keep one")
        architecture = Architecture(
            name=name,
            family=self.name,
            kind=traits["kind"],
            tasks=TASKS_BY_KIND[traits["kind"]],
            traits=(("llama_layout", traits["llama_layout"]), ("moe", traits["moe"]), ("norm", traits["norm"])),
            notes=notes,
            status=status,
        )

        def declare(function: Callable) -> Callable:
            self._declarations[name] = Declaration(architecture, function, tuple(aliases), model_class)
            return function

        return declare(variant) if variant is not None else declare

    def wrappers(self, targets: Mapping[str, NestedConfig]) -> None:
        """Declare spellings whose backbone is the ``model_type`` of a nested config (``NESTED_TEXT_CONFIG``
        for most multimodal wrappers); they run as whatever architecture that names, in any plugin."""
        for spelling, target in targets.items():
            if not isinstance(target, NestedConfig):
                raise ArchitectureDeclarationError(f"plugin {self.name!r}: wrapper {spelling!r} needs a NestedConfig; "
                                                   f"an alias of one architecture goes in that declaration's aliases")
            if spelling in self._wrappers:
                raise DuplicateArchitectureError(f"plugin {self.name!r} declares wrapper {spelling!r} twice; keep one")
            self._wrappers[spelling] = target

    def gguf(self, *entries: GGUFArchitecture) -> None:
        """Declare how llama.cpp ``.gguf`` files of the family's architectures are read (see
        :class:`vkformers.models.gguf.GGUFArchitecture`); the order is the order they are tried in."""
        for entry in entries:
            if not isinstance(entry, GGUFArchitecture):
                raise ArchitectureDeclarationError(f"plugin {self.name!r}: Family.gguf takes GGUFArchitecture "
                                                   f"entries, not {type(entry).__name__}")
            if entry.model_type not in self._declarations:
                raise ArchitectureDeclarationError(f"plugin {self.name!r}: GGUF architecture {entry.name!r} maps to "
                                                   f"{entry.model_type!r}, which the plugin does not declare")
            self._gguf.append(entry)

    # -- what the declarations give ----------------------------------------

    def gguf_architectures(self) -> list[GGUFArchitecture]:
        return list(self._gguf)

    def architectures(self) -> list[Architecture]:
        return [declaration.architecture for declaration in self._declarations.values()]

    def aliases(self) -> dict[str, AliasTarget]:
        """Every other spelling: each declaration's aliases, then the wrappers."""
        table: dict[str, AliasTarget] = {}
        for name, declaration in self._declarations.items():
            for spelling in declaration.aliases:
                if spelling in table:
                    raise DuplicateArchitectureError(f"plugin {self.name!r} declares alias {spelling!r} twice "
                                                     f"(the second time on {name!r}); keep one")
                table[spelling] = name
        for spelling, target in self._wrappers.items():
            if spelling in table:
                raise DuplicateArchitectureError(f"plugin {self.name!r} declares {spelling!r} both as an alias "
                                                 f"and as a wrapper; keep one")
            table[spelling] = target
        return table

    def statuses(self) -> dict[str, str]:
        """Name -> status, for the architectures whose tests prove more than "registered"."""
        return {name: d.architecture.status for name, d in self._declarations.items()
                if d.architecture.status != "registered"}

    def variants(self) -> dict[str, Callable]:
        """Canonical name -> its variant function."""
        return {name: declaration.variant for name, declaration in self._declarations.items()}

    def model_class(self, name: str) -> type | Mapping[str, ModelClass] | None:
        """The class declared for architecture ``name`` (or its mapping of tasks to classes), or None when it runs
        on the plugin's shared one."""
        declaration = self._declarations.get(name)
        if declaration is None or declaration.model_class is None:
            return None
        if isinstance(declaration.model_class, Mapping):
            return dict(declaration.model_class)
        return load_object(declaration.model_class)


def load_object(reference: ModelClass) -> Any:
    """``reference`` itself, or the object a "package.module:Name" string names."""
    if not isinstance(reference, str):
        return reference
    module_name, _, attribute = reference.partition(":")
    if not attribute:
        raise ArchitectureDeclarationError(f"model class {reference!r} is not of the form 'package.module:ClassName'")
    return getattr(importlib.import_module(module_name), attribute)


class FamilyPlugin:
    """The hooks of one family plugin, answered from its :class:`Family` declarations.

    ``model_classes`` maps a task ("causal-lm", ...) to the plugin's shared model class, which serves every
    architecture of the family (configured by its name) unless its declaration names another.
    """

    def __init__(self, family: Family, package_dir: Path, model_classes: Mapping[str, ModelClass] | None = None):
        self.declarations = family
        self.family = family.name
        self.model_classes = dict(model_classes or {})
        self.package_dir = Path(package_dir)

    @hookimpl
    def vkformers_architectures(self):
        return self.declarations.architectures()

    @hookimpl
    def vkformers_aliases(self):
        return self.declarations.aliases()

    @hookimpl
    def vkformers_model_class(self, architecture, task):
        if architecture.family != self.family:
            return None
        declared = self.declarations.model_class(architecture.name)
        if isinstance(declared, dict):  # its own class per task; a task it does not name has none
            return load_object(declared[task]) if task in declared else None
        if declared is not None:  # its own class serves its own tasks; the shared one would run another model
            return declared if task in architecture.tasks else None
        shared = self.model_classes.get(task)
        return None if shared is None else load_object(shared)

    @hookimpl
    def vkformers_gguf_architectures(self):
        return self.declarations.gguf_architectures()

    @hookimpl
    def vkformers_kernel_dirs(self):
        source = self.package_dir.parent / "shaders"
        has_sources = source.is_dir() and any(source.glob("*.comp"))
        return [KernelDir(self.family, source if has_sources else None, self.package_dir / "_spirv")]
