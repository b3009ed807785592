"""Where megalaunch plugs into Megatron's training loop. Everything here touches Megatron's private
names, so it lives in one module, is checked against the pinned version, and is covered by
tests/megatron (a Megatron upgrade breaks those tests, not a training run). The hooks it calls are
runtime/hooks.LoopHooks (runtime/session.Session); the other changes to Megatron (start-up speed-ups,
bug fixes of 0.19.2) are runtime/loop/megatron_patches.py's.

Seams (megatron-core 0.19.2, `megatron.training`):
- `global_vars._set_signal_handler` -> `CollectiveSignalHandler`: Megatron asks it "was the exit
  signal received?" once per iteration (its all-gather). We answer from one all-reduce MAX of a
  `Decision` (signal flag on every rank + trigger files on rank 0), computed in the wrapper below.
- `training.checkpoint_and_decide_exit` -> decide once per iteration, then (runtime/decisions.at_boundary):
  `save` checkpoints and continues, `signal`/`exit` let Megatron save and exit, `abort` exits without saving.
  Megatron checks the signal *before* its periodic save: a stop that arrives during that save would be
  seen one iteration later and cost a second save. So after any save at a boundary we decide again at
  once (every rank does: the save was collective) and a stop leaves with the checkpoint just written.
- `training.save_checkpoint_and_time` -> hooks before/after every save (watchdog, retention); the hook
  before may skip the save. A save the segment leaves with (stop, final, at train_iters) returns only
  when its checkpoint is complete: an asynchronous one is finalized inside it, so its interval runs
  from the decision to the complete checkpoint (docs/goodput.md: `checkpoint_save`, not `exit`).
- `checkpointing.schedule_async_save` -> an asynchronous save is complete only when Megatron finalizes
  it (every rank, at a later iteration or before leaving its loop): `save_complete` runs as its last
  finalize step, after Megatron's tracker update; a synchronous save is complete when it returns.
- `training.maybe_finalize_async_save` -> every wait for an asynchronous save to complete (before a
  stop save, when a stop leaves with the save just scheduled, at the end of the loop) is save time:
  `save_waited`.
- `training.training_log` -> the reduced loss of each iteration (progress, W&B).
- `training.load_checkpoint` -> choose the checkpoint to resume from (complete ones only) and fall
  back to an older one if loading fails.
- `initialize._initialize_distributed` / `_compile_dependencies` -> start-up phases, the health check.
- `training.evaluate_and_print_results` -> evaluations during training beat (runtime/loop/eval_seam.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from megalaunch.runtime.loop import eval_seam, save_staging
from megalaunch.runtime.loop.fsdp_patches import complete_optimizer_state, fix_swiglu_state_dict
from megalaunch.runtime.loop.megatron_patches import (
    check_version,
    fix_optimizer_step,
    in_process_write_results,
    null_tokenizer_without_transformers,
    skip_helper_compilation,
    skip_unused_fusion_warmup,
)
from megalaunch.runtime.model.megatron_import import import_megatron
from megalaunch.runtime.rank.fault_hooks import cpu_async_saves, slow_writer
from megalaunch.runtime.rank.hooks import LoopHooks, SaveKind


def install(hooks: LoopHooks) -> None:
    """Install every seam for this process (call once, before `pretrain`)."""
    import_megatron()
    check_version()
    cpu_async_saves()  # test hook (MEGALAUNCH_TEST_CPU_ASYNC_SAVE), off unless set
    skip_helper_compilation()
    skip_unused_fusion_warmup()
    _mark_init_phases(hooks)
    null_tokenizer_without_transformers()
    fix_optimizer_step()
    fix_swiglu_state_dict()
    complete_optimizer_state()
    in_process_write_results()
    _install_signal_handler()
    _wrap_checkpoint_and_decide_exit(hooks)
    _wrap_save(hooks)
    _wrap_async_schedule(hooks)
    _wrap_async_finalize(hooks)
    _wrap_training_log(hooks)
    _wrap_load_checkpoint(hooks)
    eval_seam.install(hooks)  # evaluations during training beat (the hang limits)


# --- start-up phases --------------------------------------------------------------------------------

def _mark_init_phases(hooks: LoopHooks) -> None:
    """Split Megatron's initialisation on the timeline: process groups made (`distributed_ready`)
    and the first NCCL collective, a barrier that creates the communicators (`first_collective`)."""
    from megatron.training import initialize as minit

    for name, phase in (("_initialize_distributed", "distributed_ready"), ("_compile_dependencies", "first_collective")):
        original = getattr(minit, name, None)
        if original is None:  # another Megatron layout: no detail, nothing breaks
            continue

        def marked(*args: Any, _original: Any = original, _phase: str = phase, **kwargs: Any) -> Any:
            result = _original(*args, **kwargs)
            if _phase == "distributed_ready":  # before Megatron builds anything: the health check
                hooks.distributed_ready()
            else:
                hooks.phase(_phase)
            return result

        setattr(minit, name, functools.wraps(original)(marked))


# --- the collective decision -------------------------------------------------------------------

class _CollectiveSignalHandler:
    """Stands where Megatron's DistributedSignalHandler stands. It installs no OS handler (the
    entry's SignalFlag already owns the stop signal) and answers `signals_received()` from the
    decision taken for the current iteration, so the loop needs no all-gather of its own."""

    def __init__(self, sig: Any = None) -> None:
        self.sig = sig
        self.exit_requested = False
        self.save_kind: SaveKind = "final"  # why a save now would be written ("final": outside a step boundary)
        self.saved_at: int | None = None  # the iteration of the last save that went ahead (not skipped)
        self.saving: int | None = None  # the iteration being saved right now (inside save_checkpoint_and_time)
        self.scheduled_async = False  # the save in progress was handed to the asynchronous writer
        self.leaving = False  # the save in progress is one the segment leaves with: complete before it returns
        self.unfinished: list[int] = []  # iterations of asynchronous saves not finalized yet, oldest first

    def signals_received(self) -> list[bool]:
        return [self.exit_requested]

    def __enter__(self) -> _CollectiveSignalHandler:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def release(self) -> bool:
        return True


_HANDLER = _CollectiveSignalHandler()


def _install_signal_handler() -> None:
    from megatron.training import global_vars

    def set_signal_handler(exit_signal: Any) -> None:
        _HANDLER.sig = exit_signal
        global_vars._GLOBAL_SIGNAL_HANDLER = _HANDLER

    global_vars._set_signal_handler = set_signal_handler


def _wrap_checkpoint_and_decide_exit(hooks: LoopHooks) -> None:
    from megatron.training import get_args
    from megatron.training import training as mtraining

    from megalaunch.rundir.triggers import Decision
    from megalaunch.runtime.stop.decisions import at_boundary

    original = mtraining.checkpoint_and_decide_exit

    @functools.wraps(original)
    def checkpoint_and_decide_exit(model: Any, optimizer: Any, opt_param_scheduler: Any, iteration: int,
                                   num_floating_point_operations_so_far: float, checkpointing_context: Any,
                                   train_data_iterator: Any) -> bool:
        hooks.on_iteration(iteration, num_floating_point_operations_so_far)
        decision = Decision(hooks.decide(iteration))
        step = at_boundary(decision, iteration, get_args().save_interval, owed=hooks.save_owed(iteration))
        if step.abort:
            hooks.acted(decision, iteration)
            return True
        _HANDLER.save_kind, _HANDLER.exit_requested = step.save_kind, step.leave
        try:
            if step.save_now:
                mtraining.save_checkpoint_and_time(
                    iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context, train_data_iterator=train_data_iterator)
            should_exit = original(model, optimizer, opt_param_scheduler, iteration,
                                   num_floating_point_operations_so_far, checkpointing_context,
                                   train_data_iterator)
        finally:
            _HANDLER.save_kind, _HANDLER.exit_requested = "final", False
        if decision != Decision.CONTINUE:
            hooks.acted(decision, iteration)
        if not should_exit and not step.leave and _HANDLER.saved_at == iteration:
            return _after_boundary_save(hooks, iteration)
        return bool(should_exit)

    mtraining.checkpoint_and_decide_exit = checkpoint_and_decide_exit


def _after_boundary_save(hooks: LoopHooks, iteration: int) -> bool:
    """A periodic or trigger save at this boundary went ahead (on every rank): decide again now, so a
    stop that came during the save leaves with this checkpoint (no iteration ran since it, so a
    second save would add nothing), a `save` trigger is satisfied by it, and an abort leaves."""
    from megalaunch.rundir.triggers import Decision

    again = Decision(hooks.decide(iteration, force=True))
    if again == Decision.CONTINUE:
        return False
    if again >= Decision.SIGNAL:  # leaving with it: its write, if asynchronous, is waited for now
        _finish_async_saves(hooks)
    hooks.acted(again, iteration, after_save=True)
    return again >= Decision.SIGNAL


def _wrap_save(hooks: LoopHooks) -> None:
    from megatron.training import async_utils, get_args
    from megatron.training import training as mtraining

    from megalaunch.runtime.stop import save_pacing

    original = mtraining.save_checkpoint_and_time

    @functools.wraps(original)
    def save_checkpoint_and_time(iteration: int, *args: Any, **kwargs: Any) -> Any:
        kind = _HANDLER.save_kind
        leaving = kind in ("stop", "final") or iteration >= (get_args().train_iters or iteration + 1)
        writing = _HANDLER.unfinished[-1] if leaving and _HANDLER.unfinished else None
        if leaving:
            _finish_async_saves(hooks)  # its space is known and retention may delete what it supersedes
            if writing is not None and hooks.leave_with_written(iteration, kind, writing):
                return None  # the stop leaves with the save that was writing (runtime/stop/save_pacing.py)
        elif kind == "periodic" and save_pacing.enabled():  # a write that is done is finalized (a collective)
            async_utils.maybe_finalize_async_save(blocking=False)  # first, so that the pacing sees it
        if not hooks.before_save(iteration, kind):
            return None
        _HANDLER.saving, _HANDLER.scheduled_async, _HANDLER.leaving = iteration, False, leaving
        save_staging.save_begun()
        try:
            result = original(iteration, *args, **kwargs)
            if leaving and _HANDLER.scheduled_async:  # the segment leaves with it: complete it now, inside
                async_utils.maybe_finalize_async_save(blocking=True)  # its interval (every rank)
        finally:
            _HANDLER.saving, _HANDLER.leaving = None, False
        _HANDLER.saved_at = iteration
        hooks.after_save(iteration, complete=leaving or not _HANDLER.scheduled_async)
        return result

    mtraining.save_checkpoint_and_time = save_checkpoint_and_time


def _finish_async_saves(hooks: LoopHooks) -> None:
    """Every rank, before a save the run cannot do without or when leaving: an asynchronous save still
    writing is finished first (it must finish before the process exits anyway). Then the space check
    sees it complete, and retention may delete the checkpoint it supersedes to make room for this one.
    The wait is save time (hooks.save_waited), for the newest save it waited for."""
    from megatron.training import async_utils

    if async_utils.is_empty_async_queue():
        return
    waited_for = _HANDLER.unfinished[-1] if _HANDLER.unfinished else None
    begin = time.time()
    async_utils.maybe_finalize_async_save(blocking=True)
    if waited_for is not None:
        hooks.save_waited(waited_for, begin, time.time())


def _wrap_async_schedule(hooks: LoopHooks) -> None:
    """An asynchronous save's own last finalize step tells the hooks it is complete (every rank runs
    the finalize steps at the same point: Megatron agrees on completion with an all-reduce first); a
    save the segment leaves with is finalized inside it, and after_save says it is complete."""
    from megatron.training import checkpointing as mcheckpointing

    original = mcheckpointing.schedule_async_save

    @functools.wraps(original)
    def schedule_async_save(async_request: Any) -> Any:
        iteration = _HANDLER.saving
        if iteration is not None:
            _HANDLER.scheduled_async = True
            async_request = slow_writer(async_request, _HANDLER.save_kind)  # test hook, off unless set
            async_request = save_staging.staged(async_request)  # the pinned arena; the write timed
            if not _HANDLER.leaving:
                _HANDLER.unfinished.append(iteration)
                async_request.add_finalize_fn(functools.partial(_completed, hooks, iteration))
        begin = time.monotonic()
        result = original(async_request)  # the hand-off: returns once the writer has staged the state
        if iteration is not None:
            save_staging.handed_over(iteration, begin)
        return result

    mcheckpointing.schedule_async_save = schedule_async_save


def _completed(hooks: LoopHooks, iteration: int) -> None:
    if iteration in _HANDLER.unfinished:
        _HANDLER.unfinished.remove(iteration)
    hooks.save_complete(iteration)


def _wrap_async_finalize(hooks: LoopHooks) -> None:
    """Megatron's own waits at the end of its loop (an abort after an asynchronous save, the last
    iteration's) are save time too; its per-iteration checks (not blocking) pass through."""
    from megatron.training import training as mtraining

    original = mtraining.maybe_finalize_async_save

    @functools.wraps(original)
    def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> Any:
        if blocking:
            _finish_async_saves(hooks)
        return original(blocking=blocking, terminate=terminate)

    mtraining.maybe_finalize_async_save = maybe_finalize_async_save


