"""Rank 0's part of evaluation at milestones: after a save at an eval iteration, queue the iteration
(RUN/evals/<iteration>/state.json) and, where evals are Slurm jobs, submit it from a thread: a
subprocess (`megalaunch eval submit-queued RUN --iteration N`, the one Slurm client) that training
never waits for. On the local backend the chain runs queued evals after the segment (launcher/backends/local.py).
The eval job waits for its checkpoint to be complete (an asynchronous save finalises later)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

from megalaunch.rundir.evals import ACTIVE, EvalPaths
from megalaunch.rundir.files import append_jsonl
from megalaunch.rundir.paths import RunPaths

SUBMIT_TIMEOUT_S = 180.0


class EvalQueue:
    def __init__(self, paths: RunPaths, *, interval: int, submit: list[str] | None, job_id: str | None,
                 log: Callable[[str], None]) -> None:
        self.paths = paths
        self.interval = interval
        self.submit = submit
        self.job_id = job_id
        self.log = log
        self.threads: list[threading.Thread] = []

    def due(self, iteration: int) -> bool:
        return self.interval > 0 and iteration > 0 and iteration % self.interval == 0

    def after_save(self, iteration: int) -> None:
        """Queue `iteration` unless it is already done or under way (a resumed segment saves again)."""
        if not self.due(iteration):
            return
        ep = EvalPaths(self.paths, iteration)
        state = (ep.read_state() or {}).get("state")
        if state == "done" or (state in ACTIVE and state != "queued"):
            return
        if state != "queued":  # queued already (its submission failed): only the submission is retried
            ep.write_state("queued", by=f"job {self.job_id}")
            append_jsonl(self.paths.ledger, {"event": "eval_queued", "time": time.time(), "by_job": self.job_id,
                                             "iteration": iteration})
            self.log(f"eval of iteration {iteration} queued ({ep.root})")
        if self.submit:
            t = threading.Thread(target=self._submit, args=(iteration,), name=f"eval-submit-{iteration}", daemon=True)
            t.start()
            self.threads.append(t)

    def _submit(self, iteration: int) -> None:
        argv = [*(self.submit or []), str(iteration)]
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S,
                               stdin=subprocess.DEVNULL)
            text = (p.stdout + p.stderr).strip().splitlines()
            self.log(f"eval of iteration {iteration}: " + (text[-1] if text else f"exit status {p.returncode}"))
        except (OSError, subprocess.TimeoutExpired) as e:  # never a reason to stop training
            self.log(f"eval of iteration {iteration} not submitted: {e}; it stays queued "
                     f"(megalaunch eval {self.paths.root} --iteration {iteration})")

    def join(self, timeout_s: float = 60.0) -> None:
        """Before the process leaves (fast exit): let submissions in flight finish."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
