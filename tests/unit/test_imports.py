"""Package contract: project modules import each other at module level only, and never in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import stargate

ROOT = Path(stargate.__file__).parent
GENERATED = "_pb2"
DEFERRED = {"stargate.entry"}
"""Modules that import the program in a function on purpose: the console-script entry points guard
the import itself against a stop signal."""


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        if GENERATED in path.name:
            continue
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return modules


def _imported(node: ast.Import | ast.ImportFrom, known: dict[str, ast.Module]) -> set[str]:
    """Project modules an import statement needs (``from pkg import mod`` needs ``pkg.mod``, not ``pkg``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    module = node.module or ""
    found = set()
    for alias in node.names:
        submodule = f"{module}.{alias.name}"
        if submodule in known:
            found.add(submodule)
        elif module in known:
            found.add(module)
    return found


def _function_local_imports(tree: ast.Module, known: dict[str, ast.Module]) -> list[str]:
    local = []
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom) and _imported(node, known):
                    local.append(f"{function.name}: {ast.unparse(node)}")
    return local


def _graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        edges: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, modules)
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as a path, or [] (iterative DFS, packages count as their ``__init__``)."""
    state: dict[str, int] = {}
    for start in graph:
        if start in state:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return [*path[path.index(child) :], child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return []


def test_project_modules_are_imported_at_module_level_only() -> None:
    modules = _modules()
    local = {
        name: _function_local_imports(tree, modules) for name, tree in modules.items() if name not in DEFERRED
    }
    assert {name: found for name, found in local.items() if found} == {}


def test_there_is_no_import_circle() -> None:
    assert _cycle(_graph(_modules())) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
