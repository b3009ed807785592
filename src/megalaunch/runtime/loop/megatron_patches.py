"""What megalaunch changes in Megatron besides the seams (runtime/loop/megatron_seams.py): the pinned version,
start-up speed-ups and bug fixes for megatron-core 0.19.2 without TE/apex (docs/training.md,
docs/goodput.md). Like the seams, everything here touches Megatron's private names and is covered by
tests/megatron; torch and Megatron are imported inside the functions.

- Start-up: the fused kernels' warm-up skipped when the model uses none of them; the NullTokenizer
  built without importing transformers; a synchronous save's write results kept in this process
  (no spawned queue server importing torch) (how Megatron itself is imported, compilation deferred and
  wandb kept out, is runtime/model/megatron_import.py's).
- Bug fixes: the dataset helper `make` (bug 1); the distributed optimizer's `assert len(steps) == 1` on
  an empty state (bug 2); Adam's per-parameter `step` reset (and aliased into one tensor) after a load
  (bug 3); fp32 main-param views copied outside no_grad.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from megalaunch.runtime.model.megatron_import import DEFERRED_COMPILE_ENV

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


# --- a synchronous save's results stay in this process -----------------------------------------

def in_process_write_results() -> None:
    """torch_dist's writer hands its write results back through `get_write_results_queue()`, a
    `multiprocessing` Manager queue started with *spawn*: the first save of every process starts a
    Python server that imports torch to unpickle the results (3-4 CPU-seconds and ~550 MB per rank,
    measured on a CPU; on a 1,000-node job 8,000 extra interpreters importing torch from the shared
    filesystem), and it outlives the trainer. A synchronous save writes from threads of this very
    process, so an in-process queue is all it needs. An asynchronous save (`--async-save`, whose
    writer is another process) keeps Megatron's queue."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training import get_args

    original = filesystem_async.get_write_results_queue
    if getattr(original, "_megalaunch_in_process", False):
        return
    local: queue.Queue[Any] = queue.Queue()

    @functools.wraps(original)
    def get_write_results_queue(mp_mode: str = "spawn") -> Any:
        if getattr(get_args(), "async_save", False):
            return original(mp_mode)
        return local

    get_write_results_queue._megalaunch_in_process = True  # type: ignore[attr-defined]
    filesystem_async.get_write_results_queue = get_write_results_queue


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
