"""Login-node actions on a run: submit, write a trigger, cancel, resume, find a run directory."""

from __future__ import annotations

import contextlib
import getpass
import grp
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from megalaunch.errors import PreflightError, RunDirError
from megalaunch.launcher.chain import load_run_recipe
from megalaunch.launcher.ledger import Ledger
from megalaunch.launcher.registry import known_runs, register, remember_root
from megalaunch.launcher.rundir import PreparedRun, write_run
from megalaunch.runtime.paths import TRIGGER_VERBS, RunPaths


def find_run(ref: str) -> RunPaths:
    """A run directory path, or the name/chain name of one of the user's registered runs."""
    p = Path(ref).expanduser()
    try:
        if (p / "run.yaml").exists():
            remember_root(p.absolute())
            return RunPaths(p.absolute())
    except PermissionError:
        raise _not_in_group(p) from None
    matches = [r for r in known_runs() if r.name == ref or r.name.rsplit("-", 1)[0] == ref]
    if len(matches) == 1:
        return RunPaths(matches[0])
    if len(matches) > 1:
        raise RunDirError(f"'{ref}' names {len(matches)} runs: {', '.join(m.name for m in matches)}",
                          fix="pass the run directory or its full chain name")
    if p.is_dir() and not os.access(p, os.R_OK | os.X_OK):
        raise _not_in_group(p)
    raise RunDirError(f"'{ref}' is not a run directory", fix="pass the directory that `megalaunch submit` printed")


def _not_in_group(p: Path) -> RunDirError:
    return RunDirError(f"you ({getpass.getuser()}) cannot read {p}: only members of the run's group "
                       f"'{_group_name(p)}' can", fix="ask the run's owner to add you to that group")


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


def write_trigger(paths: RunPaths, verb: str, reason: str | None) -> Path:
    """Atomically create triggers/<verb> with who, when and why. Any member of the run's group can."""
    if verb not in TRIGGER_VERBS:
        raise RunDirError(f"unknown trigger '{verb}'", valid=", ".join(TRIGGER_VERBS))
    tdir = paths.triggers
    if not tdir.is_dir():
        raise RunDirError(f"{paths.root} has no triggers/ directory", fix="is this a megalaunch run directory?")
    record = {"verb": verb, "user": getpass.getuser(), "uid": os.getuid(), "host": socket.gethostname(),
              "time": time.time(), "reason": reason}
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{verb}.", dir=tdir)
    except PermissionError:
        group = _group_name(tdir)
        raise RunDirError(f"permission denied writing a trigger in {tdir}: you ({getpass.getuser()}) are not "
                          f"a member of the run's group '{group}'",
                          fix=f"ask the run's owner to add you to '{group}' or to trigger it") from None
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o660)
    os.replace(tmp, tdir / verb)
    return tdir / verb


def _group_name(path: Path) -> str:
    """The group of `path`, or of the nearest directory above it that this user may stat: inside a
    2770 run directory an outsider can stat nothing, but the run directory itself they can."""
    for p in [path.absolute(), *path.absolute().parents]:
        try:
            gid = p.stat().st_gid
        except OSError:
            continue
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            return str(gid)
    return "?"


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
