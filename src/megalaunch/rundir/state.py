"""Progress and outcome files written by rank 0 (docs/architecture.md, "The run directory")."""

from __future__ import annotations

import os
import time
from typing import Any

from megalaunch.rundir.files import atomic_write_json, read_json
from megalaunch.rundir.paths import RunPaths

OUTCOMES = ("finished", "saved", "exited", "aborted", "failed", "config_error", "hung", "unhealthy_node",
            "storage_full")


def current_job_id() -> str | None:
    return os.environ.get("MEGALAUNCH_JOB_ID") or os.environ.get("SLURM_JOB_ID")


def write_progress(paths: RunPaths, *, iteration: int, consumed_samples: int | None = None,
                   loss: float | None = None, tokens_per_s: float | None = None,
                   tflops_per_gpu: float | None = None, **extra: Any) -> None:
    atomic_write_json(paths.progress, {
        "iteration": iteration, "consumed_samples": consumed_samples, "loss": loss,
        "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops_per_gpu, "time": time.time(),
        "job_id": current_job_id(), **extra,
    })


def read_progress(paths: RunPaths) -> dict[str, Any] | None:
    return read_json(paths.progress)


def progress_at_save(paths: RunPaths, iteration: int) -> None:
    """After a checkpoint at `iteration`: move the progress file up to it when it lags (it is written
    every log interval; a save on a signal or trigger falls between two), keeping the last measured
    loss and rates, so progress is never behind the checkpoint."""
    current = read_progress(paths) or {}
    if isinstance(current.get("iteration"), int) and current["iteration"] >= iteration:
        return
    kept = {k: v for k, v in current.items() if k not in ("iteration", "time", "job_id")}
    write_progress(paths, **{**kept, "iteration": iteration, "consumed_samples": None})


def shown_iteration(progress: dict[str, Any] | None, checkpoint: int | None) -> int | None:
    """The iteration `status` shows next to the last checkpoint: the progress file's, but never less
    than the checkpoint's (a checkpoint proves at least its iteration; the file may be an older
    segment's, or a trainer's that reports only every log interval)."""
    it = (progress or {}).get("iteration")
    if checkpoint is None or (isinstance(it, int) and it >= checkpoint):
        return it
    return checkpoint


def write_outcome(paths: RunPaths, status: str, *, iteration: int | None = None,
                  reason: str | None = None, kind: str | None = None, job_id: str | None = None,
                  **extra: Any) -> None:
    """The trainer's verdict at exit. `config_error` (also `kind="config"`): no retry can fix it.
    `job_id`: the segment's (default: this process's job, from the environment)."""
    if status not in OUTCOMES:
        raise ValueError(f"outcome {status!r} is not one of {OUTCOMES}")
    atomic_write_json(paths.outcome, {
        "status": status, "iteration": iteration, "reason": reason, "kind": kind,
        "job_id": job_id or current_job_id(), "time": time.time(), **extra,
    })


def read_outcome(paths: RunPaths, job_id: str | None = None) -> dict[str, Any] | None:
    """The outcome file, only if it was written by `job_id` (a stale one from an earlier segment
    says nothing about this one)."""
    data = read_json(paths.outcome)
    if not isinstance(data, dict):
        return None
    if job_id is not None and str(data.get("job_id")) != str(job_id):
        return None
    return data
