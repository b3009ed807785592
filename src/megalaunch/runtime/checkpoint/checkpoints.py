"""The checkpoints room: which checkpoint a segment loads, what happens around every save, and
retention. The file-level rules (what is complete, how unusable ones are moved aside, what retention
deletes) are runtime/checkpoint/resume.py's; this room applies them at the loop's fixed points, rank-aware.

- `choose` (collective): rank 0 plans the resume (moving unusable checkpoints aside), every rank gets
  the same iteration; `load_failed` (collective) falls back once to an older complete checkpoint.
- `loaded`: once every rank has loaded, rank 0 applies retention (segment start).
- `before_save(iteration, kind)` (collective): rank 0 checks the free space for one checkpoint
  (runtime/retention.check_space: retention first when short); every rank gets the same answer. A
  periodic or trigger save that does not fit is skipped (False; ledger `save_skipped`); for a stop or
  final save retention keeps only the newest complete checkpoint next (ledger `retention_squeezed`),
  and one that still does not fit raises SaveDoesNotFit (the segment ends `storage_full`).
- `save_finished` / `after_save`: the blocking time of each save (`save_waited`: and of every wait for an
  asynchronous one to complete); on rank 0 progress moved up to the
  checkpoint, the eval queued, and retention (runtime/retention.keep: the last `keep_last`, plus
  milestones and checkpoints an eval still needs; the one this segment resumed from only until a newer
  one is complete).
- `ended_full`: rank 0, a segment ending `storage_full`: its unfinished save removed, the figures."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from megalaunch.rundir.evals import pending_iterations
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import progress_at_save
from megalaunch.runtime.checkpoint import resume, retention
from megalaunch.runtime.rank.context import RankContext
from megalaunch.runtime.rank.failures import ConfigFailure
from megalaunch.runtime.rank.hooks import SaveKind
from megalaunch.runtime.rank.storage import SaveDoesNotFit, describe, filesystem_of, free_bytes

_UNCHOSEN, _PLAN_FAILED = -1, -2  # broadcast in place of an iteration: from scratch; rank 0 failed to plan
_SAVE, _SKIP, _FULL = 0, 1, 2  # rank 0's space check, broadcast before every save


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    keep_last: int = 2
    """Complete checkpoints retention keeps (newest first); < 1: retention is off."""
    milestone_interval: int = 0
    """Checkpoints at multiples of this are kept for good (0: none)."""
    resume_from: int | None = None
    """`--resume-from ITER`: this checkpoint instead of the newest (newer ones are moved aside)."""
    checkpoint_bytes: int | None = None
    """One checkpoint's predicted bytes (render time): what a save needs before one was measured; None: unknown."""
    train_iters: int | None = None
    """The last iteration: a save there is one the run cannot do without, whatever its kind (like a stop save)."""
    paced: bool = False
    """Save pacing (runtime/stop/save_pacing.py): a periodic or trigger save measures the free space before it
    waits for retention's background deletions, and waits only when the space is short without them."""


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
        self.sizes = retention.Sizes()
        self.no_room: str | None = None  # rank 0: why the stop save did not fit (the outcome's reason)

    # --- load ------------------------------------------------------------------------------------------
    def choose(self) -> int | None:
        """Rank 0 plans (moving unusable checkpoints aside); every rank gets the same answer."""
        from megalaunch.runtime.rank.collectives import broadcast_from_zero

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

        from megalaunch.runtime.rank.collectives import broadcast_from_zero

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
        if self.ctx.is_zero:  # every rank has loaded: retention at segment start, the loaded one kept
            self._retain(protect={iteration} if iteration > 0 else set(), background=True)

    # --- save --------------------------------------------------------------------------------------------
    def before_save(self, iteration: int, kind: SaveKind) -> bool:
        """Every save passes here first, on every rank: False skips it (then `save_finished`/`after_save`
        are not called); a stop or final save that does not fit raises SaveDoesNotFit."""
        from megalaunch.runtime.rank.collectives import broadcast_from_zero

        started = time.monotonic(), time.time()
        verdict = broadcast_from_zero(self._check_space(iteration, kind) if self.ctx.is_zero else _SAVE)
        if verdict == _FULL:
            raise SaveDoesNotFit(self.no_room or f"no room for the {kind} save at iteration {iteration} "
                                                 "(rank 0 measured the free space; its log says how much)")
        if verdict == _SKIP:
            if not self.ctx.is_zero:
                self.ctx.log(f"{kind} save at iteration {iteration} skipped: not enough free space (rank 0's check)")
            return False
        self._save_started, self._save_started_at = started  # the space check and retention are the save's
        return True

    def _check_space(self, iteration: int, kind: SaveKind) -> int:
        """Rank 0: room for one checkpoint (retention first when short)? A failing measurement lets the save go."""
        paths = self.ctx.paths
        needed = self.needed(iteration, kind)
        if needed or not self.config.paced:  # what retention's background deletions free is free before it is measured
            resume.wait_for_deletions()
        try:
            check = retention.check_space(paths.checkpoints, self.sizes.need(paths, self.config.checkpoint_bytes),
                                          stop=needed, make_room=self._retain if needed else self._make_room,
                                          squeeze=self._squeeze, inodes=self.sizes.inodes(paths))
        except OSError as e:
            self.ctx.log(f"free space before the save at iteration {iteration} not measured ({e}): saving")
            return _SAVE
        where = check.where(paths.checkpoints)
        if check.deleted:
            self.ctx.log(f"not enough free space for the save at iteration {iteration}: retention deleted "
                         f"checkpoints {check.deleted} first")
        if check.squeezed:
            self.ctx.log(f"the {kind} save at iteration {iteration} fits only with fewer checkpoints kept: "
                         f"retention kept the newest complete one and deleted {check.deleted}")
            self._ledger("retention_squeezed", iteration=iteration, kind=kind, deleted=check.deleted,
                         keep_last=self.config.keep_last, **_figures(paths, check.free, check.need))
        if check.verdict == "save":
            return _SAVE
        if check.verdict == "skip":
            self.ctx.log(f"{kind} save at iteration {iteration} skipped: not enough free space: {where}; "
                         "training goes on")
            self._ledger("save_skipped", iteration=iteration, kind=kind, **_figures(paths, check.free, check.need),
                         **({"free_inodes": check.inodes[0], "need_inodes": check.inodes[1]} if check.inodes else {}))
            return _SKIP
        self.no_room = f"no room for the {kind} save at iteration {iteration}: {where}"
        self.ctx.log(self.no_room)
        return _FULL

    def needed(self, iteration: int, kind: SaveKind) -> bool:
        """A save the segment cannot go on without: the stop save, the final one, the one at train_iters."""
        last = self.config.train_iters
        return kind in ("stop", "final") or (last is not None and iteration >= last)

    def save_finished(self) -> float:
        """The save just returned: its blocking seconds (recorded for the outcome)."""
        elapsed = time.monotonic() - self._save_started
        self.save_times.append(elapsed)
        return elapsed

    def save_waited(self, seconds: float) -> None:
        """A wait for an asynchronous save to complete: blocking save time too (the outcome's save_times_s)."""
        self.save_times.append(seconds)

    def after_save(self, iteration: int, elapsed: float) -> None:
        """Rank 0: progress up to the checkpoint, the eval queued, retention."""
        if not self.ctx.is_zero:
            return
        paths = self.ctx.paths
        self.ctx.log(f"checkpoint at iteration {iteration}: {elapsed:.2f} s blocking")
        progress_at_save(paths, iteration)  # status never shows progress behind the checkpoint
        if self.evals is not None:
            try:
                self.evals.after_save(iteration)
            except OSError as e:  # an eval never stops training
                self.ctx.log(f"eval of iteration {iteration} not queued: {e}")
        self._retain(background=True)  # unlinking a checkpoint's files (seconds) must not stop training

    def _retain(self, protect: set[int] | None = None, keep_last: int | None = None, background: bool = False) -> list[int]:
        """Rank 0: retention (runtime/retention.keep); an eval still to run keeps its checkpoint.
        `keep_last` lower than the setting: a stop save short of room (`_squeeze`)."""
        deleted = retention.prune(self.ctx.paths, keep_last=self.config.keep_last if keep_last is None else keep_last,
                                  milestone_interval=self.config.milestone_interval,
                                  eval_pending=pending_iterations(self.ctx.paths), resumed_from=self.resumed_from,
                                  protect=protect or set(), job_id=self.ctx.job_id, background=background)
        if deleted:
            self.ctx.log(f"retention: deleted checkpoints {deleted}")
        return deleted

    def _make_room(self) -> list[int]:
        """Rank 0, a periodic or trigger save short of room: the deletions still running first (a deletion
        of 17 GB takes ~7 s: a save that fits without it does not wait for it), then retention."""
        resume.wait_for_deletions()
        return self._retain()

    def _squeeze(self) -> list[int]:
        """Rank 0, a stop save short of room after retention: keep only the newest complete regular
        checkpoint (milestones and those waiting for an evaluation stay); keep_last 0 keeps every save."""
        return self._retain(keep_last=1) if self.config.keep_last >= 1 else []

    def ended_full(self) -> dict[str, Any]:
        """Rank 0, the segment ending `storage_full`: the unfinished save of this segment removed (saves
        newer than every complete one), then the outcome's figures; `where` is the reason's part."""
        paths = self.ctx.paths
        try:
            removed = resume.remove_failed_saves(paths, job_id=self.ctx.job_id)
        except OSError as e:  # the ledger record may not fit; the directory is gone first
            self.ctx.log(f"removing the unfinished save: {e}")
            removed = []
        if removed:
            self.ctx.log(f"storage full: removed the unfinished save of iteration(s) {removed}")
        try:
            need = self.sizes.need(paths, self.config.checkpoint_bytes)[0]
        except OSError:
            need = self.config.checkpoint_bytes
        free = free_bytes(paths.checkpoints)
        return {**_figures(paths, free, need), "removed_saves": removed,
                "where": describe(paths.checkpoints, need or 0, free=free, fix=None)}

    def _ledger(self, event: str, **data: Any) -> None:
        try:
            self.ctx.ledger(event, **data)
        except OSError as e:  # a full filesystem may not take even the ledger's line
            self.ctx.log(f"ledger {event} not written: {e}")

    def save_span(self) -> tuple[float, float]:
        """The last save's (begin, end) in wall-clock time, up to now (retention blocks too)."""
        return self._save_started_at, self._save_started_at + time.monotonic() - self._save_started


def _figures(paths: RunPaths, free: int, need: int | None) -> dict[str, Any]:
    fs = filesystem_of(paths.checkpoints)
    return {"filesystem": fs.device, "mount": fs.mount, "fstype": fs.fstype, "free_bytes": free, "need_bytes": need}
