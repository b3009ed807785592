"""Rank 0's sign of life in a segment: RUN/state/heartbeat/<job>.json, watched from outside Python by
runtime/hangwatch.py. Standard library only.

Rank 0 beats at every phase of the timeline (imports, rendezvous, model build, checkpoint load, data,
the first iteration), at the start and end of every save, and at most every BEAT_INTERVAL_S while
iterations run (one small atomic write: the run directory is on a shared file system). Rank 0 alone
suffices: from the rendezvous on, a rank that is stuck stops rank 0 at its next collective, and a rank
stuck before the rendezvous keeps rank 0 waiting in it. The task supervisor of rank 0 beats once when
the step starts (`task_start`, with the step id the watcher needs to kill it).

The watcher compares file contents, not clocks: a beat is "the file changed since I last looked", timed
by the watcher's own monotonic clock, so clock skew between nodes does not matter."""

from __future__ import annotations

import os
import time
from typing import Any

from megalaunch.rundir.files import atomic_write_json
from megalaunch.rundir.paths import RunPaths

BEAT_INTERVAL_S = 5.0
# phases after which the segment trains: the watcher's limit becomes hang_timeout (not startup_timeout)
TRAINING_PHASES = frozenset({"first_iteration_end", "iteration", "save_start", "save_end", "signal_received",
                             "decision", "exit"})


class Heartbeat:
    """Writes the heartbeat of one segment (only where `enabled`: rank 0)."""

    def __init__(self, paths: RunPaths, job_id: str | None, *, enabled: bool) -> None:
        self.path = paths.heartbeat(job_id or f"pid{os.getpid()}")
        self.enabled = enabled and job_id is not None
        self._last = 0.0
        self._seq = 0

    def beat(self, phase: str, *, iteration: int | None = None, force: bool = True, **extra: Any) -> None:
        """A sign of life; `force=False` (every iteration) writes at most every BEAT_INTERVAL_S."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < BEAT_INTERVAL_S:
            return
        self._last = now
        self._seq += 1
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, {"phase": phase, "iteration": iteration, "seq": self._seq,
                                          "pid": os.getpid(), "host": os.uname().nodename, "time": time.time(),
                                          "step_id": os.environ.get("SLURM_STEP_ID"), **extra})
        except OSError:
            pass  # a sign of life must never take training down; the watcher's limit is minutes


def task_start_beat(paths: RunPaths, job_id: str) -> None:
    """Rank 0's task supervisor: the step runs (every beat names the step, for `scancel JOB.STEP`)."""
    Heartbeat(paths, job_id, enabled=True).beat("task_start")
