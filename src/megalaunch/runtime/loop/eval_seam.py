"""Megatron's evaluation during training beats (`training.eval_iters` > 0, every `eval_interval` iterations,
and the validation and test passes after the loop): `training.evaluate_and_print_results` tells the hooks
"started" and "done", and every forward of an eval batch "batch". So the hang watchdog and rank 0's
heartbeat know an evaluation runs, and judge it by the evaluation's limit (runtime/health/hang_limit.py)
instead of the step's: with `chain.hang_timeout_s: auto` an evaluation longer than ten steps is no hang.

A seam of its own (runtime/loop/megatron_seams.py installs it) so the module of Megatron's private names
stays within its size; checked against megatron-core 0.19.2 like the others."""

from __future__ import annotations

import functools
from typing import Any

from megalaunch.runtime.rank.hooks import LoopHooks


def install(hooks: LoopHooks, mtraining: Any = None) -> None:
    """Wrap `evaluate_and_print_results` of `mtraining` (default: megatron.training.training, whose loop
    calls it through its module global)."""
    if mtraining is None:
        from megatron.training import training

        mtraining = training
    original = mtraining.evaluate_and_print_results

    @functools.wraps(original)
    def evaluate_and_print_results(prefix: Any, forward_step_func: Any, *args: Any, **kwargs: Any) -> Any:
        hooks.evaluation("started")
        try:
            return original(prefix, beating(hooks, forward_step_func), *args, **kwargs)
        finally:
            hooks.evaluation("done")

    mtraining.evaluate_and_print_results = evaluate_and_print_results


def beating(hooks: LoopHooks, forward_step_func: Any) -> Any:
    """The forward step, beating once per eval micro-batch (its signature kept: Megatron's schedules
    inspect it)."""

    @functools.wraps(forward_step_func)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        hooks.evaluation("batch")
        return forward_step_func(*args, **kwargs)

    return forward_step
