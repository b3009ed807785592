"""Megatron's mixture-of-experts path on the CPU (gloo): the accommodations beyond runtime/model/cpu_compat.py.

- The alltoall token dispatcher moves its split sizes (tokens per expert-parallel rank) to the host with
  `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts only CUDA tensors: on the CPU
  the splits stayed tensors, and gloo's `all_to_all_single` refuses tensors as split sizes. A CPU tensor
  asked for as numpy becomes numpy here, as a CUDA one would. The dispatcher's device-to-host stream and
  event are cpu_compat's stand-ins (already complete).
- With expert TP > 1 (EP x TP) the dispatcher gathers and reduce-scatters tokens over the expert-TP group
  in *unequal* pieces (`mappings._gather_along_first_dim` / `_reduce_scatter_along_first_dim` with split
  sizes); gloo's all_gather wants equal tensors. Unequal gathers are padded to the largest piece and
  cut back; unequal reduce-scatters are an all-reduce of the whole tensor, then this rank's piece (the
  same sums; more bytes, which a CPU test does not mind). Equal ones stay Megatron's.

`enable()` runs from cpu_compat.enable(), once per process, only on a CPU job."""

from __future__ import annotations

from typing import Any


def _move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    import torch

    if torch.is_tensor(tensor):
        tensor = tensor.to(torch.device("cpu"))
        if as_numpy:
            return tensor.numpy()
    return tensor


def _gather_unequal(input_: Any, group: Any, sizes: list[int]) -> Any:
    import torch
    import torch.distributed as dist

    widest = max(sizes)
    padded = input_.new_zeros((widest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    pieces = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(pieces, sizes, strict=True)], dim=0)


def _reduce_scatter_unequal(input_: Any, group: Any, sizes: list[int]) -> Any:
    import torch.distributed as dist

    total = input_.contiguous().clone()
    dist.all_reduce(total, group=group)
    start = sum(sizes[: group.rank()])
    return total[start:start + sizes[group.rank()]].clone()


def _patch_mappings() -> None:
    import megatron.core.tensor_parallel.mappings as mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_: Any, group: Any, output_split_sizes: Any = None,
                               use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return _gather_unequal(input_, group, [int(n) for n in output_split_sizes])

    def reduce_scatter_along_first_dim(input_: Any, group: Any, input_split_sizes: Any = None,
                                       use_global_buffer: bool = False) -> Any:
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return _reduce_scatter_unequal(input_, group, [int(n) for n in input_split_sizes])

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def enable() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _move_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _move_to_cpu  # imported by name there
    _patch_mappings()
