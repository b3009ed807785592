"""Plan a tokenization: find the input files, filter them, split them into dumps balanced by bytes,
and within each dump into datatrove tasks. The plan is data (plan.json), so every job, resubmission
and status query sees exactly the same split."""

from __future__ import annotations

import fnmatch
import heapq
import os
from dataclasses import dataclass
from typing import Any

from megalaunch.errors import PreflightError, RunDirError
from megalaunch.rundir.files import read_json
from megalaunch.rundir.tokenize import TokenizeRun
from megalaunch.tokenization.recipe import INPUT_SUFFIXES, InputsConfig


@dataclass(frozen=True)
class InputFile:
    path: str
    size: int


@dataclass(frozen=True)
class Dump:
    """One Slurm array task. `tasks[k]` are the files datatrove task k reads, in this order."""

    index: int
    tasks: tuple[tuple[InputFile, ...], ...]

    @property
    def bytes(self) -> int:
        return sum(f.size for files in self.tasks for f in files)

    @property
    def n_files(self) -> int:
        return sum(len(files) for files in self.tasks)

    def output_name(self, task: int) -> str:
        return f"dump{self.index:04d}_task{task:05d}"


@dataclass(frozen=True)
class Plan:
    dumps: tuple[Dump, ...]
    roots: tuple[str, ...]

    @property
    def n_files(self) -> int:
        return sum(d.n_files for d in self.dumps)

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.dumps)

    def to_json(self) -> dict[str, Any]:
        return {"roots": list(self.roots),
                "dumps": [{"index": d.index, "bytes": d.bytes,
                           "tasks": [[{"path": f.path, "size": f.size} for f in files] for files in d.tasks]}
                          for d in self.dumps]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        dumps = tuple(Dump(index=d["index"],
                           tasks=tuple(tuple(InputFile(f["path"], f["size"]) for f in files)
                                       for files in d["tasks"]))
                      for d in data["dumps"])
        return cls(dumps=dumps, roots=tuple(data["roots"]))


def is_supported(path: str) -> bool:
    return path.endswith(INPUT_SUFFIXES)


def _matches(rel: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """A pattern with a `/` matches the path relative to its root (`*` crosses directories),
    one without matches the file name."""
    name = os.path.basename(rel)
    return any(fnmatch.fnmatchcase(rel if "/" in p else name, p) for p in patterns)


def find_inputs(inputs: InputsConfig) -> list[InputFile]:
    """Every supported file under the roots that passes the filters, sorted by path."""
    found: dict[str, InputFile] = {}
    for root in inputs.roots:
        root = os.path.abspath(os.path.expanduser(root))
        if os.path.isfile(root):
            candidates = [(root, os.path.basename(root))]
        elif os.path.isdir(root):
            candidates = []
            for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in filenames:
                    if not name.startswith("."):
                        full = os.path.join(dirpath, name)
                        candidates.append((full, os.path.relpath(full, root)))
        else:
            raise PreflightError(f"input root {root} does not exist", field="inputs.roots",
                                 fix="fix the path in the recipe or pass --set inputs.roots=[DIR]")
        for full, rel in candidates:
            if inputs.filter_in and not _matches(rel, inputs.filter_in):
                continue
            if inputs.filter_out and _matches(rel, inputs.filter_out):
                continue
            if not is_supported(full):
                if inputs.filter_in:  # the user asked for it explicitly
                    raise PreflightError(f"{full} matches inputs.filter_in but no reader takes it",
                                         field="inputs.filter_in", valid=", ".join(INPUT_SUFFIXES))
                continue
            if not os.access(full, os.R_OK):
                raise PreflightError(f"input file {full} is not readable", field="inputs.roots",
                                     fix="fix its permissions or exclude it with inputs.filter_out")
            found[full] = InputFile(full, os.path.getsize(full))
    if not found:
        raise PreflightError(f"no input files under {', '.join(inputs.roots)}", field="inputs",
                             valid=f"files ending in {', '.join(INPUT_SUFFIXES)}"
                                   + (f" matching {list(inputs.filter_in)}" if inputs.filter_in else "")
                                   + (f" and not {list(inputs.filter_out)}" if inputs.filter_out else ""),
                             fix="check inputs.roots and the filters")
    return [found[k] for k in sorted(found)]


def balance(files: list[InputFile], n: int) -> list[list[InputFile]]:
    """Split into `n` non-empty groups of nearly equal bytes (largest file first onto the lightest
    group); each group sorted by path. Deterministic for a given list."""
    n = max(1, min(n, len(files)))
    heap = [(0, i) for i in range(n)]
    groups: list[list[InputFile]] = [[] for _ in range(n)]
    for f in sorted(files, key=lambda f: (-f.size, f.path)):
        total, i = heapq.heappop(heap)
        groups[i].append(f)
        heapq.heappush(heap, (total + f.size, i))
    return [sorted(g, key=lambda f: f.path) for g in groups]


def make_plan(inputs: InputsConfig, n_dumps: int, tasks: int) -> Plan:
    files = find_inputs(inputs)
    dumps = tuple(Dump(index=i, tasks=tuple(tuple(t) for t in balance(group, tasks)))
                  for i, group in enumerate(balance(files, n_dumps)))
    return Plan(dumps=dumps, roots=tuple(os.path.abspath(os.path.expanduser(r)) for r in inputs.roots))


def load_plan(run: TokenizeRun) -> Plan:
    """The plan a tokenization run directory holds (written once by `tokenize plan`)."""
    data = read_json(run.plan_json)
    if data is None:
        raise RunDirError(f"{run.plan_json} is missing or unreadable")
    return Plan.from_json(data)
