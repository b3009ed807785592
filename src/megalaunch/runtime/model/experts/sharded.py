"""The grouped experts' checkpoint layout, which is `SequentialMLP`'s: each 3D weight is one ShardedTensorFactory
that builds, per local expert, the ShardedTensors `SequentialMLP.sharded_state_dict` writes (the same keys,
`{prefix}experts.linear_fc1.weight` with the global expert axis prepended, or `experts.<global>.linear_fc1.weight`
with `singleton_local_shards`; the expert tensor-parallel axis; SwiGLU's fc1 in its two halves through
`apply_swiglu_sharded_factory`; the replica id's data-parallel rank from the expert data-parallel group), and
stacks what a load returns back into the 3D weight. So a torch_dist checkpoint saved with either class loads into
the other, with any expert-parallel size.

`stack_sequential_keys` does the same for a plain state dict: SequentialMLP's per-expert keys become the 3D weights.

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

from functools import partial
from typing import Any

FCS = (("weight1", "linear_fc1", 0), ("weight2", "linear_fc2", 1))  # parameter, Megatron's name, TP axis


def experts_sharded_state_dict(module: Any, prefix: str, sharded_offsets: tuple[Any, ...],
                               metadata: dict[str, Any] | None) -> dict[str, Any]:
    """`{prefix}weight1` and `{prefix}weight2` as factories of SequentialMLP's sharded tensors, and its linear layers'
    empty extra states."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    out: dict[str, Any] = {}
    for name, fc, axis in FCS:
        swiglu = fc == "linear_fc1" and module.config.gated_linear_unit
        build = partial(_build, module, fc, axis, swiglu, tuple(sharded_offsets), metadata)
        out[f"{prefix}{name}"] = ShardedTensorFactory(f"{prefix}experts.{fc}.weight", getattr(module, name), build,
                                                      partial(_merge, swiglu))
        out.update(_extra_states(module, fc, prefix, tuple(sharded_offsets), metadata))
    return out


def _extra_states(module: Any, fc: str, prefix: str, offsets: tuple[Any, ...], metadata: dict[str, Any]) -> dict[str, Any]:
    """The (empty) `_extra_state` objects SequentialMLP's linear layers write, one per expert, under its keys: a
    checkpoint written here then has everything a SequentialMLP model asks for."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    local = module.num_local_experts
    first, total = module.ep_group.rank() * local, module.ep_group.size() * local
    singleton = bool(metadata.get("singleton_local_shards", False))
    out: dict[str, Any] = {}
    for e in range(local):
        at, expert_offsets = _where(prefix, fc, first + e, total, offsets, singleton)
        obj = make_sharded_tensors_for_checkpoint({"_extra_state": None}, at, {}, expert_offsets,
                                                  tp_group=module.tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])[f"{at}_extra_state"]
        obj.replica_id = (*obj.replica_id[:2], module.dp_group.rank())
        out[f"{prefix}local_experts.{e}.{fc}._extra_state"] = obj
    return out


def _where(base: str, fc: str, expert: int, total: int, offsets: tuple[Any, ...],
           singleton: bool) -> tuple[str, tuple[Any, ...]]:
    """SequentialMLP's key prefix and offsets for one global expert (MoE's `singleton_local_shards`: one key per
    expert; else the expert axis prepended)."""
    if singleton:
        return f"{base}experts.{expert}.{fc}.", offsets
    return f"{base}experts.{fc}.", (*offsets, (len(offsets), expert, total))


def _build(module: Any, fc: str, axis: int, swiglu: bool, offsets: tuple[Any, ...], metadata: dict[str, Any],
           key: str, data: Any, replica_id: Any, flattened_range: Any) -> list[Any]:
    """SequentialMLP's sharded tensors of `data` ([E_local, ...]: the weight, or an optimizer state like it).
    `key` is the factory's, `{base}experts.{fc}.weight`, after the callers' renaming (the transformer block takes
    the layer number out of it)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    if flattened_range is not None:
        raise NotImplementedError(f"{key}: grouped experts do not support flattened (fully sharded model-space) "
                                  "optimizer checkpoints; use the distributed optimizer's default (dp_reshardable)")
    local = data.shape[0]
    first, total = module.ep_group.rank() * local, module.ep_group.size() * local
    singleton = bool(metadata.get("singleton_local_shards", False))
    base = key[:-len(f"experts.{fc}.weight")]
    out: list[Any] = []
    for e in range(local):
        at, expert_offsets = _where(base, fc, first + e, total, offsets, singleton)
        sh = make_sharded_tensors_for_checkpoint({"weight": data[e]}, at, {"weight": axis}, expert_offsets,
                                                 tp_group=module.tp_group,
                                                 dp_cp_group=metadata["dp_cp_group"])[f"{at}weight"]
        if swiglu:
            sh = apply_swiglu_sharded_factory(sh, expert_offsets, singleton, tp_group=module.tp_group,
                                              dp_group=metadata["dp_cp_group"])
        sh.replica_id = (*sh.replica_id[:2], module.dp_group.rank())  # SequentialMLP: replicated over expert DP
        out.extend(sh.build() if swiglu else [sh])
    return out


def _merge(swiglu: bool, parts: list[Any]) -> Any:
    """The loaded pieces, in `_build`'s order, back into [E_local, ...] (SwiGLU: each expert's two halves)."""
    import torch

    experts = [torch.cat(parts[i:i + 2]) for i in range(0, len(parts), 2)] if swiglu else parts
    return torch.stack(experts)


def stack_sequential_keys(state_dict: dict[str, Any], prefix: str, num_local_experts: int) -> None:
    """SequentialMLP's `{prefix}local_experts.<e>.linear_fc{1,2}.weight` (and their empty `_extra_state`) in
    `state_dict`, in place, as the grouped `{prefix}weight1` / `{prefix}weight2`: its state dicts load here."""
    import torch

    for name, fc, _ in FCS:
        for e in range(num_local_experts):  # what _extra_states wrote, or SequentialMLP's: nothing to load
            state_dict.pop(f"{prefix}local_experts.{e}.{fc}._extra_state", None)
        keys = [f"{prefix}local_experts.{e}.{fc}.weight" for e in range(num_local_experts)]
        if f"{prefix}{name}" in state_dict or not all(k in state_dict for k in keys):
            continue
        state_dict[f"{prefix}{name}"] = torch.stack([state_dict.pop(k) for k in keys])
