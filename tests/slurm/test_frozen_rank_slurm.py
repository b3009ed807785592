"""A frozen rank on a live node (issue 50): with default hang settings (`chain.hang_timeout_s: auto`,
runtime/health/hang_limit.py) and 1 s steps, rank 1's trainer is stopped with SIGSTOP mid-training and never
resumed. Its node stays up and its process stays alive, so nothing but the hang limit can notice: no exit
code, no lost node, no dead socket. The other ranks wait in the step's collective; their watchdogs, with
the measured limit between saves (max(10 x 1 s, 45 s) = 45 s, checked every 4.5 s, 10 s of grace), write
their stacks and outcome `hung` and exit; srun ends the step (the stopped process too) and, since a hang is
a failure a restart can fix (`chain.restarts_per_segment`, default 2), the same job starts a new step that
trains from the newest checkpoint. Asserted: all of that, within 120 s of the freeze (measured, printed).

The trainer is the stand-in (MEGALAUNCH_TEST_STAND_IN=1, runtime/standin.py): the real entry, Session,
watchdog, heartbeat, outcome and job script, with a TCP star for the collectives, so the time measured is
megalaunch's, not torch's imports. 2 nodes x 2 ranks: rank 1 shares node1 with rank 0."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import wait_for
from launch import MEGALAUNCH, PYTHON, ledger, megalaunch, run_dir_of, submitted_ids

from megalaunch.runtime.rank.dist_env import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("node_names_resolve")]

STEP_S = 1.0
WITHIN_S = 120.0  # the acceptance: freeze -> hung recorded -> ranks exited -> training again


def _recipe(tmp: Path) -> Path:
    recipe: dict[str, Any] = {
        "include": ["tiny"], "name": "frozen", "run": {"root": str(tmp / "runs")},
        "cluster": {"backend": "slurm", "nodes": 2, "gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 1,
                    "time": "00:10:00", "python": PYTHON, "megalaunch": MEGALAUNCH, "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STAND_IN": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": str(STEP_S),
                            "OMP_NUM_THREADS": "1"}},
        "training": {"train_iters": 100000, "log_interval": 5, "micro_batch_size": 1, "global_batch_size": 4},
        "checkpoint": {"save_interval": 10, "keep_last": 3},
        # the hang settings are the defaults (tiny.yaml sets none: auto), restarts too
    }
    path = tmp / "frozen.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def _events(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in ledger(run) if e["event"] == name]


def _progress(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text()).get("iteration") or 0)
    except (OSError, ValueError):
        return 0


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _trainer(job: str, rank: int) -> int | None:
    """The trainer process of `rank` in Slurm job `job` (not its task supervisor): by its environment."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (f"SLURM_JOB_ID={job}".encode() in environ and f"SLURM_PROCID={rank}".encode() in environ
                and "megalaunch.runtime.train" in cmd and "megalaunch.runtime.task" not in cmd):
            return int(entry.name)
    return None


def _trains_again(run: Path, job: str, after: float) -> float | None:
    """When the job's new step finished its first iteration (its timeline; the old step's is moved aside)."""
    phases = (_read(run / "state" / "timeline" / f"{job}.json") or {}).get("phases") or {}
    first = phases.get("first_iteration_end")
    return float(first) if isinstance(first, (int, float)) and first > after else None


@pytest.mark.timeout(420)
def test_a_frozen_rank_ends_as_hung_with_stacks_and_training_resumes_within_two_minutes(slurm_tmp: Path) -> None:
    proc = megalaunch(None, "submit", str(_recipe(slurm_tmp)), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    victim: int | None = None
    try:
        first = submitted_ids(run)[0]
        wait_for(lambda: _progress(run) >= 15, 180, interval=0.5, what="iteration 15 (a checkpoint at 10)")
        limits = wait_for(lambda: (lim := _read(run / "state" / "hang_limit" / f"{first}.json"))
                          and lim.get("in_python_s") == 45.0 and lim, 30, what="the measured hang limits")
        victim = _trainer(first, 1)
        assert victim is not None, f"no trainer of rank 1 in job {first}"
        frozen_at = time.time()
        os.kill(victim, signal.SIGSTOP)  # never resumed: Slurm's SIGKILL at the step's end takes it
        hung = wait_for(lambda: _events(run, "hung"), 110, interval=0.5, what="outcome hung")[0]
        restart = wait_for(lambda: _events(run, "restart"), 60, interval=0.5, what="the in-job restart")[0]
        again = wait_for(lambda: _trains_again(run, first, frozen_at), 90, interval=0.5,
                         what="the new step's first iteration")
        took = again - frozen_at
        print(f"rank 1 frozen at iteration ~{hung['iteration']}: hung recorded {hung['time'] - frozen_at:.1f} s "
              f"later, the restart decided at {restart['time'] - frozen_at:.1f} s, training again at {took:.1f} s "
              f"(limits: {limits['in_python_s']:g} s between saves, {limits['in_python_save_s']:g} s during a save)")
    finally:
        megalaunch(None, "cancel", str(run), cwd=slurm_tmp)
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)  # in case the step did not end (a failed assertion)
    assert took < WITHIN_S, took
    assert 45.0 <= hung["time"] - frozen_at <= 45.0 + 2 * 4.5 + 5, (hung, frozen_at)  # limit + a check, loaded
    assert re.search(r"\(hang_timeout 45 s; auto, between saves: max\(10 x step 1(\.\d+)? s, 45 s\)\) on rank 0",
                     hung["reason"]), hung
    assert restart["after"] == "hung" and str(restart["job_id"]) == first and restart["step"] == 1, restart
    assert restart["checkpoint_iteration"] >= 10, restart
    # every rank but the frozen one dumped its stacks: waiting in the step's collective for rank 1 (the frozen
    # one may add its own after the step's end: Slurm sends SIGCONT with the SIGTERM that ends a step)
    stacks = {r: run / "debug" / f"stacks-job{first}-rank{r}.txt" for r in (0, 2, 3)}
    for rank in (0, 2, 3):
        text = stacks[rank].read_text() if stacks[rank].exists() else ""
        assert "no progress for" in text and f"on rank {rank}" in text, (rank, text[:400])
        assert "exchange" in text or "all_reduce_max" in text, (rank, text)  # runtime/standin_group.py
