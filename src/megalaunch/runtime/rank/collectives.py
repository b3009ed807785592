"""The few collectives megalaunch adds to Megatron's: one integer reduced or broadcast over the default
process group (torch imported inside each function: the runtime starts without it)."""

from __future__ import annotations

from typing import Any


def collective_device() -> Any:
    """The device a tensor for the default process group must live on (gloo: CPU)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(value: int) -> int:
    """The largest `value` over all ranks (the process group must be up)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_from_zero(value: int) -> int:
    """Rank 0's `value` on every rank (this rank's own without torch.distributed)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.broadcast(t, 0)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (this rank's own without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    return bool(all_reduce_max(int(flag)))
