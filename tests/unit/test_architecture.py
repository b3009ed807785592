"""The floor plan and the limits of docs/architecture.md ("Limits that cannot drift"): every import of a
megalaunch module, at the top of a file, inside a function or under `if TYPE_CHECKING:`, goes to the
same package or to a lower floor, and no chain of imports comes back to where it started; no source
file is longer than FILE_LINES, no function longer than FUNCTION_LINES unless LONG_FUNCTIONS_ALLOWED
says why. Read with `ast` only: nothing of the package is imported. Each check is a function that
returns its problems, one line naming the offender each, and is shown to fail on a small tree."""

from __future__ import annotations

import ast
import functools
import textwrap
from collections.abc import Iterator, Mapping
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
    {"tokenization", "conversion", "remote"},  # stages of their own (tokenization.chat: chat data for SFT); remote use over SSH
    {"evaluation", "finetune"},  # the eval stage: conversion, then perplexity and tasks; submit --from-hf --data
    {"cli"},  # parse, call one library function, print
]
FLOOR = {pkg: i for i, floor in enumerate(FLOORS) for pkg in floor}

# The parts of the two largest packages: their sub-packages, and which other parts of the same package
# each may import. A package's own top-level modules (the entry points and what reads across parts) may
# import every part; a part never imports its package's top-level modules. The map itself has no circle.
PARTS: dict[str, dict[str, set[str]]] = {
    "runtime": {
        "rank": set(),  # this rank, settings, hooks, collectives, failures: what every part shares
        "checkpoint": {"rank"},
        "health": {"rank"},
        "model": {"rank"},
        "scoring": {"rank"},
        "flows": {"rank", "scoring"},
        "observation": {"rank", "checkpoint", "health"},
        "stop": {"rank", "observation"},
        "loop": {"rank", "stop", "model", "flows"},
    },
    "launcher": {
        "accounting": set(),
        "prepare": set(),
        "report": {"accounting"},
        "chain": {"prepare", "accounting"},
        "backends": {"chain", "prepare", "accounting"},
    },
}

FILE_LINES = 350  # a source file, counted in lines
FOLDER_MODULES = 15  # modules directly in one folder (its __init__ not counted); more: sub-packages
FUNCTION_LINES = 60  # a function or method, from its `def` line to its last line (nested ones included)

# Functions that stay longer than FUNCTION_LINES, each with why. An entry whose function is gone or
# short again fails the test: take it out.
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {
    "megalaunch.config.megatron_args:megatron_args":
        "the one place Megatron's whole argument list is built, one short section per recipe part, in order",
    "megalaunch.conversion.checkpoint_io.mcore_save:_lazy_strategy_class":
        "defines two torch/Megatron subclasses inside a function so that importing the module costs no torch",
    "megalaunch.launcher.accounting.goodput:segment_time":
        "one pass over a segment's consecutive boundaries, so its components add up to the wall time exactly",
}



def _sources(src: Path = SRC) -> list[Path]:
    return sorted((src / "megalaunch").rglob("*.py"))


def _module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
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


