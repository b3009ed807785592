"""What megalaunch changes in Megatron besides the seams (runtime/loop/megatron_seams.py): the pinned version,
start-up speed-ups and bug fixes for megatron-core 0.19.2 without TE/apex (docs/training.md,
docs/goodput.md). Like the seams, everything here touches Megatron's private names and is covered by
tests/megatron; torch and Megatron are imported inside the functions.

- Start-up: kernels' `torch.compile` deferred to their first call while Megatron is imported; wandb
  kept out of that import unless Megatron's own W&B writer is set up; the fused kernels' warm-up skipped
  when the model uses none of them; the NullTokenizer built without importing transformers.
- Bug fixes: the dataset helper `make` (bug 1); the distributed optimizer's `assert len(steps) == 1` on
  an empty state (bug 2); Adam's per-parameter `step` reset (and aliased into one tensor) after a load
  (bug 3); fp32 main-param views copied outside no_grad.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Iterator
from typing import Any

PINNED_MEGATRON = "0.19.2"
UNPINNED_ENV = "MEGALAUNCH_ALLOW_UNPINNED_MEGATRON"


def check_version() -> str:
    """The installed megatron-core version; refuses another one unless explicitly allowed."""
    from megatron.core import __version__

    version = str(__version__).split("+")[0]
    if version != PINNED_MEGATRON and os.environ.get(UNPINNED_ENV) != "1":
        raise RuntimeError(
            f"megalaunch's training runtime is pinned to megatron-core {PINNED_MEGATRON}, found {version}: "
            f"pip install megatron-core=={PINNED_MEGATRON} (or set {UNPINNED_ENV}=1 at your own risk)")
    return version


# What the trainer imports from Megatron, imported once under `deferred_compile` (megatron_seams.install).
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


# --- start-up: Megatron warms up fused kernels that the local layers never call ----------------

def skip_unused_fusion_warmup() -> None:
    """`pretrain` calls `set_jit_fusion_options`, which runs the fused bias+SwiGLU/GELU and
    bias+dropout+add functions five times each: with torch >= 2.2 they are `torch.compile`d, so this
    compiles kernels (seconds per segment, more on a cold cache) that a model built with the fusions
    off (the local implementation: --no-bias-swiglu-fusion --no-bias-dropout-fusion) never calls.
    Skipped exactly when every fusion it warms up is off; otherwise Megatron's own function runs."""
    from megatron.training import get_args
    from megatron.training import training as mtraining

    original = mtraining.set_jit_fusion_options

    @functools.wraps(original)
    def set_jit_fusion_options(*args: Any, **kwargs: Any) -> Any:
        a = get_args()
        if not (getattr(a, "bias_swiglu_fusion", True) or getattr(a, "bias_gelu_fusion", True)
                or getattr(a, "bias_dropout_fusion", True)):
            return None
        return original(*args, **kwargs)

    mtraining.set_jit_fusion_options = set_jit_fusion_options


def null_tokenizer_without_transformers() -> None:
    """Megatron builds even the NullTokenizer through `megatron.core.tokenizers.text`, whose package
    imports its Hugging Face wrapper, which imports transformers: 1-2 s here, 6-10 s per rank on the
    device (transformers 5 pulls in much of torch), for a tokenizer that is a vocabulary size. For the
    NullTokenizer, build it with transformers hidden from that one import (the wrapper already treats
    a missing transformers as optional); every other tokenizer type goes through Megatron unchanged.
    MEGALAUNCH_DEFER_COMPILE=0 switches this off too (the benchmark's "before")."""
    import sys

    from megatron.training import global_vars

    original = global_vars.build_tokenizer
    if os.environ.get(DEFERRED_COMPILE_ENV, "1") == "0":
        return

    @functools.wraps(original)
    def build_tokenizer(args: Any, **kwargs: Any) -> Any:
        if getattr(args, "tokenizer_type", None) != "NullTokenizer" or "transformers" in sys.modules \
                or "megatron.core.tokenizers.text" in sys.modules:
            return original(args, **kwargs)
        sys.modules["transformers"] = None  # type: ignore[assignment]  # import raises ModuleNotFoundError
        try:
            return original(args, **kwargs)
        finally:
            if sys.modules.get("transformers", 0) is None:
                del sys.modules["transformers"]

    global_vars.build_tokenizer = build_tokenizer


# --- bug 1: rank 0 runs `make` for a helper the wheel ships compiled --------------------------

def skip_helper_compilation() -> None:
    import megatron.core.datasets.utils as dutils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron compile it
    dutils.compile_helpers = lambda: None


# --- bugs 2 and 3: Adam's step with torch's optimizer fallback --------------------------------

def fix_optimizer_step() -> None:
    """Make a distributed optimizer (torch's Adam, no TE/apex) resume exactly.

    - `state_dict()` asserts one step across an empty state when it builds the load request
      (bug 2): we give the empty state a placeholder step for that call.
    - After loading, every parameter's `step` is one shared tensor holding the load request's
      placeholder instead of the checkpoint's step (bug 3): Adam's bias correction restarts,
      silently. We give each parameter its own tensor with the step saved in the param groups.
    - With fp32 parameters, the loaded values are copied into main params that are views of the
      model's, outside `no_grad`: "a view of a leaf Variable that requires grad is being used in an
      in-place operation". We run that copy under `no_grad`.
    The non-distributed optimizer needs none of this: its step travels in the common state."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if getattr(cls, "_megalaunch_step_fix", False):
        return
    original_state_dict = cls.state_dict
    original_load = cls.load_state_dict
    reshardable = cls.load_parameter_state_from_dp_reshardable

    @functools.wraps(original_state_dict)
    def state_dict(self: Any) -> Any:
        inner = getattr(self, "optimizer", None)
        if inner is None or distrib_optimizer.HAVE_APEX_OR_TE or len(inner.state) != 0:
            return original_state_dict(self)
        params = [p for g in inner.param_groups for p in g["params"]]
        for p in params:
            inner.state[p]["step"] = torch.tensor(0.0)
        try:
            return original_state_dict(self)
        finally:
            for p in params:
                if set(inner.state[p]) == {"step"}:
                    del inner.state[p]

    @functools.wraps(original_load)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        groups = state_dict.get("optimizer", {}).get("param_groups", [])
        steps = {float(g["step"]) for g in groups if g.get("step") is not None}
        result = original_load(self, state_dict)
        inner = getattr(self, "optimizer", None)
        if inner is not None and not distrib_optimizer.HAVE_APEX_OR_TE and len(steps) == 1:
            step = steps.pop()
            for state in inner.state.values():
                if "step" in state:  # its own tensor: torch's Adam increments it in place
                    state["step"] = torch.tensor(step, dtype=torch.float32)
        return result

    cls.state_dict = state_dict
    cls.load_state_dict = load_state_dict
    cls.load_parameter_state_from_dp_reshardable = functools.wraps(reshardable)(torch.no_grad()(reshardable))
    cls._megalaunch_step_fix = True
