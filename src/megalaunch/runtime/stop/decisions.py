"""The stop/save decision protocol (docs/architecture.md, "Triggers"; docs/training.md).

Every `trigger_interval` iterations (and at the last one) each rank folds its stop-signal flag, and
rank 0 the trigger files, into one `Decision`; one all-reduce MAX makes it the same on every rank.
`at_boundary` says what that decision means at the step boundary (save now, let Megatron save and
leave, leave without saving); `acted` logs it on every rank and, on rank 0, consumes the triggers it
satisfied and appends the `decision` ledger record; `verdict` turns the strongest decision taken into
the segment's outcome."""

from __future__ import annotations

from dataclasses import dataclass

from megalaunch.rundir.triggers import Decision, TriggerBox, decide
from megalaunch.runtime.observation.timeline import Timeline
from megalaunch.runtime.rank.context import RankContext
from megalaunch.runtime.rank.hooks import SaveKind
from megalaunch.runtime.stop.signals import SignalFlag

_ACTIONS = {Decision.SAVE: "saved a checkpoint and continues", Decision.SIGNAL: "saved on the stop signal, exiting",
            Decision.EXIT: "saved on the exit trigger, exiting", Decision.ABORT: "aborting without a save"}
_AFTER_SAVE = {Decision.SAVE: "came during the save just written, which satisfies it",
               Decision.SIGNAL: "came during the save just written: exiting with it, no second save",
               Decision.EXIT: "exit trigger came during the save just written: exiting with it, no second save",
               Decision.ABORT: "aborting (the save just written stays)"}


@dataclass(frozen=True, kw_only=True)
class DecisionConfig:
    trigger_interval: int = 1
    """Look for triggers (and the signal flag) every this many iterations."""
    train_iters: int
    """The last iteration: always a decision point, and the line between `finished` and the rest."""
    stop_signal: str = "SIGUSR2"
    """The signal's name, as the outcome's reason shows it."""


@dataclass(frozen=True)
class Boundary:
    """What a decision asks of the loop at the step boundary where it was taken."""

    save_now: bool  # a `save` between Megatron's own saves: checkpoint before Megatron's check
    leave: bool  # Megatron saves (signal, exit) and leaves its loop
    abort: bool  # leave at once, without a save
    save_kind: SaveKind  # why any checkpoint written at this boundary is written


def at_boundary(decision: Decision, iteration: int, save_interval: int | None, owed: bool = False) -> Boundary:
    """`owed`: a periodic save deferred at an earlier boundary (runtime/stop/save_pacing.py) is tried
    again here, when nothing else saves at this boundary."""
    on_interval = bool(save_interval) and iteration % int(save_interval or 1) == 0
    kinds: dict[Decision, SaveKind] = {Decision.SAVE: "trigger", Decision.SIGNAL: "stop", Decision.EXIT: "stop"}
    kind = kinds.get(decision, "periodic")
    save_now = (decision == Decision.SAVE or (decision == Decision.CONTINUE and owed)) and not on_interval
    return Boundary(save_now=save_now, leave=decision >= Decision.SIGNAL, abort=decision == Decision.ABORT,
                    save_kind=kind)


class Decisions:
    """One rank's side of the protocol, and the strongest decision taken in this segment."""

    def __init__(self, ctx: RankContext, config: DecisionConfig, flag: SignalFlag, timeline: Timeline) -> None:
        self.ctx = ctx
        self.config = config
        self.flag = flag
        self.timeline = timeline
        self.decision = Decision.CONTINUE
        self.decision_iteration: int | None = None

    def decide(self, iteration: int, force: bool = False) -> int:
        """A collective at the decision points (every rank reaches the same ones); CONTINUE elsewhere.
        `force`: decide now whatever the interval (right after a save: every rank saved, so every rank
        is here)."""
        c = self.config
        from megalaunch.runtime.rank.gates import gates_say_decide

        # a flow's data gate (runtime/rank/gates.py) may stop here, or have its wait cut short by the signal
        force = gates_say_decide(iteration, lambda: self.flag.received) or force
        if not force and iteration % max(1, c.trigger_interval) != 0 and iteration < c.train_iters:
            return Decision.CONTINUE
        from megalaunch.runtime.rank.collectives import all_reduce_max

        local = decide(TriggerBox(self.ctx.paths) if self.ctx.is_zero else None, self.flag.received)
        return all_reduce_max(int(local))

    def acted(self, decision: int, iteration: int, after_save: bool = False, left_with: int | None = None) -> None:
        """`after_save`: the decision came during the save just written at `iteration`, which
        satisfies it (no second save: no iteration ran since). `left_with`: a stop that left with the
        checkpoint of that earlier iteration, still being written when it came (runtime/stop/save_pacing.py)."""
        d = Decision(decision)
        self.decision = max(self.decision, d)
        self.decision_iteration = iteration
        self.mark_signal()
        if d != Decision.SAVE:
            self.timeline.mark("decision", decision=d.name.lower(), decision_iteration=iteration)
        action = _AFTER_SAVE[d] if after_save else _ACTIONS[d]
        if left_with is not None and d >= Decision.SIGNAL:
            action = f"left with the checkpoint of iteration {left_with} (still being written when it came), exiting"
        self.ctx.log(f"decision {d.name.lower()} at iteration {iteration}: {action}")
        if self.ctx.is_zero:
            self._consume(d, iteration, after_save, left_with)

    def _consume(self, d: Decision, iteration: int, after_save: bool = False, left_with: int | None = None) -> None:
        """Rank 0: move the triggers this decision satisfied to triggers/consumed/, and say so."""
        box = TriggerBox(self.ctx.paths)
        consumed = box.consume_for(d, iteration, self.ctx.job_id)
        if d == Decision.SIGNAL:  # the checkpoint just written also satisfies a pending `save`
            rec = box.consume("save", iteration, self.ctx.job_id)
            consumed += [rec] if rec else []
        self.ctx.ledger("decision", decision=d.name.lower(), iteration=iteration,
                        triggers=[c.get("verb") for c in consumed], signal=self.flag.received,
                        **({"during_save": True} if after_save else {}),
                        **({"checkpoint": left_with} if left_with is not None else {}))

    def mark_signal(self) -> None:
        """The stop signal's arrival on the timeline (once; when it came, not when it was noticed)."""
        if self.flag.received_at is not None:
            self.timeline.mark("signal_received", self.flag.received_at)

    def verdict(self, iteration: int, *, exited_early: bool) -> tuple[str, str | None]:
        """The segment's status and reason, from the strongest decision and how far training got."""
        c, at = self.config, self.decision_iteration
        if self.decision == Decision.ABORT:
            return "aborted", f"abort trigger at iteration {at}"
        if iteration >= c.train_iters:
            return "finished", None
        if self.decision == Decision.EXIT:
            return "exited", f"exit trigger at iteration {at}"
        if self.decision == Decision.SIGNAL:
            return "saved", f"{c.stop_signal} at iteration {at}"
        how = "exited" if exited_early else "returned"
        return "failed", f"Megatron {how} at iteration {iteration} before train_iters {c.train_iters}"
