"""Every accommodation that lets Megatron's training loop run on a machine without a GPU.

Megatron assumes CUDA in many places (docs/training.md): `torch.cuda` calls for
the current device, synchronisation, RNG state, streams and memory; factory calls with
`device='cuda'`; `Tensor.cuda()`; `param.type() == 'torch.cuda.FloatTensor'` checks; an
`initialize_megatron` that asserts CUDA; a fused-kernel warm-up; an architecture probe. `enable()`
redirects all of them to the CPU, once, for the whole process. Nothing else in megalaunch needs to
know about it: the trainer calls `enable()` for a CPU job (`gpus_per_node: 0`, or no GPU visible),
and the rendered Megatron command line of a CPU job has `--distributed-backend gloo`
(config/megatron_args.py).

This is for the `tiny` demo and the CPU tests (gloo, fp32, 1-2 processes); it makes no attempt at
speed, and it never runs when a GPU is present."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

_ENABLED = False


def is_enabled() -> bool:
    return _ENABLED


def enable() -> None:
    """Redirect CUDA to the CPU for this process (idempotent)."""
    global _ENABLED
    if _ENABLED:
        return
    # Denormals are flushed by the trainer's process only (runtime/train.py, right after importing
    # torch): it is process-wide floating-point state, and this function also runs inside other
    # processes (conversion, tests), where flushing would change their arithmetic (hypothesis's
    # smallest float became 0.0 in a test process that had called this).
    import torch

    from megalaunch.runtime.model.megatron_import import import_megatron

    import_megatron()  # before torch.cuda changes under it; compilation deferred, wandb kept out

    _patch_torch_cuda(torch)
    _patch_tensor_methods(torch)
    _CudaToCpuMode().__enter__()  # stays active for the life of the process
    _patch_megatron()
    _ENABLED = True


def _is_cuda(device: Any) -> bool:
    import torch

    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is how Megatron passes torch.cuda.current_device().
    return isinstance(device, int) and not isinstance(device, bool)


class _Stream:
    """Stands in for torch.cuda.Stream/Event: every operation is already complete on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def wait_stream(self, *a: Any, **k: Any) -> None: ...
    def wait_event(self, *a: Any, **k: Any) -> None: ...
    def record_event(self, *a: Any, **k: Any) -> _Stream:
        return self
    def record(self, *a: Any, **k: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True
    def wait(self, *a: Any, **k: Any) -> None: ...
    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _fn(name: str, result: Any = None) -> Any:
    """A distinct function object per replaced name (torch._dynamo keys its rules by object)."""

    def replacement(*args: Any, **kwargs: Any) -> Any:
        return result() if callable(result) else result

    replacement.__name__ = replacement.__qualname__ = name
    return replacement


def _patch_torch_cuda(torch: Any) -> None:
    cuda = torch.cuda
    dummy_rng = torch.zeros(16, dtype=torch.uint8)
    replacements: dict[str, Any] = {
        "current_device": _fn("current_device", 0),
        "device_count": _fn("device_count", 1),
        "get_rng_state": _fn("get_rng_state", dummy_rng.clone),
        "get_rng_state_all": _fn("get_rng_state_all", lambda: [dummy_rng.clone()]),
        "current_stream": _fn("current_stream", _Stream),
        "default_stream": _fn("default_stream", _Stream),
        "stream": _fn("stream", contextlib.nullcontext),
        "get_device_capability": _fn("get_device_capability", (0, 0)),
        "get_device_name": _fn("get_device_name", "cpu"),
        "memory_stats": _fn("memory_stats", dict),
        "Stream": _Stream,
        "Event": _Stream,
        "nvtx": _Nvtx(),
    }
    for name in ("set_device", "synchronize", "empty_cache", "manual_seed", "manual_seed_all", "seed",
                 "set_rng_state", "set_rng_state_all", "reset_peak_memory_stats", "reset_max_memory_allocated"):
        replacements[name] = _fn(name)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        replacements[name] = _fn(name, 0)
    for name, value in replacements.items():
        if hasattr(cuda.random, name):
            setattr(cuda.random, name, value)  # torch.cuda.X is torch.cuda.random.X: keep them one object
        setattr(cuda, name, value)


class _Nvtx:
    def range_push(self, *a: Any, **k: Any) -> None: ...
    def range_pop(self, *a: Any, **k: Any) -> None: ...
    def mark(self, *a: Any, **k: Any) -> None: ...
    def range(self, *a: Any, **k: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def _patch_tensor_methods(torch: Any) -> None:
    tensor = torch.Tensor
    tensor.cuda = lambda self, *a, **k: self
    tensor.pin_memory = lambda self, *a, **k: self
    original_type = tensor.type

    @functools.wraps(original_type)
    def type_(self: Any, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        # Megatron's optimizers accept only params whose type() names a CUDA tensor.
        if dtype is None and not kwargs:
            name = original_type(self)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original_type(self, dtype, non_blocking, **kwargs)

    tensor.type = type_


def _mode_base() -> type:
    from torch.overrides import TorchFunctionMode

    return TorchFunctionMode


class _CudaToCpuMode(_mode_base()):  # type: ignore[misc]
    """Rewrites `device='cuda'` (or an int device) in any torch call to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import torch

        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


def _patch_megatron() -> None:
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.training.training as mtraining

    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: __import__("torch").zeros(16, dtype=__import__("torch").uint8)

    initialize = mtraining.initialize_megatron
    mtraining.initialize_megatron = functools.partial(initialize, allow_no_cuda=True)
    # The fused-kernel warm-up compiles CUDA kernels; on the CPU it has nothing to do.
    mtraining.set_jit_fusion_options = lambda *a, **k: None

    import megatron.training.arguments as marguments

    # The GPU architecture probe (Blackwell checks) would call into CUDA.
    marguments.get_device_arch_version = lambda: 0

    from megalaunch.runtime.model import moe_cpu

    moe_cpu.enable()  # the MoE token dispatcher's host copies
