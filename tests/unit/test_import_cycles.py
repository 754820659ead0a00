"""No import cycle among the library's modules: each module's top-level imports (those under
`if TYPE_CHECKING:` and `try:` included; imports inside functions are deliberate and lazy) form
a graph without a strongly connected component of two or more modules.

A cycle makes the import order matter, hides which module is the lower layer, and breaks the
day someone moves an import to the top; a typing-only import closes one as surely as mypy reads it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edge_sdk", "coordinator", "export")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is loaded, or that a type checker reads at its top."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
    return found


def imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The library modules `node` loads: `from a import b` names the module a.b where there is one, else a."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = module if is_package else module.rpartition(".")[0]
        if node.level:
            base = ".".join(base.split(".")[:len(base.split(".")) - (node.level - 1)])
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {module: set().union(*(imported(module, path.name == "__init__.py", node, modules)
                                  for node in top_level_imports(ast.parse(path.read_text(encoding="utf-8")))))
            for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_typing_only_import_is_an_edge():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import Y\n"
                     "def f():\n    from .z import W\n")
    assert [node.module for node in top_level_imports(tree) if isinstance(node, ast.ImportFrom)] == ["x", "typing"]


def test_the_library_has_no_import_cycle():
    graph = import_graph()
    assert "edge_sdk.models.capabilities" in graph and len(graph) > 100  # the graph is the library's
    assert cycles(graph) == []
