"""Login-node actions on a run: submit, cancel, resume, find a run directory."""

from __future__ import annotations

import contextlib
import getpass
import os
import time
from pathlib import Path

from megalaunch.errors import PreflightError, RunDirError
from megalaunch.launcher.chain import load_run_recipe
from megalaunch.launcher.prepare import PreparedRun, write_run
from megalaunch.rundir.access import not_in_group
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.registry import known_runs, register, remember_root


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


def submit_slurm(prepared: PreparedRun) -> tuple[RunPaths, str]:
    """Write the run directory and queue the first segment."""
    from megalaunch.launcher.slurm import SlurmClient

    missing = [n for n in prepared.recipe.cluster.secret_env if not os.environ.get(n)]
    if missing:
        raise PreflightError(f"{', '.join(missing)} not set in this shell", field="cluster.secret_env",
                             fix=f"export {missing[0]}=... before submitting (its value is never written to disk)")
    client = SlurmClient()
    client.check_available()  # fail before writing anything if Slurm is absent
    paths = write_run(prepared)
    ledger = Ledger(paths)
    try:
        job_id = client.sbatch(paths.job_script, cwd=paths.root)
    except Exception as e:
        ledger.append("submit_failed", reason=str(e))
        raise
    ledger.append("submitted", job_id=job_id, by="megalaunch submit")
    register(paths.root)
    return paths, job_id


def cancel_run(paths: RunPaths, timeout_s: float = 60.0) -> list[str]:
    """Cancel every queued or running job of the chain and wait until none is left. The jobs are
    found with one query (the chain's unique job name) and cancelled by id. If Slurm does not answer,
    nothing is written and nothing is cancelled: the error says so."""
    from megalaunch.launcher.slurm import SlurmClient
    from megalaunch.launcher.status import QUERY_TIMEOUT_S

    client = SlurmClient(timeout_s=QUERY_TIMEOUT_S)
    targets = sorted(client.squeue(name=paths.root.name))
    ledger = Ledger(paths)
    paths.cancel_requested.write_text(f"{getpass.getuser()} {time.time()}\n")
    client.scancel(targets)
    deadline = time.monotonic() + timeout_s
    while targets and time.monotonic() < deadline:
        if not client.squeue(targets):
            break
        time.sleep(0.5)
    ledger.append("cancelled", job_ids=targets)
    ledger.append("chain_stopped", job_id=None, reason=f"cancelled by {getpass.getuser()}", cancelled=targets)
    return targets


def resume_run(paths: RunPaths) -> str:
    """Restart a stopped chain from its last checkpoint (a new epoch in the ledger)."""
    from megalaunch.launcher.slurm import SlurmClient

    recipe = load_run_recipe(paths)
    if recipe.cluster.backend != "slurm":
        raise RunDirError("resume of local runs: run `megalaunch submit` again or `megalaunch job local RUN`")
    with contextlib.suppress(FileNotFoundError):
        paths.cancel_requested.unlink()
    ledger = Ledger(paths)
    ledger.append("chain_resumed")
    job_id = SlurmClient().sbatch(paths.job_script, ["--dependency=singleton"], cwd=paths.root)
    ledger.append("submitted", job_id=job_id, by="megalaunch resume")
    return job_id
