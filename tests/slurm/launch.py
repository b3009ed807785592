"""Helpers to submit megalaunch runs on the local Slurm cluster, as root or as a team member."""

from __future__ import annotations

import getpass
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from cluster import run_as

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
MEGALAUNCH = str(Path(sys.executable).with_name("megalaunch"))
COUNTER = str(REPO / "tests" / "workloads" / "counter.py")
RANKINFO = str(REPO / "tests" / "workloads" / "rankinfo.py")


def trainer_python() -> str:
    """`cluster.python` for root's jobs that run the real trainer where the test's claim is not about the
    processes Slurm starts (which process gets a signal, which ones a node's death takes): the tests' fork
    server's shim (tests/support/forkserver.py). srun starts the shim as the step's task; the task supervisor
    and the trainer are forked from a process that has torch and Megatron imported (~1 CPU-s per rank
    instead of ~8 on this 2-core machine), with the task's environment (SLURM_*, SLURMD_NODENAME: so a
    node killed by tests/slurm/scale.kill_node takes them too), working directory and streams; the shim
    passes on every signal Slurm sends it and leaves as they did. PYTHON with MEGALAUNCH_TEST_FORK=0 and on GPU
    machines. Root's jobs only: the server's socket sits in a directory only root can enter, so a job of
    another user (mlalice, ...) must get PYTHON from its test."""
    from tests.support import forkserver

    return forkserver.python()


def job_megalaunch() -> str:
    """`cluster.megalaunch` to go with trainer_python(): the jobs' `megalaunch` commands (job begin/end,
    evaluation, conversion) forked from the same server (the entry point's `main()`); MEGALAUNCH
    where trainer_python() gives a fresh interpreter."""
    return _cli_wrapper(trainer_python())


def job_cli(user: str | None = None) -> str:
    """`cluster.megalaunch` for a job whose own `megalaunch job ...` calls (begin, step-nodes, watch,
    step-end, end: ~6 a segment) need no torch: root's forked from the light fork server (~0.05 CPU-s a
    call instead of a fresh interpreter's ~0.3; CI ran ~190 fresh ones); another user's job (`user`),
    or forking off: MEGALAUNCH (the server's socket is root's). The shim passes on every signal and leaves
    as its child did (tests/support/forkshim.py)."""
    if not _root_forks(user):
        return MEGALAUNCH
    from tests.support import forkserver

    return _cli_wrapper(forkserver.cli_python())


def _root_forks(user: str | None) -> bool:
    """Whether `user`'s processes may come from the tests' fork servers: root's only (their sockets are root's)."""
    return user in (None, getpass.getuser()) and os.geteuid() == 0


def _cli_wrapper(python: str) -> str:
    """A `megalaunch` script beside the fork server's shim `python` that runs the CLI through it."""
    if python == PYTHON:
        return MEGALAUNCH
    wrapper = Path(python).with_name("megalaunch")
    if not wrapper.exists():
        tmp = wrapper.with_name(".megalaunch.part")
        code = "import sys; sys.argv[0] = 'megalaunch'; from megalaunch.cli.main import main; sys.exit(main())"
        tmp.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} -c "{code}" "$@"\n')
        tmp.chmod(0o755)
        tmp.replace(wrapper)
    return str(wrapper)


def counter_recipe(tmp: Path, name: str, *, workload: str = COUNTER, group: str | None = None,
                   user: str | None = None, **sections: dict[str, Any]) -> Path:
    """A Slurm recipe running a stand-in workload with the real runtime module; `user`: who submits it
    (root by default; another user's job cannot use root's fork server: job_cli)."""
    # the checkout may sit where other users cannot read (CI clones anywhere): copy the workload
    local_workload = tmp / Path(workload).name
    local_workload.write_text(Path(workload).read_text())
    local_workload.chmod(0o644)
    recipe: dict[str, Any] = {
        "include": ["tiny"], "name": name, "workload": [PYTHON, str(local_workload)],
        "run": {"root": str(tmp / "runs"), **({"group": group} if group else {})},
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": "00:03:00", "python": PYTHON, "megalaunch": job_cli(user),
                    "env": {"COUNTER_STEP_S": "0.05"}},
        "checkpoint": {"save_time_estimate_s": 1, "save_interval": 100},
        # lead = save 1 + step 0.5 + Slurm's 30 s check + margin 29 = 61 s (FACTS: use >= 60 s)
        # in-job restarts off: these tests follow a failure to the segment's end (test_restart_slurm.py: on)
        "chain": {"step_time_estimate_s": 0.5, "signal_margin_s": 29, "min_train_time_s": 20,
                  "restarts_per_segment": 0},
    }
    for key, value in sections.items():
        recipe.setdefault(key, {})
        if isinstance(recipe[key], dict):
            recipe[key].update(value)
        else:
            recipe[key] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def megalaunch(user: str | None, *args: str, cwd: Path | None = None, timeout: float = 120):
    """`megalaunch ARGS` as `user`, running this checkout's code (PYTHONPATH; sbatch exports it to the
    jobs it submits, so they run this code too, also where the venv's megalaunch is another checkout).
    Root's calls are forked from the tests' light fork server, which runs this checkout's code too (the CLI
    imported once: ~0.05 CPU-s a call instead of a fresh interpreter's ~0.5; CI made ~90 such calls); the
    call still gets only the clean environment below, its own working directory and streams, and a timeout
    kills it. Other users' calls are fresh interpreters (the server's socket is root's)."""
    env = {"PYTHONPATH": str(REPO / "src")}
    if cwd:
        env["XDG_STATE_HOME"] = str(cwd / f".state-{user or 'root'}")
    return run_as(user, [*cli_argv(user), *args], env, cwd=cwd, timeout=timeout)


def cli_argv(user: str | None = None) -> list[str]:
    """The command that runs `megalaunch` for `user` (see megalaunch())."""
    if _root_forks(user):
        from tests.support import forkserver

        python = forkserver.cli_python()
        if python != sys.executable:
            return [python, "-m", "megalaunch.cli.main"]
    return [MEGALAUNCH]


def run_dir_of(tmp: Path) -> Path:
    dirs = [p for p in (tmp / "runs").iterdir() if not p.name.startswith(".")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def ledger(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "state" / "ledger.jsonl").read_text().splitlines() if line.strip()]


def submitted_ids(run: Path) -> list[str]:
    return [e["job_id"] for e in ledger(run) if e["event"] == "submitted"]
