"""The job's training step as `job watch` (runtime/hangwatch.py) controls it: Slurm's view of its steps, the job
script's srun, and killing the step through Slurm or, when Slurm does not answer, through that srun. Every
Slurm call is timed and may fail. Standard library only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from megalaunch.runtime.health.procs import proc_stats

SLURM_TIMEOUT_S = 15.0  # one squeue/scancel call
KILL_TRIES = 3
KILL_RETRY_S = 5.0
SRUN_EXIT_WAIT_S = 30.0
SRUN_ABORT_WAIT_S = 2.0  # after a step with a lost node was cancelled
KEEPER_STEP = "megalaunch-keeper"  # the keeper's step name (templates/train.sbatch.j2, launcher/backends/keeper.py)

Run = Callable[..., subprocess.CompletedProcess[str]]


def log(message: str) -> None:
    print(f"megalaunch hangwatch: {message}", file=sys.stderr, flush=True)


class SlurmStep:
    """The job's step as Slurm and this node see it; every Slurm call is timed and may fail (None/False)."""

    def __init__(self, job_id: str, shell_pid: int, run: Run = subprocess.run) -> None:
        self.job_id = job_id
        self.shell_pid = shell_pid
        self._run = run

    def _slurm(self, args: Sequence[str]) -> str | None:
        try:
            p = self._run(list(args), capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"{args[0]} did not answer: {e}")
            return None
        if p.returncode != 0:
            log(f"{' '.join(args)} failed ({p.returncode}): {(p.stderr or '').strip()[:200]}")
            return None
        return p.stdout

    def job_state(self) -> str | None:
        out = self._slurm(["squeue", "--noheader", "--jobs", self.job_id, "--format=%T"])
        return out.split()[0] if out and out.split() else None

    def step_ids(self) -> list[str]:
        """The job's steps but the keeper's (its step is named KEEPER_STEP: it outlives every training step)."""
        out = self._slurm(["squeue", "--noheader", "--steps", "--jobs", self.job_id, "--format=%i %j"]) or ""
        rows = [line.split(None, 1) for line in out.splitlines() if line.strip()]
        return [r[0] for r in rows if r[0].partition(".")[2].isdigit() and (r[1:] or [""])[0].strip() != KEEPER_STEP]

    def signal(self, sig: str, step: str) -> bool:
        return self._slurm(["scancel", f"--signal={sig}", step]) is not None

    def cancel(self, step: str) -> bool:
        return self._slurm(["scancel", step]) is not None

    def srun_pids(self) -> list[int]:
        """The job script's srun (its child: the step's launcher on this node), not the keeper's."""
        return [pid for pid, name, fields in proc_stats()
                if name == b"srun" and len(fields) > 1 and int(fields[1]) == self.shell_pid
                and f"--job-name={KEEPER_STEP}".encode() not in _cmdline(pid)]


def _cmdline(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def wait_gone(pids: list[int], timeout_s: float, sleep: Callable[[float], None]) -> bool:
    """Whether every process in `pids` ended within `timeout_s` real seconds. It waits on real processes
    against a real deadline, so it polls in real time: an injected clock's `sleep` (tests) would run that
    clock far ahead while a loaded machine takes seconds to end a process."""
    del sleep  # kept for the callers' signature; see above
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def kill_step(step: SlurmStep, step_ids: list[str], sleep: Callable[[float], None] = time.sleep) -> str:
    """Kill the step through Slurm; else through the local srun. Returns how it went."""
    sruns = step.srun_pids()
    for attempt in range(KILL_TRIES):
        if step_ids and all(step.signal("KILL", s) for s in step_ids):
            if wait_gone(sruns, SRUN_EXIT_WAIT_S, sleep):
                return f"killed step {', '.join(step_ids)} (scancel --signal=KILL)"
            log("srun still runs after the step was killed")
            break
        if attempt + 1 < KILL_TRIES:
            sleep(KILL_RETRY_S)
            step_ids = step_ids or step.step_ids()
    # Slurm did not answer (or never named the step): srun ends the step itself on two SIGINTs within
    # a second; as the last resort, srun is killed (the job script then goes on to `job end`).
    for pid in sruns:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
            time.sleep(0.2)
            os.kill(pid, signal.SIGINT)
    if wait_gone(sruns, SRUN_EXIT_WAIT_S, sleep):
        return "srun ended the step (two SIGINTs)"
    for pid in sruns:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return "killed srun (SIGKILL)"
