"""Faults the tests inject through the environment (docs/training.md, "Tests"); all off unless set.

- MEGALAUNCH_TEST_HANG=ITER[:RANK]: that rank stops making progress inside iteration ITER;
- MEGALAUNCH_TEST_STEP_SLEEP_S=S: every iteration takes S seconds longer (before its decision);
- MEGALAUNCH_TEST_SLOW_FORWARD=RANK:SECONDS: a sleep in that rank's forward steps;
- MEGALAUNCH_TEST_SAVE_DELAY_S=S[:KIND,KIND]: every save (or only those of these kinds: periodic,
  trigger, stop, final) takes S seconds longer, on every rank, inside the save (after it was started
  and timed, before Megatron writes): a slow filesystem, for a stop signal that arrives during a save;
  an asynchronous save's writer (its worker process) sleeps instead, before it writes (`slow_writer`);
- MEGALAUNCH_TEST_CPU_ASYNC_SAVE=1: Megatron's asynchronous saves work on a CPU (`cpu_async_saves`);
  with `--async-save --use-persistent-ckpt-worker` in the recipe's megatron_args, the seams'
  asynchronous paths run in CI as on a GPU;
- MEGALAUNCH_TEST_RENDEZVOUS_HANG=RANK: that rank never joins torch.distributed's rendezvous, in the
  first segment that sees the hook only (a marker under state/ remembers it).
(MEGALAUNCH_TEST_SLOW_NODE and MEGALAUNCH_TEST_HEALTH_FAIL are the health check's: runtime/health/health.py.)"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any

from megalaunch.runtime.rank.context import RankContext

HANG_ENV = "MEGALAUNCH_TEST_HANG"
STEP_SLEEP_ENV = "MEGALAUNCH_TEST_STEP_SLEEP_S"
SLOW_FORWARD_ENV = "MEGALAUNCH_TEST_SLOW_FORWARD"
RENDEZVOUS_HANG_ENV = "MEGALAUNCH_TEST_RENDEZVOUS_HANG"
SAVE_DELAY_ENV = "MEGALAUNCH_TEST_SAVE_DELAY_S"
CPU_ASYNC_ENV = "MEGALAUNCH_TEST_CPU_ASYNC_SAVE"


@dataclass(frozen=True)
class FaultHooks:
    hang_at: int | None = None
    step_sleep_s: float = 0.0
    slow_forward_s: float = 0.0
    save_delay_s: float = 0.0
    save_delay_kinds: frozenset[str] | None = None  # None: every kind

    @classmethod
    def from_env(cls, rank: int) -> FaultHooks:
        delay, kinds = parse_save_delay(os.environ.get(SAVE_DELAY_ENV))
        return cls(hang_at=parse_hang(os.environ.get(HANG_ENV), rank),
                   step_sleep_s=float(os.environ.get(STEP_SLEEP_ENV) or 0),
                   slow_forward_s=parse_slow_forward(os.environ.get(SLOW_FORWARD_ENV), rank),
                   save_delay_s=delay, save_delay_kinds=kinds)

    def maybe_hang(self, iteration: int, ctx: RankContext) -> None:
        """Stop making progress inside iteration `hang_at` (`iteration` is the last one finished)."""
        if self.hang_at is not None and iteration + 1 == self.hang_at:
            ctx.log(f"test hook: hanging in iteration {self.hang_at}")
            while True:
                time.sleep(3600)

    def pace(self) -> None:
        if self.step_sleep_s > 0:  # pace iterations (before the decision, like a slow step)
            time.sleep(self.step_sleep_s)

    def slow_forward(self) -> None:
        if self.slow_forward_s > 0:  # this rank computes slower
            time.sleep(self.slow_forward_s)

    def slow_save(self, kind: str, ctx: RankContext) -> None:
        if self.save_delay_s > 0 and (self.save_delay_kinds is None or kind in self.save_delay_kinds):
            if _async_saves():  # the writer is slowed instead (slow_writer)
                return
            ctx.log(f"test hook: this {kind} save takes {self.save_delay_s:g} s longer")
            time.sleep(self.save_delay_s)


def _async_saves() -> bool:
    try:
        from megatron.training import get_args

        return bool(getattr(get_args(), "async_save", False))
    except Exception:  # Megatron not imported or not initialised (unit tests): synchronous
        return False


def slow_writer(request: Any, kind: str) -> Any:
    """An asynchronous save of a delayed kind (MEGALAUNCH_TEST_SAVE_DELAY_S): the same request whose
    writer sleeps first, in its worker process, while the trainer goes on."""
    delay, kinds = parse_save_delay(os.environ.get(SAVE_DELAY_ENV))
    if delay <= 0 or (kinds is not None and kind not in kinds) or request.async_fn is None:
        return request
    print(f"[megalaunch] test hook: the writer of this {kind} save takes {delay:g} s longer", flush=True)
    return request._replace(async_fn=functools.partial(_after_sleep, delay, request.async_fn))


def _after_sleep(seconds: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
    time.sleep(seconds)
    return fn(*args, **kwargs)


class _HarmlessCuda:
    """What Megatron's asynchronous writer asks of torch.cuda, on a CPU: nothing to synchronise, the
    collectives' tensors on the CPU (gloo), one "device" for the worker to pick."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(*_: Any, **__: Any) -> None:
        return None

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(*_: Any, **__: Any) -> None:
        return None


