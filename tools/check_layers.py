"""Check that imports run one way through streamrft's layers (ARCHITECTURE.md, "Layers").

    python -m tools.check_layers [--graph] [ROOT]

Every module of the product belongs to one layer, decided by its folder:

    application   app/                may import anything below
    client        client/             may import infra core, schemas
                                      (the app-facing client: never the application,
                                      producers or consumers)
    producers     producers/          may import sync, infra core, schemas
    consumers     consumers/          may import sync, infra core, schemas
    sync          sync/               may import infra core, schemas
    local         infra/local/        may import infra core, schemas (beside the stack)
    infra core    infra/*.py          may import schemas
    schemas       schemas/            may import nothing of streamrft but itself

An import of a layer that is not allowed (an upward one, producers <-> consumers, or
anything but the application reaching the local services) is printed with its file and
line, and the exit code is 1. Imports inside functions and under ``TYPE_CHECKING`` count
the same as the ones at the top (a lazy import is still a dependency), and relative
imports are resolved to the module they name. Module by module, no import may close a
circle, except a registry's line (:data:`REGISTRIES`). ``--graph`` prints the layer
import graph (which layer imports which) and the number of circles instead.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FOLDERS = {
    "schemas": "schemas",
    "infra": "infra",
    "infra/local": "local",
    "app": "app",
    "sync": "sync",
    "producers": "producers",
    "consumers": "consumers",
    "client": "client",
}
"""Source folder (relative to the repository root) -> layer; the longest match wins."""

MODULES = {
    "streamrft.schemas": "schemas",
    "streamrft.infra": "infra",
    "streamrft.infra.local": "local",
    "streamrft.app": "app",
    "streamrft.sync": "sync",
    "streamrft.producers": "producers",
    "streamrft.consumers": "consumers",
    "streamrft.client": "client",
}
"""Imported module name -> layer; the longest prefix wins."""

ALLOWED: dict[str, frozenset[str]] = {
    "schemas": frozenset({"schemas"}),
    "infra": frozenset({"schemas", "infra"}),
    "local": frozenset({"schemas", "infra", "local"}),
    "sync": frozenset({"schemas", "infra", "sync"}),
    "producers": frozenset({"schemas", "infra", "sync", "producers"}),
    "consumers": frozenset({"schemas", "infra", "sync", "consumers"}),
    "app": frozenset(MODULES.values()),
    "client": frozenset({"schemas", "infra", "client"}),
}
"""What each layer may import."""

REGISTRIES = {
    "streamrft.sync.transport": "a sync method's name -> its transport module",
    "streamrft.consumers.train_engine": "a train engine's name -> its module",
}
"""Modules whose imports inside functions are registry lines (a name -> the module that
implements it, imported when chosen): the one place an import circle is allowed, since
the module it names imports the registry's base classes back."""


@dataclass(frozen=True)
class Edge:
    source: str
    """Layer of the importing module."""
    target: str
    """Layer of the imported module."""
    where: str
    """``path:line`` of the import."""
    module: str
    """The imported module's name."""


def _longest_match(table: dict[str, str], name: str, sep: str) -> str | None:
    """The value of the longest key of ``table`` that ``name`` is, or lies under."""
    keys = [k for k in table if name == k or name.startswith(k + sep)]
    return table[max(keys, key=len)] if keys else None


def layer_of_path(path: Path, root: Path) -> str | None:
    return _longest_match(FOLDERS, path.relative_to(root).parent.as_posix(), "/")


def layer_of_module(name: str) -> str | None:
    return _longest_match(MODULES, name, ".")


def module_of_path(path: Path, root: Path) -> str:
    """The import name of a product file (``app/cli.py`` -> ``streamrft.app.cli``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["streamrft", *parts])


def _imported(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """Every module ``tree`` imports, as an absolute name (relative imports resolved)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from ..x import y` inside streamrft
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            # `from streamrft.infra import kafka` imports streamrft.infra.kafka
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def edges(root: Path) -> list[Edge]:
    out = []
    for folder in sorted({f.split("/")[0] for f in FOLDERS}):
        for path in sorted((root / folder).rglob("*.py")):
            source = layer_of_path(path, root)
            if source is None:
                continue
            tree = ast.parse(path.read_text(), str(path))
            name = module_of_path(path, root)
            for module, line in _imported(tree, name, path.name == "__init__.py"):
                target = layer_of_module(module)
                if target is not None:
                    where = f"{path.relative_to(root)}:{line}"
                    out.append(Edge(source, target, where, module))
    return out


def _registry_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the imports inside functions of ``tree``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    lines.add(inner.lineno)
    return lines


def module_graph(root: Path) -> dict[str, set[str]]:
    """Product module -> the product modules it imports (lazy ones included, registry lines
    of :data:`REGISTRIES` left out)."""
    paths = {
        module_of_path(path, root): path
        for folder in sorted({f.split("/")[0] for f in FOLDERS})
        for path in sorted((root / folder).rglob("*.py"))
        if layer_of_path(path, root) is not None
    }
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _registry_lines(tree) if module in REGISTRIES else set()
        for name, line in _imported(tree, module, path.name == "__init__.py"):
            parts = name.split(".")
            while parts and ".".join(parts) not in paths:  # `pkg.mod.Class` -> `pkg.mod`
                parts.pop()
            target = ".".join(parts)
            if target and target != module and line not in skip:
                graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected sets of 2+ modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(found: list[Edge]) -> list[Edge]:
    return [e for e in found if e.target not in ALLOWED[e.source]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.check_layers", description=__doc__)
    p.add_argument("root", nargs="?", default=".", help="repository root (default: .)")
    p.add_argument("--graph", action="store_true", help="print the layer import graph")
    args = p.parse_args(argv)
    found = edges(Path(args.root).resolve())
    if args.graph:
        pairs: dict[tuple[str, str], int] = {}
        for e in found:
            if e.source != e.target:
                pairs[(e.source, e.target)] = pairs.get((e.source, e.target), 0) + 1
        for (s, t), n in sorted(pairs.items()):
            print(f"{s} -> {t}: {n} imports")
        loops = circles(module_graph(Path(args.root).resolve()))
        print(f"import circles: {len(loops) or 'none'} (registries apart: {', '.join(REGISTRIES)})")
        return 0
    bad = violations(found)
    for e in bad:
        print(f"{e.where}: {e.source} imports {e.module} ({e.target}); see ARCHITECTURE.md")
    loops = circles(module_graph(Path(args.root).resolve()))
    for loop in loops:
        print(f"import circle: {' <-> '.join(loop)}")
    if bad or loops:
        print(f"{len(bad)} imports against the layers, {len(loops)} circles", file=sys.stderr)
        return 1
    print(f"layers: {len(found)} imports checked, all run one way, no import circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
