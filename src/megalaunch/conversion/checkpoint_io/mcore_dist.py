"""Megatron-core's `dist_checkpointing` called from one process (torch_dist format): the one-process
gloo group it needs to save or load (`process_group`), a checkpoint's tensor metadata and common state,
and requested chunks of its global tensors (`load`). Tensors are Megatron's global tensors (layer
tensors stacked on a leading layer axis), saved as sharded tensors so any TP/PP loads them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """dist_checkpointing needs torch.distributed; outside a job, make a one-process gloo group."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tensors_metadata(ckpt: Path) -> dict[str, Any]:
    """key -> ShardedTensor without data (global shape and dtype) for every tensor in the checkpoint."""
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_tensors_metadata(str(ckpt)))


def load_common(ckpt: Path) -> dict[str, Any]:
    import warnings

    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        # Megatron reads common.pt through torch's checkpoint reader in no-dist mode on purpose, and
        # torch warns each time that it assumes one process: true, and not the user's concern.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        return dict(dist_checkpointing.load_common_state_dict(str(ckpt)) or {})


@dataclass(frozen=True)
class ShardRequest:
    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    stacked: bool
    dtype: torch.dtype


def load(ckpt: Path, requests: list[ShardRequest]) -> list[torch.Tensor]:
    """Read the requested chunks (all in one pass over the checkpoint's files)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    state: dict[str, Any] = {}
    for n, r in enumerate(requests):
        # One layer of a stacked tensor, as an explicit chunk of the global tensor (no regular grid:
        # in one process a grid would claim every layer as local and demand all of them).
        shape = ((1,) if r.stacked else ()) + r.local_shape
        state[str(n)] = ShardedTensor(key=r.key, data=torch.empty(shape, dtype=r.dtype), dtype=r.dtype,
                                      local_shape=shape, global_shape=r.global_shape, global_offset=r.offset,
                                      axis_fragmentations=None, replica_id=0)
    loaded = dist_checkpointing.load(state, str(ckpt), validate_access_integrity=False)
    return [loaded[str(n)][0] if r.stacked else loaded[str(n)] for n, r in enumerate(requests)]
