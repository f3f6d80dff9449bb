"""The architecture registry: which Hugging Face ``model_type`` runs as which architecture.

Core knows no architecture by itself. Each family plugin (``vkformers-llama``,
``vkformers-bert``, ...) returns :class:`Architecture` objects and an alias table
through the hooks in :mod:`vkformers.models.hookspecs`; :class:`Registry` collects
them, refuses duplicates and answers look-ups.

A plugin declares each architecture once, on its variant function, with
:class:`vkformers.models.family.Family`, so every plugin builds them the same way.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping, Union

from vkformers.errors import DuplicateArchitectureError, UnknownArchitectureError
from vkformers.models.known_families import KNOWN_FAMILIES

KINDS = ("causal-decoder", "encoder", "encoder-decoder")

# Default heads per kind; what a model of that kind is loaded for.
TASKS_BY_KIND = {
    "causal-decoder": ("causal-lm",),
    "encoder": ("masked-lm",),
    "encoder-decoder": ("seq2seq-lm",),
}

# How far an architecture is proven. Only tests may move an architecture up:
#   verified          forward and training step match Hugging Face in the test suite
#   forward-verified  forward logits match Hugging Face in the test suite
#   registered        declared by a plugin, nothing checked yet
STATUSES = ("verified", "forward-verified", "registered")


@dataclass(frozen=True)
class NestedConfig:
    """Alias target of a wrapper whose backbone is chosen by a nested config.

    ``path`` is the chain of keys from the root config to the sub-config whose
    ``model_type`` names the backbone, e.g. ``("text_config",)`` for LLaVA.
    """

    path: tuple[str, ...]
    # (key, value) pairs set on the nested config: what the wrapper's own head does differently from the text model's
    # (the lm_heads of Aya Vision and Granite Speech leave out their text model's logit scale)
    overrides: tuple[tuple[str, Any], ...] = ()
    # (regex, replacement) pairs applied in order to the wrapper file's tensor names before its language model's are
    # picked out, as transformers' conversion mapping for it renames them (Cosmos3-Omni: root-level layers.*)
    renames: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return "config" + "".join(f"[{key!r}]" for key in self.path) + "['model_type']"


NESTED_TEXT_CONFIG = NestedConfig(("text_config",))

AliasTarget = Union[str, NestedConfig]


@dataclass(frozen=True)
class Architecture:
    """One canonical architecture, as declared by the plugin that provides it."""

    name: str  # canonical Hugging Face model_type
    family: str  # plugin that provides it: "llama" is the distribution vkformers-llama
    kind: str  # one of KINDS
    tasks: tuple[str, ...]  # heads, e.g. ("causal-lm",)
    # Declared (not measured) traits as sorted (name, value) pairs, e.g. ("norm", "rms").
    # A tuple rather than a dict keeps the dataclass hashable.
    traits: tuple[tuple[str, Any], ...] = ()
    notes: str = ""
    status: str = "registered"  # one of STATUSES
    config_fields: tuple[str, ...] = ()  # config.json fields the loader reads

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.status not in STATUSES:
            raise ValueError(f"{self.name}: status {self.status!r} is not one of {STATUSES}")

    def trait(self, name: str, default: Any = None) -> Any:
        return dict(self.traits).get(name, default)


@dataclass(frozen=True)
class Alias:
    """A spelling that runs as another architecture."""

    spelling: str
    target: AliasTarget  # a canonical name, or a NestedConfig for wrappers
    family: str  # plugin that declared the alias

    @property
    def is_wrapper(self) -> bool:
        return isinstance(self.target, NestedConfig)


def install_hint(family: str) -> str:
    return f"pip install vkformers-{family}"


def _normalise(spelling: str) -> str:
    # HF spells some types with '-' and others with '_'; users mix them up.
    return spelling.replace("-", "_").lower()


class Registry:
    """Every architecture and alias that the installed plugins register."""

    def __init__(self, plugin_manager) -> None:
        self._architectures: dict[str, Architecture] = {}
        self._aliases: dict[str, Alias] = {}
        for plugin_name, architectures in _results_by_plugin(plugin_manager, "vkformers_architectures"):
            for architecture in architectures:
                self._add_architecture(architecture, plugin_name)
        for plugin_name, aliases in _results_by_plugin(plugin_manager, "vkformers_aliases"):
            for spelling, target in aliases.items():
                self._add_alias(spelling, target, plugin_name)
        self._check_alias_targets()
        self._by_normalised = self._normalised_index()

    # -- building -----------------------------------------------------------

    def _owner_of(self, spelling: str) -> str | None:
        if spelling in self._architectures:
            return self._architectures[spelling].family
        if spelling in self._aliases:
            return self._aliases[spelling].family
        return None

    def _add_architecture(self, architecture: Architecture, plugin_name: str) -> None:
        owner = self._owner_of(architecture.name)
        if owner is not None:
            raise DuplicateArchitectureError(
                f"model_type {architecture.name!r} is registered twice: by plugin {owner!r} "
                f"and by plugin {plugin_name!r} (family {architecture.family!r}); uninstall one of them"
            )
        self._architectures[architecture.name] = architecture

    def _add_alias(self, spelling: str, target: AliasTarget, plugin_name: str) -> None:
        owner = self._owner_of(spelling)
        if owner is not None:
            raise DuplicateArchitectureError(
                f"model_type {spelling!r} is registered twice: by plugin {owner!r} "
                f"and as an alias by plugin {plugin_name!r}; uninstall one of them"
            )
        if not isinstance(target, (str, NestedConfig)):
            raise TypeError(f"alias {spelling!r} from plugin {plugin_name!r}: target must be a str or NestedConfig")
        self._aliases[spelling] = Alias(spelling, target, plugin_name)

    def _check_alias_targets(self) -> None:
        # Checked after all plugins are read: an alias may point to another plugin's architecture.
        for alias in self._aliases.values():
            if not alias.is_wrapper and alias.target not in self._architectures:
                raise UnknownArchitectureError(
                    f"alias {alias.spelling!r} from plugin {alias.family!r} points to {alias.target!r}, "
                    f"which no installed plugin registers"
                    + _provider_hint(alias.target)
                )

    def _normalised_index(self) -> dict[str, str]:
        # Spellings that collide once normalised are left out: a guess would be ambiguous.
        index: dict[str, str] = {}
        ambiguous: set[str] = set()
        for spelling in self.spellings():
            key = _normalise(spelling)
            if key in index:
                ambiguous.add(key)
            index[key] = spelling
        return {key: spelling for key, spelling in index.items() if key not in ambiguous}

    # -- queries ------------------------------------------------------------

    def architectures(self) -> list[Architecture]:
        """Canonical architectures, sorted by family then name."""
        return sorted(self._architectures.values(), key=lambda a: (a.family, a.name))

    def aliases(self) -> list[Alias]:
        return sorted(self._aliases.values(), key=lambda a: a.spelling)

    def spellings(self) -> list[str]:
        """Every model_type accepted: canonical names and aliases."""
        return sorted([*self._architectures, *self._aliases])

    def families(self) -> list[str]:
        return sorted({a.family for a in self._architectures.values()} | {a.family for a in self._aliases.values()})

    def get(self, name: str) -> Architecture:
        """The canonical architecture called exactly ``name`` (no alias resolution)."""
        try:
            return self._architectures[name]
        except KeyError:
            raise self._unknown(name) from None

    def aliases_of(self, name: str) -> list[str]:
        """Spellings that resolve directly to the canonical ``name`` (wrappers excluded)."""
        self.get(name)  # raise for an unknown name rather than answering []
        return sorted(a.spelling for a in self._aliases.values() if a.target == name)

    def wrappers(self) -> list[Alias]:
        """Aliases whose backbone is named by a nested config."""
        return [a for a in self.aliases() if a.is_wrapper]

    def spelling(self, model_type: str) -> str:
        """The registered spelling ``model_type`` names: itself, or the one it matches ignoring case and -/_."""
        return self._find_spelling(model_type)

    def resolve(self, model_type_or_config: str | Mapping[str, Any]) -> Architecture:
        """The architecture a ``model_type`` string or a ``config.json`` dict runs as.

        The exact Hugging Face spelling is tried first, then a match that ignores
        case and ``-``/``_``. A wrapper (LLaVA-style) needs the config dict: its
        backbone is the nested config's ``model_type``.
        """
        if isinstance(model_type_or_config, Mapping):
            config = model_type_or_config
            model_type = config.get("model_type")
            if not isinstance(model_type, str):
                raise UnknownArchitectureError("config has no 'model_type' string; cannot pick an architecture")
        else:
            config, model_type = None, model_type_or_config

        spelling = self._find_spelling(model_type)
        if spelling in self._architectures:
            return self._architectures[spelling]
        alias = self._aliases[spelling]
        if not alias.is_wrapper:
            return self._architectures[alias.target]
        return self.resolve(self._nested_config(alias, config))

    def backbone_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The config the resolved architecture's model reads: ``config`` itself, or for a multimodal wrapper
        (an alias whose config nests its language model's, e.g. LLaVA, Gemma 3, Qwen2-VL) the nested text config,
        which names the backbone's own ``model_type``. Root fields are not copied, except ``tie_word_embeddings``: the
        wrapper's lm_head is tied or not by the root's flag in transformers 5 (the nested one's when the root has
        none, as 4.x wrote them). The alias's ``overrides`` are set last."""
        spelling = self._find_spelling(config.get("model_type"))
        if spelling in self._architectures:
            return config
        alias = self._aliases[spelling]
        if alias.is_wrapper:
            nested = self._nested_config(alias, config)
        elif isinstance(config.get("text_config"), Mapping) and "model_type" in config["text_config"]:
            nested = config["text_config"]
        else:
            return config
        if "tie_word_embeddings" in config:
            nested = {**nested, "tie_word_embeddings": config["tie_word_embeddings"]}
        if alias.is_wrapper and alias.target.overrides:
            nested = {**nested, **dict(alias.target.overrides)}
        return nested

    def checkpoint_renames(self, config: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
        """The declared renames of a wrapper's file names (NestedConfig.renames); () for any other config."""
        alias = self._aliases.get(self._find_spelling(config.get("model_type")))
        return alias.target.renames if alias is not None and alias.is_wrapper else ()

    def _find_spelling(self, model_type: str) -> str:
        if model_type in self._architectures or model_type in self._aliases:
            return model_type
        spelling = self._by_normalised.get(_normalise(model_type))
        if spelling is None:
            raise self._unknown(model_type)
        return spelling

    def _nested_config(self, wrapper: Alias, config: Mapping[str, Any] | None) -> Mapping[str, Any]:
        where = wrapper.target.describe()
        if config is None:
            raise UnknownArchitectureError(
                f"model_type {wrapper.spelling!r} is a wrapper whose backbone is {where}; "
                f"pass the config dict to resolve() instead of the bare model_type"
            )
        nested: Any = config
        for key in wrapper.target.path:
            nested = nested.get(key) if isinstance(nested, Mapping) else None
        if not isinstance(nested, Mapping) or "model_type" not in nested:
            raise UnknownArchitectureError(
                f"model_type {wrapper.spelling!r} is a wrapper whose backbone is {where}, "
                f"but the config does not have it"
            )
        return nested

    def _unknown(self, model_type: str) -> UnknownArchitectureError:
        family = KNOWN_FAMILIES.get(model_type)
        if family is not None and family not in self.families():
            return UnknownArchitectureError(
                f"model_type {model_type!r} is provided by the vkformers-{family} plugin, "
                f"which is not installed: {install_hint(family)}"
            )
        message = f"unknown model_type {model_type!r}."
        candidates = sorted(set(self.spellings()) | set(KNOWN_FAMILIES))
        close = difflib.get_close_matches(model_type, candidates, n=5, cutoff=0.6)
        if close:
            message += " Close matches: " + ", ".join(self._describe_match(m) for m in close) + "."
        else:
            message += f" Installed plugins: {', '.join(self.families()) or 'none'}."
        return UnknownArchitectureError(message)

    def _describe_match(self, spelling: str) -> str:
        family = self._owner_of(spelling) or KNOWN_FAMILIES[spelling]
        if family in self.families():
            return f"{spelling!r} (vkformers-{family})"
        return f"{spelling!r} (vkformers-{family}, not installed: {install_hint(family)})"


def _provider_hint(spelling: str) -> str:
    family = KNOWN_FAMILIES.get(spelling)
    return f" ({install_hint(family)})" if family else ""


def _results_by_plugin(plugin_manager, hook_name: str):
    """Yield (plugin name, result) for each plugin implementing ``hook_name``.

    Calling each implementation separately (instead of the pluggy hook, which
    merges results) lets a duplicate error name the plugins involved.
    """
    hook = getattr(plugin_manager.hook, hook_name)
    for impl in hook.get_hookimpls():
        result = impl.function()
        if result:
            yield impl.plugin_name, result
