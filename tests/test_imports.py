"""Imports run strictly downward: read from the sources of core/vkformers and the bundled plugins with ``ast``.

- The graph of module-level imports (an ``if TYPE_CHECKING:`` block aside: it never runs) has no cycle.
- An import written inside a function, of vkformers or a plugin, is one of the few on ``LOCAL_IMPORTS_ALLOWED``,
  each with its reason; any other would be a circle dodged instead of fixed.

A package's ``__init__`` importing its own submodules (``vkformers/__init__.py`` re-exports the API) is not
counted as a dependency of those submodules: Python runs it first, before any of them.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = [ROOT / "core", *sorted(p for p in (ROOT / "plugins").iterdir() if p.is_dir())]

# (importing module, imported module) -> why the import waits until the function runs.
LOCAL_IMPORTS_ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    importer: str   # dotted name of the importing module
    target: str     # dotted name of the imported module (a known one, or the first-party name as written)
    local: bool     # written inside a function


def module_name(path: Path, source_root: Path) -> str:
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of core/vkformers and of the bundled plugins (not tests)."""
    modules = {}
    for source_root in SOURCE_ROOTS:
        for package in sorted(source_root.glob("vkformers*")):
            if (package / "__init__.py").is_file():
                for path in sorted(package.rglob("*.py")):
                    modules[module_name(path, source_root)] = path
    return modules


def first_party(name: str) -> bool:
    return name.split(".")[0].startswith("vkformers")


def resolve(name: str, known) -> str:
    """The module that importing ``name`` loads: the longest known prefix (``pkg.mod.Class`` -> ``pkg.mod``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, importer: str, is_package: bool, known, file: str = "<source>") -> list[Import]:
    """The first-party imports of one module, each marked as module level or inside a function."""
    found: list[Import] = []

    def add(node, names: list[str], local: bool):
        for name in names:
            if first_party(name):
                found.append(Import(file, node.lineno, importer, resolve(name, known), local))

    def visit(node, local: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit_statement(sub, local)
                continue
            visit_statement(child, local)

    def visit_statement(child, local: bool):
        if isinstance(child, ast.Import):
            add(child, [alias.name for alias in child.names], local)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                package = importer.split(".") if is_package else importer.split(".")[:-1]
                package = package[:len(package) - (child.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # ``from pkg import mod`` loads pkg.mod when that is a module, else only pkg
            add(child, [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                        for alias in child.names], local)
        else:
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def all_imports() -> list[Import]:
    files = source_files()
    found = []
    for name, path in files.items():
        found += imports_of(path.read_text(), name, path.name == "__init__.py", files,
                            str(path.relative_to(ROOT)))
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): each a cycle."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def connect(v):  # Tarjan, iterative (deep graphs would pass Python's recursion limit)
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1 or node in edges.get(node, ()):
                        found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def module_graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.local or imp.target == imp.importer:
            continue
        if imp.importer.startswith(imp.target + "."):  # a submodule's parent package: run before it anyway
            continue
        edges.setdefault(imp.importer, set()).add(imp.target)
    return edges


def test_sources_are_found():
    files = source_files()
    assert {"vkformers.engine.tensor", "vkformers.engine.function", "vkformers.models.decoder.model",
            "vkformers_moe.model"} <= set(files)


def test_no_import_cycle():
    found = cycles(module_graph(all_imports()))
    assert not found, "import cycles (make the lower module not import the upper one):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_no_unlisted_import_inside_a_function():
    local = [imp for imp in all_imports() if imp.local and (imp.importer, imp.target) not in LOCAL_IMPORTS_ALLOWED]
    assert not local, "imports inside functions (fix the layering, or list one with its reason):\n" + \
        "\n".join(f"{imp.file}:{imp.line}: {imp.target}" for imp in local)


def test_allowed_local_imports_are_still_there():
    present = {(imp.importer, imp.target) for imp in all_imports() if imp.local}
    stale = sorted(set(LOCAL_IMPORTS_ALLOWED) - present)
    assert not stale, f"LOCAL_IMPORTS_ALLOWED lists imports the sources no longer have: {stale}"


def test_the_checks_see_a_cycle_and_a_local_import():
    known = {"vkformers.a", "vkformers.b", "vkformers.c"}
    sources = {
        "vkformers.a": "from vkformers.b import thing\n",
        "vkformers.b": "import vkformers.c\nif TYPE_CHECKING:\n    from vkformers.a import Kind\n",
        "vkformers.c": "def late():\n    from vkformers.a import thing\n",
    }
    imports = [imp for name, text in sources.items() for imp in imports_of(text, name, False, known)]
    assert cycles(module_graph(imports)) == []  # the TYPE_CHECKING import and the local one are no edges
    assert [(imp.importer, imp.target) for imp in imports if imp.local] == [("vkformers.c", "vkformers.a")]
    sources["vkformers.c"] = "from vkformers import a\n"
    imports = [imp for name, text in sources.items() for imp in imports_of(text, name, False, known)]
    assert cycles(module_graph(imports)) == [["vkformers.a", "vkformers.b", "vkformers.c"]]
