#!/usr/bin/env python3
"""Write core/vkformers/models/known_families.py: which family plugin provides each model_type spelling.

Core reads that table to say `pip install vkformers-<family>` for a spelling whose plugin is not installed,
so it cannot come from the installed plugins alone; it is generated from the declarations of every plugin in
plugins/ (each plugins/<dir>/pyproject.toml's "vkformers.plugins" entry point), whatever is installed.
tests/test_registry.py fails when the file is out of step with them.

Usage: python tools/write_known_families.py           # rewrite the file
       python tools/write_known_families.py --check   # exit 1 if it is out of step
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLUGINS = REPO / "plugins"
TARGET = REPO / "core" / "vkformers" / "models" / "known_families.py"
COMMAND = "python tools/write_known_families.py"

sys.path.insert(0, str(REPO / "core"))
from vkformers.models.plugins import ENTRY_POINT_GROUP, new_plugin_manager  # noqa: E402
from vkformers.models.registry import Registry  # noqa: E402


def plugin_entry_points(pyproject: str) -> dict[str, str]:
    """The name = "module:object" lines of the pyproject's vkformers.plugins table (tomllib needs Python 3.11)."""
    table = re.search(rf'^\[project\.entry-points\."{re.escape(ENTRY_POINT_GROUP)}"\]\n(.*?)(?=^\[|\Z)', pyproject,
                      re.MULTILINE | re.DOTALL)
    if table is None:
        return {}
    return dict(re.findall(r'^\s*([\w.-]+)\s*=\s*"([^"]+)"', table.group(1), re.MULTILINE))


def repository_plugins() -> dict[str, object]:
    """Entry point name -> plugin object, for every plugin distribution in plugins/."""
    found = {}
    for pyproject in sorted(PLUGINS.glob("*/pyproject.toml")):
        entry_points = plugin_entry_points(pyproject.read_text())
        sys.path.insert(0, str(pyproject.parent))
        for name, reference in entry_points.items():
            module_name, _, attribute = reference.partition(":")
            found[name] = getattr(importlib.import_module(module_name), attribute)
    return found


def spelling_families() -> dict[str, str]:
    """Every spelling the repository's plugins register (canonical names and aliases) -> its plugin."""
    manager = new_plugin_manager(load_entry_points=False)
    for name, plugin in repository_plugins().items():
        manager.register(plugin, name=name)
    registry = Registry(manager)  # refuses duplicates and dangling aliases, as at run time
    owners = {architecture.name: architecture.family for architecture in registry.architectures()}
    owners.update({alias.spelling: alias.family for alias in registry.aliases()})
    return owners


def render(owners: dict[str, str]) -> str:
    lines = [
        '"""Which family plugin provides each known model_type spelling.',
        "",
        "Lets an error say `pip install vkformers-<family>` when that plugin is not installed.",
        f"Generated from the plugins' declarations by `{COMMAND}`; do not edit.",
        '"""',
        "",
        "KNOWN_FAMILIES = {",
    ]
    for family in sorted(set(owners.values())):
        lines.append(f"    # vkformers-{family}")
        lines += [f'    "{spelling}": "{family}",' for spelling in sorted(s for s, f in owners.items() if f == family)]
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the file is out of step")
    args = parser.parse_args()
    text = render(spelling_families())
    if args.check:
        if TARGET.read_text() != text:
            print(f"{TARGET.relative_to(REPO)} is out of step with the plugins' declarations; run: {COMMAND}")
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
