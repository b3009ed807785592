"""Save pacing (issue #50): a save never waits behind another save's asynchronous write when it need not.

Megatron's persistent checkpoint writer is one process that takes requests in order: a new asynchronous
save hands its state over (`PersistentAsyncCaller.schedule_async_call`: `preload_q.join()`) only when the
writer has finished the previous request's write. So a periodic save that came due while the previous
one was still writing blocked training for the rest of that write (7.8 and 12.3 s on one H200), and a
stop save waited for it and then wrote again (24 s).

- **A periodic save due while an asynchronous save is still writing is deferred**: training goes on, and
  the save is owed: tried again at every following step boundary, taken at the first one after that write
  is complete (ledger `save_deferred` when it is first deferred, `deferred_save_taken` when it goes). The
  bound: it is deferred for at most `deferral_bound_s` (the larger of twice the longest write measured
  in this segment and `checkpoint.save_time_estimate_s`) from when it first came due; past that it goes
  ahead and waits for the write as before. A write slower than that is not a slow disk but a stuck or
  starved writer: waiting then stops the iterations, so the hang watchdog sees it, instead of training on
  for hours with no new checkpoint. A stop, final or trigger save that goes ahead meanwhile takes the
  owed one's place.
- **A stop that comes while an asynchronous save of an earlier iteration is writing leaves with that
  save** when the training since it is shorter than a write (the median of the segment's writes): that
  write has to finish before the process exits anyway; writing the stop's own checkpoint after it would
  cost a whole write more, while leaving with it costs redoing the iterations since it, which took less
  time (a save still writing at the stop began less than one write ago, unless that write was unusually
  slow). Resume is exact from that checkpoint (Megatron's own state at its
  iteration); the ledger says `stop_save_replaced` with the iterations to redo, and goodput counts them
  as lost work. The save at `train_iters` is never replaced (the run's last checkpoint).

Every decision is rank 0's (its clock), broadcast, so all ranks save or defer together. Nothing here is
on without asynchronous saves (a synchronous save is complete when it returns: nothing is ever writing).
MEGALAUNCH_SAVE_PACING=0 turns it off (the benchmark's "before")."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Literal

from megalaunch.runtime.rank.context import RankContext
from megalaunch.runtime.rank.hooks import SaveKind

PACING_ENV = "MEGALAUNCH_SAVE_PACING"
WRITE_FACTOR = 2.0  # a write slowed by one other user of the disk (a deletion, another write) takes ~2x
Verdict = Literal["save", "defer", "wait"]


def enabled(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(PACING_ENV, "1") != "0"


def deferral_bound_s(longest_write_s: float | None, estimate_s: float) -> float:
    """How long a periodic save may stay deferred: past it, a write is stuck rather than slow."""
    return max(WRITE_FACTOR * (longest_write_s or 0.0), estimate_s)


def periodic_verdict(*, writing: bool, now: float, due_since: float | None, bound_s: float) -> Verdict:
    """A periodic save (or an owed one) at a step boundary: go ahead, defer it, or go ahead and wait
    (deferred since `due_since` for `bound_s` already)."""
    if not writing:
        return "save"
    if due_since is not None and now - due_since >= bound_s:
        return "wait"
    return "defer"


def leave_with_written(*, kind: SaveKind, iteration: int, writing: int, train_iters: int | None,
                       trained_since_s: float | None, write_s: float | None) -> bool:
    """A stop at `iteration` found the save of `writing` still writing: leave with that one instead of
    writing again, when what it loses (the training since it) is less than what a write costs."""
    if kind != "stop" or writing >= iteration or (train_iters is not None and iteration >= train_iters):
        return False
    return trained_since_s is not None and write_s is not None and trained_since_s < write_s


@dataclass(frozen=True, kw_only=True)
class PacingConfig:
    enabled: bool = True
    """Off: every save waits behind a write in flight, as Megatron does (MEGALAUNCH_SAVE_PACING=0)."""
    save_time_estimate_s: float = 60.0
    """checkpoint.save_time_estimate_s: the least a deferral may last before a save waits after all."""
    train_iters: int | None = None
    """The last iteration: its save is never replaced by one still writing."""


class SavePacing:
    """One rank's view of the asynchronous saves in flight (the same on every rank: Megatron finalizes a
    save on all ranks at the same boundary) and of the periodic save owed, if any."""

    def __init__(self, ctx: RankContext, config: PacingConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.begun: dict[int, float] = {}  # iteration -> when its save began (wall clock)
        self.handed: dict[int, float] = {}  # iteration -> when its blocking part ended
        self.writing: set[int] = set()  # asynchronous saves not complete yet
        self.writes_s: list[float] = []  # each save's write, from its start to its complete checkpoint
        self.boundary_at = 0.0  # when the last iteration ended
        self.owed: int | None = None  # the iteration a deferred periodic save first came due
        self.owed_since = 0.0
        self.left_with: int | None = None  # the save a stop left with instead of its own
        self.at_bound = False  # the periodic save going ahead reached the deferral's bound: it waits for the write

    # --- what the session reports ------------------------------------------------------------------------
    def iteration_ended(self) -> None:
        self.boundary_at = time.time()

    def save_started(self, iteration: int) -> None:
        self.begun[iteration] = time.time()

    def save_returned(self, iteration: int, complete: bool) -> None:
        self.handed[iteration] = time.time()
        if not complete:
            self.writing.add(iteration)

    def save_complete(self, iteration: int) -> None:
        self.writing.discard(iteration)
        begun = self.begun.pop(iteration, None)
        if begun is not None:
            self.writes_s.append(time.time() - begun)
        for old in [i for i in self.handed if i < iteration]:
            del self.handed[old]

    def waited(self) -> None:
        """The segment waited until every asynchronous save was complete (their finalize came first)."""
        self.writing.clear()

    # --- periodic saves -------------------------------------------------------------------------------------
    def owes(self) -> bool:
        """A deferred periodic save is owed at this boundary (every rank knows the same)."""
        return self.owed is not None

    def periodic(self, iteration: int) -> bool:
        """A collective at every periodic (or owed) save: go ahead (True) or defer it (False)."""
        self.at_bound = False
        if not self.config.enabled or not self.writing:  # every rank knows: nothing to agree on
            return True
        verdict: Verdict = "save"
        if self.ctx.is_zero:
            verdict = periodic_verdict(writing=True, now=time.time(), due_since=self.owed_since if self.owed else None,
                                       bound_s=self.bound_s())
        if self.ctx.world > 1:
            from megalaunch.runtime.rank.collectives import broadcast_from_zero

            verdict = ("save", "defer", "wait")[broadcast_from_zero(("save", "defer", "wait").index(verdict))]
        if verdict == "defer":
            self._deferred(iteration)
            return False
        self.at_bound = verdict == "wait"
        return True

    def bound_s(self) -> float:
        return deferral_bound_s(max(self.writes_s, default=None), self.config.save_time_estimate_s)

    def write_s(self) -> float | None:
        """What a write costs now: the median of this segment's (the one just waited for included), so
        that one write stretched by the disk's other users does not decide alone."""
        return statistics.median(self.writes_s) if self.writes_s else None

    def _deferred(self, iteration: int) -> None:
        if self.owed is not None:
            return  # deferred again: recorded once, when it first came due
        self.owed, self.owed_since = iteration, time.time()
        newest = max(self.writing)
        if self.ctx.is_zero:
            so_far = self.owed_since - self.begun.get(newest, self.owed_since)
            self.ctx.log(f"periodic save at iteration {iteration} deferred: the save of iteration {newest} is still "
                         f"being written ({so_far:.1f} s so far); training goes on and the save is taken at the "
                         f"first step after that write is complete (waiting for it after {self.bound_s():.0f} s)")
            self.ctx.ledger("save_deferred", iteration=iteration, kind="periodic", writing=newest,
                            writing_for_s=round(so_far, 2), bound_s=round(self.bound_s(), 1))

    def _taken(self, iteration: int, *, waited: bool, by: str = "periodic") -> None:
        """The owed save is settled: taken now (its own, or a `by` save in its place)."""
        due, self.owed = self.owed, None
        if due is None or not self.ctx.is_zero:
            return
        deferred_s = time.time() - self.owed_since
        how = ("waiting for the write in flight (the deferral's bound)" if waited else
               "the write it waited for is complete" if by == "periodic" else f"the {by} save takes its place")
        self.ctx.log(f"periodic save deferred at iteration {due} taken at iteration {iteration} after "
                     f"{deferred_s:.1f} s: {how}")
        self.ctx.ledger("deferred_save_taken", due=due, iteration=iteration, by=by, waited=waited,
                        deferred_s=round(deferred_s, 2))

    def going_ahead(self, iteration: int, kind: SaveKind) -> None:
        """A save goes ahead (every check passed): the owed one, or one of another kind in its place."""
        if self.owed is not None:
            self._taken(iteration, waited=self.at_bound and kind == "periodic", by=kind)

    def dropped(self) -> None:
        """The owed save was skipped (the signal window, no room): nothing is owed any more."""
        self.owed = None

    # --- the stop ---------------------------------------------------------------------------------------------
    def leave_with(self, iteration: int, kind: SaveKind, writing: int) -> bool:
        """A collective, once the stop has waited for the save of `writing` to complete: leave with it?"""
        if not self.config.enabled:
            return False
        leave = False
        trained = self.boundary_at - self.handed[writing] if writing in self.handed else None
        write = self.write_s()
        if self.ctx.is_zero:
            leave = leave_with_written(kind=kind, iteration=iteration, writing=writing,
                                       train_iters=self.config.train_iters, trained_since_s=trained, write_s=write)
        if self.ctx.world > 1:
            from megalaunch.runtime.rank.collectives import broadcast_from_zero

            leave = bool(broadcast_from_zero(int(leave)))
        if not leave:
            return False
        self.left_with, self.owed = writing, None
        if self.ctx.is_zero:
            assert trained is not None and write is not None
            self.ctx.log(f"the stop at iteration {iteration} leaves with the checkpoint of iteration {writing}, which "
                         f"was still being written: {iteration - writing} iteration(s) ({trained:.1f} s of training) "
                         f"to redo instead of another write (~{write:.1f} s)")
            self.ctx.ledger("stop_save_replaced", iteration=iteration, kind=kind, checkpoint=writing,
                            iterations_lost=iteration - writing, trained_since_s=round(trained, 2),
                            write_s=round(write, 2))
        return True
