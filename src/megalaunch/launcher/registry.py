"""The user's list of run directories ($XDG_STATE_HOME/megalaunch/runs), so `megalaunch status`
without arguments can show every run of the user with one Slurm query."""

from __future__ import annotations

import os
from pathlib import Path


def registry_file() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "megalaunch" / "runs"


def register(run_dir: Path) -> None:
    f = registry_file()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "a") as out:
            out.write(f"{run_dir}\n")
    except OSError:
        pass  # a missing registry costs only the no-argument status listing


def registered_runs() -> list[Path]:
    try:
        lines = registry_file().read_text().splitlines()
    except OSError:
        return []
    seen: dict[str, None] = {}
    for line in lines:
        if line.strip():
            seen.setdefault(line.strip(), None)
    return [Path(p) for p in seen if (Path(p) / "run.yaml").exists()]
