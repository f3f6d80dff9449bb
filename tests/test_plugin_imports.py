"""How the bundled plugins may import each other, read from their sources with ``ast`` (no plugin is imported).

- A plugin never imports another plugin's underscore names (nor a module of it whose name starts with one).
- vkformers-llama imports no other plugin, not even inside a function.
- A plugin that imports another declares that distribution in its pyproject.toml dependencies.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"

# A string that is a whole dotted reference into a package ("pkg.module:Name", as model_class takes): an import too.
REFERENCE = re.compile(r"^(?P<module>vkformers_\w+(?:\.\w+)*)(?::(?P<name>\w+))?$")


@dataclass(frozen=True)
class PluginImport:
    """One name (or whole module) a source file takes from a package."""

    file: str
    line: int
    module: str           # dotted module path, e.g. "vkformers_llama.decoder"
    name: str | None      # the imported name, or None for the module itself

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    @property
    def private_parts(self) -> list[str]:
        parts = self.module.split(".")[1:] + ([self.name] if self.name else [])
        return [part for part in parts if part.startswith("_") and not part.startswith("__")]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.module}" + (f" import {self.name}" if self.name else "")


def imports_of(source: str, file: str = "<source>") -> list[PluginImport]:
    """Every absolute import in ``source``, at any depth (functions, try blocks), plus whole-string references."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [PluginImport(file, node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [PluginImport(file, node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (match := REFERENCE.match(node.value)):
            found.append(PluginImport(file, node.lineno, match["module"], match["name"]))
    return sorted(found, key=lambda imp: imp.line)  # ast.walk goes breadth first


def plugin_packages() -> dict[str, Path]:
    """Top-level package name -> its distribution's folder, for every bundled plugin."""
    return {package.name: package.parent for package in sorted(PLUGINS.glob("*/vkformers_*"))
            if (package / "__init__.py").is_file()}


def cross_plugin_imports() -> list[tuple[str, PluginImport]]:
    """(importing package, import) for each import of another plugin's package in a plugin's sources."""
    packages = plugin_packages()
    found = []
    for package, distribution in packages.items():
        for path in sorted((distribution / package).rglob("*.py")):
            file = str(path.relative_to(PLUGINS.parent))
            found += [(package, imp) for imp in imports_of(path.read_text(), file)
                      if imp.package in packages and imp.package != package]
    return found


def private_imports(found) -> list[PluginImport]:
    return [imp for _, imp in found if imp.private_parts]


def test_the_plugins_are_found():
    assert {"vkformers_llama", "vkformers_moe", "vkformers_bert", "vkformers_t5"} <= set(plugin_packages())


def test_no_plugin_imports_another_plugins_underscore_names():
    offenders = private_imports(cross_plugin_imports())
    assert not offenders, ("plugins import other plugins' private names (make them public, or move generic "
                           "helpers to core):\n" + "\n".join(map(str, offenders)))


def test_the_llama_plugin_imports_no_other_plugin():
    offenders = [imp for importer, imp in cross_plugin_imports() if importer == "vkformers_llama"]
    assert not offenders, ("vkformers-llama reaches for another plugin (an architecture with mixture-of-experts "
                           "layers belongs in vkformers-moe):\n" + "\n".join(map(str, offenders)))


def test_a_plugin_declares_each_plugin_it_imports():
    tomllib = pytest.importorskip("tomllib")
    packages = plugin_packages()

    def distribution(package: str) -> dict:
        return tomllib.loads((packages[package] / "pyproject.toml").read_text())["project"]

    missing = set()
    for importer, imp in cross_plugin_imports():
        needed = distribution(imp.package)["name"]
        declared = {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0] for d in distribution(importer).get("dependencies", [])}
        if needed not in declared:
            missing.add(f"{distribution(importer)['name']} imports {needed} ({imp}) without depending on it")
    assert not missing, "\n".join(sorted(missing))
    # the one dependency between bundled plugins today
    assert {imp.package for importer, imp in cross_plugin_imports() if importer == "vkformers_moe"} == {
        "vkformers_llama"}


def test_the_checks_see_imports_inside_functions_private_modules_and_references():
    source = '''
import vkformers_llama._kit
from vkformers_llama.decoder import DecoderLayer, _join

def build(spec):
    try:
        from vkformers_moe.variants import moe_spec
    except ImportError:
        return None
    return moe_spec

MODEL = "vkformers_moe.deepseek_v4:_Hidden"
DOC = "see vkformers_moe.block for the sparse layers"
'''
    found = imports_of(source)
    assert [(imp.line, imp.module, imp.name) for imp in found] == [
        (2, "vkformers_llama._kit", None), (3, "vkformers_llama.decoder", "DecoderLayer"),
        (3, "vkformers_llama.decoder", "_join"), (7, "vkformers_moe.variants", "moe_spec"),
        (12, "vkformers_moe.deepseek_v4", "_Hidden")]  # a sentence is not a reference
    assert [str(imp) for imp in private_imports([("vkformers_x", imp) for imp in found])] == [
        "<source>:2: vkformers_llama._kit", "<source>:3: vkformers_llama.decoder import _join",
        "<source>:12: vkformers_moe.deepseek_v4 import _Hidden"]