class _TorchOnCpu:
    cuda = _HarmlessCuda()

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


def cpu_async_saves() -> None:
    """MEGALAUNCH_TEST_CPU_ASYNC_SAVE=1, after Megatron is imported: its asynchronous writer's modules
    see a torch whose few CUDA calls are harmless on a CPU, and its persistent worker is forked (so it
    keeps them) instead of spawned. Nothing else changes: saves stay synchronous without --async-save."""
    if os.environ.get(CPU_ASYNC_ENV) != "1":
        return
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async, state_dict_saver

    for module in (async_utils, filesystem_async, state_dict_saver):
        module.torch = _TorchOnCpu()  # type: ignore[attr-defined]
    get_process = async_utils.PersistentAsyncCaller._get_process.__func__

    def forked(cls: Any, rank: int, mp_mode: str = "spawn", *args: Any, **kwargs: Any) -> Any:
        return get_process(cls, rank, "fork", *args, **kwargs)

    async_utils.PersistentAsyncCaller._get_process = classmethod(forked)  # type: ignore[method-assign,assignment]


def maybe_skip_rendezvous(ctx: RankContext) -> None:
    """MEGALAUNCH_TEST_RENDEZVOUS_HANG=RANK: that rank never joins the rendezvous, so the others wait
    in it forever, in the first segment that sees the hook only."""
    text = os.environ.get(RENDEZVOUS_HANG_ENV)
    if not text or int(text) != ctx.rank:
        return
    marker = ctx.paths.state / "test-rendezvous-hang"
    if marker.exists():
        return
    marker.write_text(f"{ctx.job_id}\n")
    ctx.log("test hook: never joining the rendezvous")
    while True:
        time.sleep(3600)


def parse_slow_forward(text: str | None, rank: int) -> float:
    if not text:
        return 0.0
    slow_rank, _, seconds = text.partition(":")
    return float(seconds or 0.1) if int(slow_rank) == rank else 0.0


def parse_save_delay(text: str | None) -> tuple[float, frozenset[str] | None]:
    if not text:
        return 0.0, None
    seconds, _, kinds = text.partition(":")
    return float(seconds), (frozenset(k.strip() for k in kinds.split(",") if k.strip()) or None)


def parse_hang(text: str | None, rank: int) -> int | None:
    if not text:
        return None
    iteration, _, hang_rank = text.partition(":")
    return int(iteration) if int(hang_rank or 0) == rank else None
