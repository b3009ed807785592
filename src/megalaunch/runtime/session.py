"""One segment of training on one rank: the rooms the Megatron seams report into, composed.

- `decisions` (runtime/stop/decisions.py): the stop signal and the triggers folded into one decision,
  the same on every rank; what it asks of the loop; the segment's verdict.
- `checkpoints` (runtime/checkpoint/checkpoints.py): the checkpoint to load, every save's hooks, retention.
- `observe` (runtime/observation/observe.py): timeline and heartbeat, watchdog beats, progress and metrics, the
  health check, stragglers, W&B.
- `window` (runtime/stop/stop_window.py): the signal window at the end of the segment, in which a periodic
  save is skipped (the stop save takes its place).
- `pacing` (runtime/stop/save_pacing.py): a periodic save due while an asynchronous one is still writing is
  deferred, not blocked; a stop during such a write may leave with it.

Each room is built from its own slice of RuntimeSettings. `Session` implements the seams' and the step's
protocols (runtime/rank/hooks.py) by calling the rooms in a fixed order and holds nothing of its own. The
entry (runtime/train.py) hands the rooms what it makes later: the observer its watchdog, profiler and
step timer, the checkpoints room its eval queue."""

from __future__ import annotations

from typing import Any

from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import current_job_id
from megalaunch.runtime.checkpoint.checkpoints import CheckpointConfig, Checkpoints
from megalaunch.runtime.checkpoint.readahead import ReadAhead
from megalaunch.runtime.observation.observe import ObserveConfig, Observer
from megalaunch.runtime.rank.context import RankContext
from megalaunch.runtime.rank.fault_hooks import FaultHooks
from megalaunch.runtime.rank.hooks import SaveKind
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.stop import save_pacing
from megalaunch.runtime.stop.decisions import DecisionConfig, Decisions
from megalaunch.runtime.stop.save_pacing import PacingConfig, SavePacing
from megalaunch.runtime.stop.signals import SignalFlag
from megalaunch.runtime.stop.stop_window import StopWindow, WindowConfig


def decision_config(s: RuntimeSettings) -> DecisionConfig:
    return DecisionConfig(trigger_interval=s.trigger_interval, train_iters=s.train_iters, stop_signal=s.stop_signal)


def checkpoint_config(s: RuntimeSettings, resume_from: int | None) -> CheckpointConfig:
    return CheckpointConfig(keep_last=s.keep_last, milestone_interval=s.milestone_interval, resume_from=resume_from,
                            checkpoint_bytes=s.checkpoint_bytes, train_iters=s.train_iters, paced=save_pacing.enabled())


def pacing_config(s: RuntimeSettings) -> PacingConfig:
    return PacingConfig(enabled=save_pacing.enabled(), save_time_estimate_s=s.save_time_estimate_s,
                        train_iters=s.train_iters)


def window_config(s: RuntimeSettings) -> WindowConfig:
    return WindowConfig(lead_s=s.signal_lead_s, delay_s=s.signal_delay_s)


def observe_config(s: RuntimeSettings) -> ObserveConfig:
    return ObserveConfig(train_iters=s.train_iters, log_interval=s.log_interval, profile_window=s.profile_window,
                         health_check=s.health_check, health_check_margin=s.health_check_margin,
                         node_health_dir=s.node_health_dir, straggler_threshold=s.straggler_threshold,
                         run_name=s.run_name, wandb_project=s.wandb_project, wandb_entity=s.wandb_entity,
                         wandb_mode=s.wandb_mode,
                         sequences_per_sample=2 if (s.post_training or {}).get("method") in ("dpo", "ipo") else 1)


