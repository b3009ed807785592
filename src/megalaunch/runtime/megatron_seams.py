"""Where megalaunch plugs into Megatron's training loop. Everything here touches Megatron's private
names, so it lives in one module, is checked against the pinned version, and is covered by
tests/megatron (a Megatron upgrade breaks those tests, not a training run).

Seams (megatron-core 0.19.2, `megatron.training`):
- `global_vars._set_signal_handler` -> `CollectiveSignalHandler`: Megatron asks it "was the exit
  signal received?" once per iteration (its all-gather). We answer from one all-reduce MAX of a
  `Decision` (signal flag on every rank + trigger files on rank 0), computed in the wrapper below.
- `training.checkpoint_and_decide_exit` -> decide once per iteration, then: `save` checkpoints and
  continues, `signal`/`exit` let Megatron save and exit, `abort` exits without saving.
- `training.save_checkpoint_and_time` -> hooks before/after every save (watchdog, retention).
- `training.training_log` -> the reduced loss of each iteration (progress, W&B).
- `training.load_checkpoint` -> choose the checkpoint to resume from (complete ones only) and fall
  back to an older one if loading fails.
- Bug fixes for megatron-core 0.19.2 without TE/apex (docs/training.md): the dataset helper `make`; the
  distributed optimizer's `assert len(steps) == 1` on an empty state; Adam's per-parameter `step`
  reset (and aliased into one tensor) after a load; fp32 main-param views copied outside no_grad.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any, Protocol

PINNED_MEGATRON = "0.19.2"
UNPINNED_ENV = "MEGALAUNCH_ALLOW_UNPINNED_MEGATRON"


class Hooks(Protocol):
    """What the training entry provides to the seams (see megalaunch.runtime.train.Session)."""

    def decide(self, iteration: int) -> int: ...  # a collective: same Decision on every rank
    def acted(self, decision: int, iteration: int) -> None: ...
    def before_save(self, iteration: int) -> None: ...
    def after_save(self, iteration: int) -> None: ...
    def on_log(self, iteration: int, loss: Any, lr: Any, grad_norm: Any) -> None: ...
    def on_iteration(self, iteration: int, flops_so_far: float) -> None: ...
    def choose_checkpoint(self) -> int | None: ...  # collective; None: start from scratch
    def load_failed(self, iteration: int, error: BaseException) -> int | None: ...  # collective: fallback
    def loaded(self, iteration: int, consumed_samples: int) -> None: ...
    def phase(self, name: str) -> None: ...  # a start-up detail phase reached (timeline)
    def distributed_ready(self) -> None: ...  # collective: process groups made; the health check runs here


def check_version() -> str:
    """The installed megatron-core version; refuses another one unless explicitly allowed."""
    from megatron.core import __version__

    version = str(__version__).split("+")[0]
    if version != PINNED_MEGATRON and os.environ.get(UNPINNED_ENV) != "1":
        raise RuntimeError(
            f"megalaunch's training runtime is pinned to megatron-core {PINNED_MEGATRON}, found {version}: "
            f"pip install megatron-core=={PINNED_MEGATRON} (or set {UNPINNED_ENV}=1 at your own risk)")
    return version


# What the trainer imports from Megatron, imported once under `deferred_compile` (train._setup).
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
    """Import the Megatron modules the trainer uses, with their kernels' compilation deferred."""
    import importlib

    with deferred_compile():
        for name in MEGATRON_MODULES:
            importlib.import_module(name)


def install(hooks: Hooks) -> None:
    """Install every seam for this process (call once, before `pretrain`)."""
    import_megatron()
    check_version()
    skip_helper_compilation()
    skip_unused_fusion_warmup()
    _mark_init_phases(hooks)
    null_tokenizer_without_transformers()
    fix_optimizer_step()
    _install_signal_handler()
    _wrap_checkpoint_and_decide_exit(hooks)
    _wrap_save(hooks)
    _wrap_training_log(hooks)
    _wrap_load_checkpoint(hooks)


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


def _mark_init_phases(hooks: Hooks) -> None:
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


# --- the collective decision -------------------------------------------------------------------

class _CollectiveSignalHandler:
    """Stands where Megatron's DistributedSignalHandler stands. It installs no OS handler (the
    entry's SignalFlag already owns the stop signal) and answers `signals_received()` from the
    decision taken for the current iteration, so the loop needs no all-gather of its own."""

    def __init__(self, sig: Any = None) -> None:
        self.sig = sig
        self.exit_requested = False

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


def _wrap_checkpoint_and_decide_exit(hooks: Hooks) -> None:
    from megatron.training import get_args
    from megatron.training import training as mtraining

    from megalaunch.rundir.triggers import Decision

    original = mtraining.checkpoint_and_decide_exit

    @functools.wraps(original)
    def checkpoint_and_decide_exit(model: Any, optimizer: Any, opt_param_scheduler: Any, iteration: int,
                                   num_floating_point_operations_so_far: float, checkpointing_context: Any,
                                   train_data_iterator: Any) -> bool:
        hooks.on_iteration(iteration, num_floating_point_operations_so_far)
        decision = Decision(hooks.decide(iteration))
        if decision == Decision.ABORT:
            hooks.acted(decision, iteration)
            return True
        args = get_args()
        if decision == Decision.SAVE and not (args.save_interval and iteration % args.save_interval == 0):
            mtraining.save_checkpoint_and_time(
                iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                checkpointing_context, train_data_iterator=train_data_iterator)
        _HANDLER.exit_requested = decision >= Decision.SIGNAL
        try:
            should_exit = original(model, optimizer, opt_param_scheduler, iteration,
                                   num_floating_point_operations_so_far, checkpointing_context,
                                   train_data_iterator)
        finally:
            _HANDLER.exit_requested = False
        if decision != Decision.CONTINUE:
            hooks.acted(decision, iteration)
        return bool(should_exit)

    mtraining.checkpoint_and_decide_exit = checkpoint_and_decide_exit


def _wrap_save(hooks: Hooks) -> None:
    from megatron.training import training as mtraining

    original = mtraining.save_checkpoint_and_time

    @functools.wraps(original)
    def save_checkpoint_and_time(iteration: int, *args: Any, **kwargs: Any) -> Any:
        hooks.before_save(iteration)
        result = original(iteration, *args, **kwargs)
        hooks.after_save(iteration)
        return result

    mtraining.save_checkpoint_and_time = save_checkpoint_and_time


def _wrap_training_log(hooks: Hooks) -> None:
    from megatron.training import training as mtraining

    original = mtraining.training_log

    @functools.wraps(original)
    def training_log(loss_dict: dict[str, Any], total_loss_dict: Any, learning_rate: Any, iteration: int,
                     loss_scale: Any, report_memory_flag: Any, skipped_iter: Any, grad_norm: Any,
                     *args: Any, **kwargs: Any) -> Any:
        # The loss stays a device tensor: converting it would synchronise every iteration.
        hooks.on_log(iteration, loss_dict.get("lm loss") if loss_dict else None, learning_rate, grad_norm)
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                        report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)

    mtraining.training_log = training_log


def as_float(value: Any) -> float | None:
    """A loss, learning rate or norm from Megatron (tensor, number or None) as a float."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# --- resume: choose a complete checkpoint, fall back when a load fails ------------------------

def _wrap_load_checkpoint(hooks: Hooks) -> None:
    import torch
    from megatron.training import get_args
    from megatron.training import training as mtraining

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
            if not _any_rank(error is not None, torch):
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


def _any_rank(flag: bool, torch: Any) -> bool:
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def collective_device() -> Any:
    """The device a tensor for the default process group must live on (gloo: CPU)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