def _wrap_training_log(hooks: LoopHooks) -> None:
    from megatron.training import training as mtraining

    original = mtraining.training_log

    @functools.wraps(original)
    def training_log(loss_dict: dict[str, Any], total_loss_dict: Any, learning_rate: Any, iteration: int,
                     loss_scale: Any, report_memory_flag: Any, skipped_iter: Any, grad_norm: Any,
                     *args: Any, **kwargs: Any) -> Any:
        # The loss stays a device tensor: converting it would synchronise every iteration.
        hooks.on_log(iteration, loss_dict.get("lm loss") if loss_dict else None, learning_rate, grad_norm,
                     {k: v for k, v in (loss_dict or {}).items() if k != "lm loss"})  # a flow's own metrics
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                        report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)

    mtraining.training_log = training_log


# --- resume: choose a complete checkpoint, fall back when a load fails ------------------------

def _wrap_load_checkpoint(hooks: LoopHooks) -> None:
    from megatron.training import get_args
    from megatron.training import training as mtraining

    from megalaunch.runtime.rank.collectives import any_rank

    original = mtraining.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        margs = get_args()
        chosen = hooks.choose_checkpoint()  # None: no checkpoint, and no tracker: from scratch
        for attempt in (1, 2):
            margs.ckpt_step = chosen
            error: BaseException | None = None
            try:
                result = original(*args, **kwargs)
            except Exception as e:  # a shard that reads garbage, a pickle that fails...
                error = e
            if not any_rank(error is not None):
                margs.ckpt_step = None
                hooks.loaded(int(result[0]), int(getattr(margs, "consumed_train_samples", 0) or 0))
                return result
            failure = error or RuntimeError(f"loading checkpoint {chosen} failed on another rank")
            # One fallback, to an older complete checkpoint; never to scratch (that would silently
            # throw away the run's progress), and not twice (then the cause is not this checkpoint).
            older = hooks.load_failed(chosen, failure) if chosen is not None and attempt == 1 else None
            if older is None:
                raise failure
            chosen = older
        raise AssertionError("unreachable")

    mtraining.load_checkpoint = load_checkpoint