class Session:
    def __init__(self, paths: RunPaths, settings: RuntimeSettings, flag: SignalFlag, *,
                 rank: int, world: int, resume_from: int | None = None) -> None:
        self.ctx = RankContext(paths, rank, world, current_job_id())
        self.observe = Observer(self.ctx, observe_config(settings))
        self.decisions = Decisions(self.ctx, decision_config(settings), flag, self.observe.timeline)
        self.checkpoints = Checkpoints(self.ctx, checkpoint_config(settings, resume_from))
        self.window = StopWindow(self.ctx, window_config(settings))
        self.pacing = SavePacing(self.ctx, pacing_config(settings))
        self.faults = FaultHooks.from_env(rank)
        self.readahead: ReadAhead | None = None  # runtime/checkpoint/readahead.py, started by runtime/train.py

    # --- what the entry reads -----------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self.observe.iteration

    def verdict(self, exited_early: bool) -> tuple[str, str | None]:
        return self.decisions.verdict(self.observe.iteration, exited_early=exited_early)

    # --- the seams' hooks (runtime/hooks.LoopHooks) -------------------------------------------------------
    def phase(self, name: str) -> None:
        self.observe.phase(name)

    def distributed_ready(self) -> None:
        self.observe.distributed_ready()

    def evaluation(self, what: str) -> None:
        self.observe.evaluation(what)

    def decide(self, iteration: int, force: bool = False) -> int:
        return self.decisions.decide(iteration, force)

    def acted(self, decision: int, iteration: int, after_save: bool = False) -> None:
        self.decisions.acted(decision, iteration, after_save, left_with=self.pacing.left_with)

    def save_owed(self, iteration: int) -> bool:
        return self.pacing.owes()

    def leave_with_written(self, iteration: int, kind: SaveKind, writing: int) -> bool:
        return self.pacing.leave_with(iteration, kind, writing)

    def before_save(self, iteration: int, kind: SaveKind) -> bool:
        periodic = kind == "periodic" and not self.checkpoints.needed(iteration, kind)
        # a periodic save due while another is still writing waits for the next step, not for that write
        if periodic and not self.pacing.periodic(iteration):
            return False
        # inside the signal window the stop save takes a periodic save's place; at train_iters none comes
        if (periodic and self.window.skip_periodic(iteration)) or not self.checkpoints.before_save(iteration, kind):
            self.pacing.dropped()
            return False
        self.pacing.going_ahead(iteration, kind)
        self.pacing.save_started(iteration)
        self.observe.save_started(iteration)
        self.faults.slow_save(kind, self.ctx)  # test hook: a slow filesystem, inside the timed save
        return True

    def after_save(self, iteration: int, complete: bool = True) -> None:
        elapsed = self.checkpoints.save_finished()
        self.pacing.save_returned(iteration, complete)
        self.observe.save_finished(iteration, elapsed)
        if complete:
            self.save_complete(iteration)
        # the save's interval on the timeline includes retention when it ran here: deleting blocks too
        self.observe.save_recorded(iteration, self.checkpoints.save_span())

    def save_complete(self, iteration: int) -> None:
        """The checkpoint is complete on disk: right after a synchronous save; an asynchronous one's
        when Megatron finalizes it (progress, the eval, retention wait for that)."""
        self.checkpoints.after_save(iteration, self.observe.save_blocking_s(iteration))
        self.observe.save_written(iteration)
        self.pacing.save_complete(iteration)

    def save_waited(self, iteration: int, begin: float, end: float) -> None:
        """The segment waited for the asynchronous save of `iteration` to complete (before a stop save,
        leaving, at the end of Megatron's loop): save time, on the timeline and in the outcome."""
        self.checkpoints.save_waited(end - begin)
        self.observe.save_waited(iteration, begin, end)
        self.pacing.waited()

    def on_log(self, iteration: int, loss: Any, lr: Any, grad_norm: Any, extra: dict[str, Any] | None = None) -> None:
        self.observe.on_log(iteration, loss, lr, grad_norm, extra)

    def on_iteration(self, iteration: int, flops_so_far: float) -> None:
        from megalaunch.runtime.loop import save_staging

        save_staging.release()  # after the first iteration: the checkpoint writer pins its staging memory
        self.pacing.iteration_ended()
        self.observe.iteration_ended(iteration)
        self.faults.pace()  # test hook: a slow step, before the watchdog's beat and the decision
        self.observe.report(iteration, flops_so_far)

    def choose_checkpoint(self) -> int | None:
        self.observe.phase("load_start")
        return self.checkpoints.choose()

    def load_failed(self, iteration: int, error: BaseException) -> int | None:
        return self.checkpoints.load_failed(iteration, error)

    def loaded(self, iteration: int, consumed_samples: int) -> None:
        self.observe.loaded(iteration, consumed_samples)
        self.checkpoints.loaded(iteration, consumed_samples)
        if self.readahead is not None:  # runtime/checkpoint/readahead.py: how much of the load it had read already
            figures = self.readahead.figures()
            self.ctx.log(f"checkpoint read-ahead of {figures['directory']}: {figures['read_bytes'] / 1e9:.2f} of "
                         f"{figures['bytes'] / 1e9:.2f} GB in {figures['seconds']} s"
                         + ("" if figures["done"] else " (still reading when the load ended)"))
            self.ctx.ledger("readahead", **figures)

    # --- the step's hooks (runtime/hooks.StepHooks) --------------------------------------------------------
    def maybe_hang(self) -> None:
        self.faults.maybe_hang(self.observe.iteration, self.ctx)

    def forward_begin(self) -> None:
        self.observe.forward_begin()
        self.faults.slow_forward()

    def forward_end(self) -> None:
        self.observe.forward_end()
