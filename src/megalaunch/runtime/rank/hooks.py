"""What the training entry hands to Megatron's side: the protocols the seams (runtime/loop/megatron_seams.py)
and the step functions (runtime/loop/step.py) call. Only names and types live here, so that neither side
imports the other (runtime/session.py implements both)."""

from __future__ import annotations

from typing import Any, Literal, Protocol

# Why a checkpoint is written (the seams tell the checkpoints room before every save):
#   periodic  Megatron's own save at a multiple of save_interval, at a step boundary with nothing decided
#   trigger   a `save` trigger at a step boundary
#   stop      the stop signal or an `exit` trigger: the save before the segment leaves
#   final     any save outside a step boundary (Megatron's save after its loop, at train_iters)
SaveKind = Literal["periodic", "trigger", "stop", "final"]


class LoopHooks(Protocol):
    """Called from the seams in Megatron's training loop."""

    # a collective: same Decision on every rank (force: also between trigger_interval's decision points)
    def decide(self, iteration: int, force: bool = False) -> int: ...
    # after_save: the stop came during the save just written at this iteration and is satisfied by it
    def acted(self, decision: int, iteration: int, after_save: bool = False) -> None: ...
    def before_save(self, iteration: int, kind: SaveKind) -> bool: ...  # False: skip (or defer) this save
    # a periodic save deferred earlier is owed at this boundary (the same on every rank)
    def save_owed(self, iteration: int) -> bool: ...
    # collective: a stop whose wait for the asynchronous save of `writing` is over leaves with that one
    def leave_with_written(self, iteration: int, kind: SaveKind, writing: int) -> bool: ...
    # the save returned; complete=False: an asynchronous save still writing (save_complete follows)
    def after_save(self, iteration: int, complete: bool = True) -> None: ...
    def save_complete(self, iteration: int) -> None: ...  # the checkpoint is on disk, tracker updated
    # waited (every rank) for the asynchronous save of `iteration` to complete: save time
    def save_waited(self, iteration: int, begin: float, end: float) -> None: ...
    def on_log(self, iteration: int, loss: Any, lr: Any, grad_norm: Any, extra: dict[str, Any] | None = None) -> None: ...
    def on_iteration(self, iteration: int, flops_so_far: float) -> None: ...
    def choose_checkpoint(self) -> int | None: ...  # collective; None: start from scratch
    def load_failed(self, iteration: int, error: BaseException) -> int | None: ...  # collective: fallback
    def loaded(self, iteration: int, consumed_samples: int) -> None: ...
    def phase(self, name: str) -> None: ...  # a start-up detail phase reached (timeline)
    def distributed_ready(self) -> None: ...  # collective: process groups made; the health check runs here
    def evaluation(self, what: str) -> None: ...  # Megatron's evaluation: "started", "batch", "done"


class StepHooks(Protocol):
    """Called from the forward step and the model/data providers (runtime/loop/step.py)."""

    def maybe_hang(self) -> None: ...  # test hook MEGALAUNCH_TEST_HANG
    def forward_begin(self) -> None: ...
    def forward_end(self) -> None: ...
    def phase(self, name: str) -> None: ...
