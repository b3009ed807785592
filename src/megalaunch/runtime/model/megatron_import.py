"""Importing Megatron without what a training process does not need (docs/goodput.md, start-up): its
kernels' `torch.compile` decorations deferred to their first call, and wandb kept out of the import.
Used by every process that imports Megatron to train or build a model: the trainer (runtime/loop's
seams), and on a machine without a GPU `cpu_compat.enable()`, which imports Megatron to patch it.
torch and Megatron are imported inside the functions."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

MEGATRON_MODULES = ("megatron.training.training", "megatron.training.arguments", "megatron.training.argument_utils",
                    "megatron.core.models.gpt")
DEFERRED_COMPILE_ENV = "MEGALAUNCH_DEFER_COMPILE"


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """While Megatron's modules are imported, `torch.compile(fn)` returns a function that compiles
    `fn` on its first call. Megatron decorates its fused kernels (bias+GELU/SwiGLU/GEGLU, dropout+add,
    ...) with `torch.compile` at import time, and the first such call imports TorchDynamo and
    TorchInductor (~2,500 modules: 1.5 s here, 4-5 s per rank on the device's CPUs) although the
    local layers never call those kernels. torch.compile compiles on the first call anyway, so
    nothing changes for a kernel that is used. Only plain functions are deferred (a module or any
    other target is compiled at once, as before). MEGALAUNCH_DEFER_COMPILE=0: off (the benchmark's
    "before")."""
    import torch

    real = torch.compile
    if os.environ.get(DEFERRED_COMPILE_ENV, "1") == "0" or getattr(real, "_megalaunch_deferred", False):
        yield
        return

    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): the decorator
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):
            return real(model, **kwargs)
        compiled: Any = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return first_call_compiles

    compile_later._megalaunch_deferred = True  # type: ignore[attr-defined]
    torch.compile = compile_later  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real


def import_megatron() -> None:
    """Import the Megatron modules the trainer uses, with their kernels' compilation deferred and wandb
    kept out (`wandb_hidden`)."""
    import importlib

    with deferred_compile(), wandb_hidden():
        for name in MEGATRON_MODULES:
            importlib.import_module(name)
    timers_follow_megatron_wandb()


@contextlib.contextmanager
def wandb_hidden() -> Iterator[None]:
    """Megatron's timers import wandb at module level (`try: import wandb`), only to log timer values
    through Megatron's own W&B writer, which megalaunch does not set up (the chain's W&B run is
    runtime/observation/wandb_run.py, imported where W&B is on, on rank 0). wandb's import costs
    0.5-1.5 s of every rank's start-up; during Megatron's import it raises ImportError instead (the
    timers keep `wandb = None`), unless something imported it already. MEGALAUNCH_DEFER_COMPILE=0: off."""
    if "wandb" in sys.modules or os.environ.get(DEFERRED_COMPILE_ENV, "1") == "0":
        yield
        return
    sys.modules["wandb"] = None  # type: ignore[assignment]  # import raises ModuleNotFoundError
    try:
        yield
    finally:
        if sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


def timers_follow_megatron_wandb() -> None:
    """Where a run asks Megatron itself for W&B (`megatron_args: {wandb-project: ...}`), give the timers
    the real module back once Megatron's writer exists, so its timer values are logged as before."""
    from megatron.core import timers
    from megatron.training import global_vars

    if getattr(timers, "wandb", None) is not None or getattr(global_vars._set_wandb_writer, "_megalaunch", False):
        return
    original = global_vars._set_wandb_writer

    @functools.wraps(original)
    def set_wandb_writer(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if global_vars._GLOBAL_WANDB_WRITER is not None:
            import wandb

            timers.wandb = wandb
        return result

    set_wandb_writer._megalaunch = True  # type: ignore[attr-defined]
    global_vars._set_wandb_writer = set_wandb_writer