def _is_module(name: str, src: Path) -> bool:
    base = src / Path(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _imports(path: Path, module: str, *, type_only: bool = True, src: Path = SRC) -> set[str]:
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
                out.add(sub if _is_module(sub, src) else node.module)
    out.discard(module)
    return out


def _graph(*, type_only: bool = True, src: Path = SRC) -> dict[str, set[str]]:
    return {_module_name(p, src): _imports(p, _module_name(p, src), type_only=type_only, src=src)
            for p in _sources(src)}


# ------------------------------------------------------------------------------------------ the checks


def floor_problems(graph: Mapping[str, set[str]]) -> list[str]:
    """Imports that go up the floor plan or sideways (to another package of the same floor)."""
    wrong = []
    for module, imports in graph.items():
        here = _package(module)
        for target in imports:
            there = _package(target)
            if there != here and FLOOR[there] >= FLOOR[here]:
                wrong.append(f"{module} -> {target} (floor {FLOOR[here]} -> {FLOOR[there]})")
    return sorted(wrong)


def _part(module: str) -> str:
    """The sub-package of a module inside its package ("" for the package's own top-level modules)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else ""


def part_problems(graph: Mapping[str, set[str]], parts: Mapping[str, Mapping[str, set[str]]]) -> list[str]:
    """Imports between the parts of one package that its map does not allow, and sub-packages the map
    does not name (a new part must say what it may use)."""
    wrong = []
    for module, imports in graph.items():
        pkg, here = _package(module), _part(module)
        if pkg not in parts:
            continue
        if here and here not in parts[pkg]:
            wrong.append(f"{module}: part {pkg}.{here} is not in PARTS: say what it may use")
            continue
        for target in imports:
            there = _part(target)
            if _package(target) != pkg or there == here or not here:
                continue
            if not there or there not in parts[pkg][here]:
                what = f"{pkg}'s top level" if not there else f"part {pkg}.{there}"
                wrong.append(f"{module} -> {target} ({pkg}.{here} may not use {what})")
    return sorted(set(wrong))


def part_map_circles(parts: Mapping[str, Mapping[str, set[str]]]) -> list[str]:
    """Circles in the parts' own map (a part that may use another that may use it)."""
    out = []
    for pkg, rules in parts.items():
        graph = {name: set(uses) for name, uses in rules.items()}
        out += [f"{pkg}: {' -> '.join(c)}" for c in import_circles(graph).values()]
    return sorted(out)


def folder_problems(src: Path = SRC) -> list[str]:
    """Folders that hold more than FOLDER_MODULES modules directly: group them into sub-packages."""
    out = []
    for folder in sorted({p.parent for p in _sources(src)}):
        n = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
        if n > FOLDER_MODULES:
            out.append(f"{folder.relative_to(src).as_posix()}: {n} modules (limit {FOLDER_MODULES}): group them")
    return out


def _reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt in graph and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _circle_through(start: str, members: set[str], graph: Mapping[str, set[str]]) -> list[str]:
    """The shortest import chain from `start` back to itself among `members`."""
    came_from: dict[str, str] = {}
    queue = [start]
    for node in queue:
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is on no circle among {sorted(members)}")


def import_circles(graph: Mapping[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """Every group of modules that import each other (directly or not), with one circle through it."""
    reach = {m: _reachable(graph, m) for m in graph}
    groups = {frozenset(w for w in reach[m] if m in reach[w]) for m in graph if m in reach[m]}
    return {g: _circle_through(min(g), set(g), graph) for g in groups}


def circle_problems(graph: Mapping[str, set[str]], known: list[tuple[str, ...]]) -> list[str]:
    """New import circles, and known ones that are gone (their entry must go too)."""
    circles = import_circles(graph)
    allowed = {frozenset(c) for c in known}
    out = [f"import circle: {' -> '.join(c)}" for g, c in circles.items() if g not in allowed]
    out += [f"KNOWN_CIRCLES_TO_REMOVE: {' <-> '.join(sorted(g))} is no circle any more: remove the entry"
            for g in allowed - set(circles)]
    return sorted(out)


def file_lengths(src: Path = SRC) -> dict[str, int]:
    """Lines of every source file, by its path under src/."""
    return {p.relative_to(src).as_posix(): len(p.read_text().splitlines()) for p in _sources(src)}


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualname, lines) of every function and method, nested ones included, as Python names them."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + child.name
            yield name, (child.end_lineno or child.lineno) - child.lineno + 1
            yield from _functions(child, f"{name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def function_lengths(src: Path = SRC) -> dict[str, int]:
    """Lines of every function, by `module:qualname`."""
    return {f"{_module_name(p, src)}:{name}": lines
            for p in _sources(src) for name, lines in _functions(ast.parse(p.read_text()))}


def length_problems(lengths: Mapping[str, int], limit: int, allowed: Mapping[str, str], what: str) -> list[str]:
    """What is over `limit` and not allowed, and allowances for what is gone or short again."""
    out = [f"{name}: {n} lines (limit {limit}): split it" for name, n in lengths.items()
           if n > limit and name not in allowed]
    out += [f"{name} is allowed {what} but is {'gone' if name not in lengths else f'{lengths[name]} lines'}: "
            "remove its entry" for name in allowed if lengths.get(name, 0) <= limit]
    return sorted(out)


# ------------------------------------------------------------------------------------------ this tree


@functools.cache
def _this_graph() -> dict[str, set[str]]:
    return _graph()


def test_every_package_is_on_a_floor() -> None:
    assert {_package(m) for m in _this_graph()} <= set(FLOOR), {_package(m) for m in _this_graph()} - set(FLOOR)


def test_imports_only_go_down() -> None:
    """Annotation-only (`if TYPE_CHECKING:`) and function-level imports count."""
    wrong = floor_problems(_this_graph())
    assert wrong == [], "imports that go up or sideways:\n" + "\n".join(wrong)


def test_the_ground_floor_imports_only_the_error_types() -> None:
    for module, imports in _this_graph().items():
        if _package(module) == "rundir":
            assert {_package(t) for t in imports} <= {"rundir", "errors"}, (module, imports)


def test_parts_use_only_what_their_map_allows() -> None:
    """Inside runtime/ and launcher/, function-level and annotation-only imports count too."""
    wrong = part_problems(_this_graph(), PARTS)
    assert wrong == [], "imports between parts that PARTS does not allow:\n" + "\n".join(wrong)
    assert part_map_circles(PARTS) == []


def test_every_part_says_what_it_owns_and_may_use() -> None:
    for pkg, rules in PARTS.items():
        found = {p.parent.name for p in (SRC / "megalaunch" / pkg).glob("*/__init__.py")}
        assert found == set(rules), (pkg, found ^ set(rules))
        for part, uses in rules.items():
            doc = ast.get_docstring(ast.parse((SRC / "megalaunch" / pkg / part / "__init__.py").read_text())) or ""
            assert "May use:" in doc, f"{pkg}/{part}/__init__.py: its docstring says what it owns and 'May use: ...'"
            said = doc.split("May use:", 1)[1]
            assert all(f"{pkg}.{u}" in said for u in uses), (f"{pkg}.{part}", uses, said)


def test_folders_hold_few_modules() -> None:
    assert folder_problems() == []


def test_no_import_circles() -> None:
    """Annotation-only (`if TYPE_CHECKING:`) and function-level imports count: a circle of annotations
    is still two modules that cannot be understood one without the other."""
    problems = circle_problems(_this_graph(), [])  # no circle is allowed
    assert problems == [], "\n".join(problems)


def test_source_files_are_short() -> None:
    problems = length_problems(file_lengths(), FILE_LINES, {}, "to be long")  # no file may be
    assert problems == [], "\n".join(problems)


def test_functions_are_short() -> None:
    problems = length_problems(function_lengths(), FUNCTION_LINES, LONG_FUNCTIONS_ALLOWED, "to be long")
    assert problems == [], "\n".join(problems)


def test_every_allowance_says_why_in_one_line() -> None:
    for name, why in LONG_FUNCTIONS_ALLOWED.items():
        assert why.strip() and "\n" not in why, name
    assert all(":" in name for name in LONG_FUNCTIONS_ALLOWED)


# ------------------------------------------------------------------------------------------ the checks' own tests


def test_the_walker_sees_function_level_imports(tmp_path: Path) -> None:
    """The test itself: a lazy import inside a function counts like a top-level one."""
    f = SRC / "megalaunch" / "runtime" / "train.py"
    assert any(_package(t) == "rundir" for t in _imports(f, "megalaunch.runtime.train"))
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megalaunch.config import schema\n"
                     "def f():\n    from megalaunch.cli import main\n")
    assert _imports(probe, "x") == {"megalaunch.cli.main", "megalaunch.config.schema"}
    assert _imports(probe, "x", type_only=False) == {"megalaunch.cli.main"}


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A small source tree under root/src: {"megalaunch/x/y.py": source}."""
    src = root / "src"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return src


def _body(lines: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(lines))


BAD_TREE = {
    "megalaunch/__init__.py": "",
    "megalaunch/errors.py": "",
    "megalaunch/rundir/__init__.py": "",
    # up the floor plan, inside a function; and a circle with cli.main
    "megalaunch/rundir/paths.py": "def f():\n    from megalaunch.cli import main\n",
    "megalaunch/cli/__init__.py": "",
    "megalaunch/cli/main.py": "from megalaunch.rundir.paths import f\n",
    # a circle closed by an annotation-only import
    "megalaunch/runtime/__init__.py": "",
    "megalaunch/runtime/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from megalaunch.runtime.b import B\n",
    "megalaunch/runtime/b.py": "import megalaunch.runtime.a\nclass B: ...\n",
    # 61 lines: a method, and a function nested in a function; 60 lines: at the limit
    "megalaunch/launcher/__init__.py": "",
    # parts: health may use rank only; a part may not use its package's top level; an unlisted part
    "megalaunch/runtime/rank/__init__.py": "",
    "megalaunch/runtime/rank/ctx.py": "",
    "megalaunch/runtime/health/__init__.py": "",
    "megalaunch/runtime/health/beat.py": "from megalaunch.runtime.rank import ctx\nfrom megalaunch.runtime.stop.sig import f\n"
                                         "def g():\n    from megalaunch.runtime import train\n",
    "megalaunch/runtime/stop/__init__.py": "",
    "megalaunch/runtime/stop/sig.py": "def f(): ...\n",
    "megalaunch/runtime/train.py": "from megalaunch.runtime.stop import sig\n",
    "megalaunch/runtime/extra/__init__.py": "",
    "megalaunch/runtime/extra/x.py": "",
    "megalaunch/launcher/long.py": "class C:\n    def method(self):\n" + textwrap.indent(_body(60), "    ")
                                   + "def outer():\n    def inner():\n" + textwrap.indent(_body(60), "    ")
                                   + "def at_limit():\n" + _body(59) + "x = 1\n" * 220,
}


def test_the_checks_fail_on_a_tree_that_breaks_them(tmp_path: Path) -> None:
    src = _tree(tmp_path, BAD_TREE)
    graph = _graph(src=src)
    assert floor_problems(graph) == ["megalaunch.rundir.paths -> megalaunch.cli.main (floor 1 -> 7)"]
    parts = {"runtime": {"rank": set(), "health": {"rank"}, "stop": {"rank", "health"}}}
    assert part_problems(graph, parts) == [
        "megalaunch.runtime.extra.x: part runtime.extra is not in PARTS: say what it may use",
        "megalaunch.runtime.health.beat -> megalaunch.runtime.stop.sig (runtime.health may not use part runtime.stop)",
        "megalaunch.runtime.health.beat -> megalaunch.runtime.train (runtime.health may not use runtime's top level)"]
    assert part_map_circles({"runtime": {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}}) == ["runtime: a -> b -> c -> a"]
    assert part_map_circles(parts) == []
    crowded = _tree(tmp_path / "crowded", {f"megalaunch/big/m{i}.py": "" for i in range(FOLDER_MODULES + 1)}
                    | {"megalaunch/big/__init__.py": "", "megalaunch/ok/__init__.py": "",
                       **{f"megalaunch/ok/m{i}.py": "" for i in range(FOLDER_MODULES)}})
    assert folder_problems(crowded) == [f"megalaunch/big: {FOLDER_MODULES + 1} modules (limit {FOLDER_MODULES}): group them"]
    assert circle_problems(graph, []) == [
        "import circle: megalaunch.cli.main -> megalaunch.rundir.paths -> megalaunch.cli.main",
        "import circle: megalaunch.runtime.a -> megalaunch.runtime.b -> megalaunch.runtime.a"]
    # a known circle passes; one that is gone must leave the list
    assert circle_problems(graph, [("megalaunch.runtime.b", "megalaunch.runtime.a"),
                                   ("megalaunch.cli.main", "megalaunch.rundir.paths"),
                                   ("megalaunch.x", "megalaunch.y")]) == [
        "KNOWN_CIRCLES_TO_REMOVE: megalaunch.x <-> megalaunch.y is no circle any more: remove the entry"]
    # without the annotation-only import, runtime's circle is open
    assert len(import_circles(_graph(src=src, type_only=False))) == 1
    lengths = function_lengths(src)
    assert lengths["megalaunch.launcher.long:at_limit"] == FUNCTION_LINES
    assert length_problems(lengths, FUNCTION_LINES, {}, "to be long") == [
        "megalaunch.launcher.long:C.method: 61 lines (limit 60): split it",
        "megalaunch.launcher.long:outer.<locals>.inner: 61 lines (limit 60): split it",
        "megalaunch.launcher.long:outer: 62 lines (limit 60): split it"]
    assert length_problems(lengths, FUNCTION_LINES, {"megalaunch.launcher.long:C.method": "why",
                                                     "megalaunch.launcher.long:outer": "why",
                                                     "megalaunch.launcher.long:outer.<locals>.inner": "why",
                                                     "megalaunch.launcher.long:at_limit": "why"}, "to be long") == [
        "megalaunch.launcher.long:at_limit is allowed to be long but is 60 lines: remove its entry"]
    assert length_problems(file_lengths(src), FILE_LINES, {"megalaunch/errors.py": "why"}, "to be long") == [
        "megalaunch/errors.py is allowed to be long but is 0 lines: remove its entry",
        "megalaunch/launcher/long.py: 404 lines (limit 350): split it"]
