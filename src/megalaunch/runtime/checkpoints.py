"""The checkpoints room: which checkpoint a segment loads, what happens around every save, and
retention. The file-level rules (what is complete, how unusable ones are moved aside, what retention
deletes) are runtime/resume.py's; this room applies them at the loop's fixed points, rank-aware.

- `choose` (collective): rank 0 plans the resume (moving unusable checkpoints aside), every rank gets
  the same iteration; `load_failed` (collective) falls back once to an older complete checkpoint.
- `before_save(iteration, kind)`: every save passes here first and may be skipped (False); today every
  save goes ahead. A storage check (free space before a save) belongs here.
- `save_finished` / `after_save`: the blocking time of each save; on rank 0 progress moved up to the
  checkpoint, the eval queued, and retention (the last `keep_last` plus milestones, never the checkpoint
  this segment resumed from nor one an eval still needs)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from megalaunch.rundir.evals import pending_iterations
from megalaunch.rundir.state import progress_at_save
from megalaunch.runtime import resume
from megalaunch.runtime.context import RankContext
from megalaunch.runtime.failures import ConfigFailure
from megalaunch.runtime.hooks import SaveKind

_UNCHOSEN, _PLAN_FAILED = -1, -2  # broadcast in place of an iteration: from scratch; rank 0 failed to plan


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    keep_last: int = 2
    """Complete checkpoints retention keeps (newest first); < 1: retention is off."""
    milestone_interval: int = 0
    """Checkpoints at multiples of this are kept for good (0: none)."""
    resume_from: int | None = None
    """`--resume-from ITER`: this checkpoint instead of the newest (newer ones are moved aside)."""


class Checkpoints:
    def __init__(self, ctx: RankContext, config: CheckpointConfig, evals: Any = None) -> None:
        self.ctx = ctx
        self.config = config
        self.evals = evals  # runtime/eval_queue.EvalQueue on rank 0 when evaluation is on
        self.resume_from = config.resume_from  # for the first load attempt only
        self.resumed_from: int | None = None
        self.save_times: list[float] = []
        self._save_started = 0.0  # monotonic
        self._save_started_at = 0.0  # wall clock

    # --- load ------------------------------------------------------------------------------------------
    def choose(self) -> int | None:
        """Rank 0 plans (moving unusable checkpoints aside); every rank gets the same answer."""
        from megalaunch.runtime.collectives import broadcast_from_zero

        chosen, error = _UNCHOSEN, None
        if self.ctx.is_zero:
            try:
                chosen = self._plan()
            except Exception as e:
                chosen, error = _PLAN_FAILED, e
        self.resume_from = None  # only for the first attempt
        chosen = broadcast_from_zero(chosen)
        if chosen == _PLAN_FAILED:
            if error is not None and isinstance(error, ValueError):
                raise ConfigFailure(str(error), "megalaunch resume RUN --from one of the complete checkpoints, "
                                                "or plain megalaunch resume (the newest complete one)")
            raise RuntimeError(f"rank 0 could not choose a checkpoint: {error}" if error else
                               "rank 0 could not choose a checkpoint")
        self.resumed_from = chosen if chosen >= 0 else None
        return self.resumed_from

    def _plan(self) -> int:
        plan = resume.plan_resume(self.ctx.paths, job_id=self.ctx.job_id, requested=self.resume_from)
        for e in plan.events:
            details = {k: v for k, v in e.items() if k not in ("event", "time", "job_id")}
            self.ctx.log(f"resume: {e['event']} {json.dumps(details)}")
        return plan.iteration if plan.iteration is not None else _UNCHOSEN

    def load_failed(self, iteration: int, error: BaseException) -> int | None:
        """A checkpoint passed the completeness check but failed to load: rank 0 moves it aside
        and points the tracker at the next older complete one, if any; every rank gets the same."""
        import traceback

        from megalaunch.runtime.collectives import broadcast_from_zero

        traceback.print_exception(error)
        self.ctx.log(f"resume: checkpoint {iteration} failed to load ({resume.one_line(error)})")
        older = _UNCHOSEN
        if self.ctx.is_zero:
            found = resume.fall_back_from(self.ctx.paths, iteration, error, self.ctx.job_id)
            older = _UNCHOSEN if found is None else found
        older = broadcast_from_zero(older)
        self.ctx.log(f"resume: falling back to checkpoint {older}" if older >= 0 else
                     "resume: no older complete checkpoint to fall back to")
        self.resumed_from = older if older >= 0 else None
        return self.resumed_from

    def loaded(self, iteration: int, consumed_samples: int) -> None:
        if iteration > 0:
            self.ctx.log(f"resumed at iteration {iteration} with {consumed_samples} consumed samples")
            self.ctx.ledger("resumed", iteration=iteration, consumed_samples=consumed_samples)
        else:
            self.ctx.log("starting from scratch")

    # --- save --------------------------------------------------------------------------------------------
    def before_save(self, iteration: int, kind: SaveKind) -> bool:
        """Every save passes here first; False skips it (then `save_finished`/`after_save` are not
        called). Today every save goes ahead; a check of the free space would decide here."""
        self._save_started = time.monotonic()
        self._save_started_at = time.time()
        return True

    def save_finished(self) -> float:
        """The save just returned: its blocking seconds (recorded for the outcome)."""
        elapsed = time.monotonic() - self._save_started
        self.save_times.append(elapsed)
        return elapsed

    def after_save(self, iteration: int, elapsed: float) -> None:
        """Rank 0: progress up to the checkpoint, the eval queued, retention."""
        if not self.ctx.is_zero:
            return
        paths = self.ctx.paths
        self.ctx.log(f"checkpoint at iteration {iteration}: {elapsed:.2f} s blocking")
        progress_at_save(paths, iteration)  # status never shows progress behind the checkpoint
        protect = {self.resumed_from} if self.resumed_from else set()
        if self.evals is not None:
            try:
                self.evals.after_save(iteration)
            except OSError as e:  # an eval never stops training
                self.ctx.log(f"eval of iteration {iteration} not queued: {e}")
            protect |= pending_iterations(paths)  # an eval still to run keeps its checkpoint
        self._retain(protect)

    def _retain(self, protect: set[int]) -> None:
        deleted = resume.prune(self.ctx.paths, keep_last=self.config.keep_last,
                               milestone_interval=self.config.milestone_interval,
                               protect=protect, job_id=self.ctx.job_id)
        if deleted:
            self.ctx.log(f"retention: deleted checkpoints {deleted}")

    def save_span(self) -> tuple[float, float]:
        """The last save's (begin, end) in wall-clock time, up to now (retention blocks too)."""
        return self._save_started_at, self._save_started_at + time.monotonic() - self._save_started
