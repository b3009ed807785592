"""The floor plan (docs/architecture.md): every import of a megalaunch module, at the top of a file or
inside a function, goes to the same package or to a lower floor, and no chain of imports comes back
to where it started."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom to top. A package may import its own modules and packages on lower floors only; two packages
# on one floor know nothing of each other.
FLOORS: list[set[str]] = [
    {"errors", "__init__"},  # the error types and the version
    {"rundir"},  # every file of a run directory: paths, atomic writes, ledger, triggers, state, registry
    {"runtime", "data"},  # inside the job; datasets (.bin/.idx, blends, mixtures)
    {"config"},  # recipes: schema, loading, preflight, Megatron's arguments
    {"launcher"},  # preparing and rendering runs, backends, the chain, status
    {"tokenization", "conversion"},  # stages of their own
    {"evaluation"},  # the eval stage: conversion, then perplexity and tasks
    {"cli"},  # parse, call one library function, print
]
FLOOR = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_only_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(path: Path, module: str, *, type_only: bool = True) -> set[str]:
    """megalaunch modules imported anywhere in the file (from-imports of names resolved to modules);
    `type_only=False` leaves out imports that only type checkers run (`if TYPE_CHECKING:`)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    skip = set() if type_only else _type_only_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "megalaunch")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megalaunch":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if (SRC / Path(*sub.split("."))).with_suffix(".py").exists()
                        or (SRC / Path(*sub.split(".")) / "__init__.py").exists() else node.module)
    out.discard(module)
    return out


def _graph(*, type_only: bool = True) -> dict[str, set[str]]:
    return {_module_name(p): _imports(p, _module_name(p), type_only=type_only)
            for p in sorted((SRC / "megalaunch").rglob("*.py"))}


def test_every_package_is_on_a_floor() -> None:
    assert {_package(m) for m in _graph()} <= set(FLOOR), {_package(m) for m in _graph()} - set(FLOOR)


def test_imports_only_go_down() -> None:
    wrong = []
    for module, imports in _graph().items():
        here = _package(module)
        for target in imports:
            there = _package(target)
            if there != here and FLOOR[there] >= FLOOR[here]:
                wrong.append(f"{module} -> {target} (floor {FLOOR[here]} -> {FLOOR[there]})")
    assert wrong == [], "imports that go up or sideways:\n" + "\n".join(sorted(wrong))


def test_the_ground_floor_imports_only_the_error_types() -> None:
    for module, imports in _graph().items():
        if _package(module) == "rundir":
            assert {_package(t) for t in imports} <= {"rundir", "errors"}, (module, imports)


def test_no_import_cycles() -> None:
    """At run time: an annotation-only import (`if TYPE_CHECKING:`) closes no circle. The floor rule
    above counts those too."""
    graph = _graph(type_only=False)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_the_walker_sees_function_level_imports(tmp_path: Path) -> None:
    """The test itself: a lazy import inside a function counts like a top-level one."""
    f = SRC / "megalaunch" / "runtime" / "train.py"
    assert any(_package(t) == "rundir" for t in _imports(f, "megalaunch.runtime.train"))
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megalaunch.config import schema\n"
                     "def f():\n    from megalaunch.cli import main\n")
    assert _imports(probe, "x") == {"megalaunch.cli.main", "megalaunch.config.schema"}
    assert _imports(probe, "x", type_only=False) == {"megalaunch.cli.main"}
