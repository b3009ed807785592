"""Megatron-FSDP (`parallel.data_sharding`: optimizer_grads, optimizer_grads_params) on megatron-core 0.19.2:
the fixes its `fsdp_dtensor` checkpoints need (docs/training.md, sharded data parallelism). Like
runtime/loop/megatron_patches.py, this touches Megatron's private names and is covered by tests/megatron
and tests/gpu; torch and Megatron are imported inside the functions.

- Bug 4, every SwiGLU model (Llama) fails its first save and its load: `handle_swiglu_in_state_dict`
  looks each fc1 weight up as `model.get_parameter(f"module.{key}")`, where the keys come from
  MegatronFSDP's own `state_dict` and so already start with `module.`, and `model` is that MegatronFSDP
  (Megatron's `unwrap_model` peels the adapter off): `module.module.decoder...` is looked up on a module
  that has one `module` level, and the save dies with "GPTModel has no attribute `module`". The optimizer
  half of the same function strips the prefix (`key[len("module."):]`), which shows the intent. We hand
  it a view of the model whose `get_parameter` drops the one `module.` too many.
- Bug 5, the save and the load hang (torch's Adam, without TE or apex): each rank's optimizer state holds
  only the parameters whose local shard is not empty (Megatron skips the empty ones when it initialises
  states for a load, and torch's Adam creates none for them), so ranks list different parameters, and
  the per-parameter collectives of the DTensor preprocessing (`validate_uneven_dtensor`,
  `update_uneven_dtensor_chunk_metadata`) pair up different tensors and wait forever. We give every rank
  the same parameters in the same order (the model's), an empty parameter's state being zeros of its
  DTensor (no elements here) and the step every other parameter has.
- On the CPU (gloo): Megatron-FSDP divides gradients inside the reduce-scatter with NCCL's PREMUL_SUM,
  which gloo refuses; the job renders `--no-gradient-reduce-div-fusion` there (config/megatron_args.py),
  which scales before a plain SUM (the same arithmetic)."""

from __future__ import annotations

import functools
from typing import Any


class _OneModuleLevel:
    """`model`, except that `get_parameter("module.module.x")` finds `module.x` (see bug 4)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def get_parameter(self, target: str) -> Any:
        doubled = "module.module."
        if target.startswith(doubled) and not _has_nested_module(self._model):
            target = target[len("module."):]
        return self._model.get_parameter(target)


def _has_nested_module(model: Any) -> bool:
    inner = getattr(model, "module", None)
    return inner is not None and hasattr(inner, "module")


def fix_swiglu_state_dict() -> None:
    """Bug 4 (above): wraps `preprocess_fsdp_dtensor_state_dict`, which both the save and the load call."""
    from megatron.training import checkpointing

    original = getattr(checkpointing, "preprocess_fsdp_dtensor_state_dict", None)
    if original is None or getattr(original, "_megalaunch_fixed", False):
        return

    @functools.wraps(original)
    def preprocess_fsdp_dtensor_state_dict(args: Any, raw_state_dict: Any, model: Any) -> Any:
        return original(args, raw_state_dict, _OneModuleLevel(model))

    preprocess_fsdp_dtensor_state_dict._megalaunch_fixed = True  # type: ignore[attr-defined]
    checkpointing.preprocess_fsdp_dtensor_state_dict = preprocess_fsdp_dtensor_state_dict


def complete_optimizer_state() -> None:
    """Bug 5 (above): wraps `DistributedOptimizer.sharded_param_state_fsdp_dtensor` (save and load)."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = getattr(cls, "sharded_param_state_fsdp_dtensor", None)
    if original is None or getattr(original, "_megalaunch_fixed", False):
        return

    @functools.wraps(original)
    def sharded_param_state_fsdp_dtensor(self: Any, is_loading: bool = False) -> Any:
        state_dict = original(self, is_loading)
        state_dict["state"] = _every_parameter(self)
        return state_dict

    sharded_param_state_fsdp_dtensor._megalaunch_fixed = True  # type: ignore[attr-defined]
    cls.sharded_param_state_fsdp_dtensor = sharded_param_state_fsdp_dtensor


def _every_parameter(optimizer: Any) -> dict[str, Any]:
    """Parameter name -> state for every trained parameter of the model, in the model's order: the same keys
    in the same order on every rank. A rank's own states are the live ones (loaded in place); for the others
    (empty local shard), zeros of the DTensor and the common step. Entries keyed by name in the optimizer's
    state are dropped: a load leaves the other ranks' names there (torch's `load_state_dict` keeps what it
    cannot map to a parameter), and saving them would write a step that never moves; so would a state a load
    gave to a parameter this rank holds nothing of."""
    import torch

    params = [p for chunk in optimizer.model_chunks for p in chunk.parameters() if p.requires_grad]
    names = [optimizer._param_name(p) for p in params]
    inner = optimizer.optimizer.state
    for key in [k for k in inner if isinstance(k, str)]:
        del inner[key]
    live = {optimizer._param_name(k): v for k, v in inner.items()
            if isinstance(k, torch.Tensor) and v and not _empty_here(k)}
    step = _common_step(optimizer, live)
    out: dict[str, Any] = {}
    for name, param in zip(names, params, strict=True):
        if name in live:
            out[name] = live[name]
            continue
        entry = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        if step is not None:
            entry["step"] = step.clone()
        out[name] = entry
    return out


def _empty_here(param: Any) -> bool:
    """Whether this rank holds none of the parameter: a load gives such a parameter a state (the saved one),
    which Adam then never steps (no gradient), so its step stays where it was loaded."""
    local = getattr(param, "_local_tensor", param)
    return bool(local.numel() == 0)


def _common_step(optimizer: Any, packed: dict[str, Any]) -> Any:
    """The step the present states share (the largest across the data-parallel group: a rank may hold no
    state at all), as a tensor like theirs; None when no state has one."""
    import torch

    steps = [float(v["step"]) for v in packed.values() if isinstance(v, dict) and "step" in v]
    local = torch.tensor([max(steps) if steps else -1.0], dtype=torch.float64)
    group = getattr(optimizer, "data_parallel_group", None)
    if torch.distributed.is_initialized():
        device = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend(group) == "nccl" else "cpu"
        local = local.to(device)
        torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=group)
    value = float(local.item())
    if value < 0:
        return None
    like = next(v["step"] for v in packed.values() if isinstance(v, dict) and "step" in v) if steps else None
    return torch.tensor(value, dtype=like.dtype if like is not None else torch.float32)
