"""TokenizeRun owns every file name of a tokenization run directory::

    RUN/recipe.yaml              the resolved recipe
    RUN/plan.json                dumps -> datatrove tasks -> input files (never changes after `plan`)
    RUN/tokenize.sbatch          the job-array script (every array task and resubmission runs it)
    RUN/logs/                    one log per array task and submission (%x-%A_%a.out), never overwritten
    RUN/state/ledger.jsonl       submissions: backend, job id, dumps
    RUN/dumps/dump_NNNN/datatrove/   datatrove's logging dir: completions/, stats/, logs/
    RUN/dumps/dump_NNNN/progress/TTTTT.json   documents/tokens so far, written by the task
    RUN/dumps/dump_NNNN/summary.json          written when every task of the dump is complete and checked
    RUN/output/                  the .bin/.idx pairs (unless the recipe names output_dir)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.errors import RunDirError
from megalaunch.rundir.files import append_jsonl, atomic_write_json, read_jsonl


@dataclass(frozen=True)
class TokenizeRun:
    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> TokenizeRun:
        run = cls(Path(path).expanduser().absolute())
        if not run.plan_json.is_file():
            raise RunDirError(f"{run.root} is not a tokenization run directory (no plan.json)",
                              fix="create one with `megalaunch tokenize plan RECIPE --run-dir DIR`")
        return run

    @property
    def recipe_yaml(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def job_script(self) -> Path:
        return self.root / "tokenize.sbatch"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def ledger(self) -> Path:
        return self.root / "state" / "ledger.jsonl"

    @property
    def dumps(self) -> Path:
        return self.root / "dumps"

    def dump_dir(self, dump: int) -> Path:
        return self.dumps / f"dump_{dump:04d}"

    def datatrove_dir(self, dump: int) -> Path:
        return self.dump_dir(dump) / "datatrove"

    def completion(self, dump: int, task: int) -> Path:
        """datatrove's completion marker for one task (its own naming)."""
        return self.datatrove_dir(dump) / "completions" / f"{task:05d}"

    def progress(self, dump: int, task: int) -> Path:
        return self.dump_dir(dump) / "progress" / f"{task:05d}.json"

    def summary(self, dump: int) -> Path:
        return self.dump_dir(dump) / "summary.json"

    def output_dir(self, recipe_output_dir: str = "") -> Path:
        return Path(recipe_output_dir) if recipe_output_dir else self.root / "output"

    # -- state ---------------------------------------------------------------------------------
    def record(self, event: str, **fields: Any) -> None:
        import time

        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.ledger, {"event": event, "time": time.time(), **fields})

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.ledger)

    def write_json(self, path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
