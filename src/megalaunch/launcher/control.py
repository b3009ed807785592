"""Find a run directory from what the user typed: a path, or a run's name or chain name."""

from __future__ import annotations

import os
from pathlib import Path

from megalaunch.errors import RunDirError
from megalaunch.rundir.access import not_in_group
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.registry import known_runs, remember_root


def find_run(ref: str) -> RunPaths:
    """A run directory path, or the name/chain name of one of the user's registered runs."""
    p = Path(ref).expanduser()
    try:
        if (p / "run.yaml").exists():
            remember_root(p.absolute())
            return RunPaths(p.absolute())
    except PermissionError:
        raise not_in_group(p) from None
    matches = [r for r in known_runs() if r.name == ref or r.name.rsplit("-", 1)[0] == ref]
    if len(matches) == 1:
        return RunPaths(matches[0])
    if len(matches) > 1:
        raise RunDirError(f"'{ref}' names {len(matches)} runs: {', '.join(m.name for m in matches)}",
                          fix="pass the run directory or its full chain name")
    if p.is_dir() and not os.access(p, os.R_OK | os.X_OK):
        raise not_in_group(p)
    raise RunDirError(f"'{ref}' is not a run directory", fix="pass the directory that `megalaunch submit` printed")
