"""Named tensor transforms between Hugging Face and Megatron-core layouts.

Each transform is a pair of pure functions: `to_mcore(dims, *hf_tensors) -> tensor` and
`to_hf(dims, tensor) -> tuple of hf tensors`; `to_hf(to_mcore(x)) == x` bit for bit. torch is
imported by the caller: these functions only use tensor methods."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megalaunch.conversion.dims import Dims

if TYPE_CHECKING:
    import torch


def _copy_to_mcore(dims: Dims, t: torch.Tensor) -> torch.Tensor:
    return t


def _copy_to_hf(dims: Dims, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t,)


def _qkv_to_mcore(dims: Dims, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron interleaves per query group: [q heads of group g, k_g, v_g] for g in groups.
    Works for weights [out, hidden] and biases [out]."""
    import torch

    g, d = dims.groups, dims.head_dim
    rest = tuple(q.shape[1:])
    per_group = dims.heads // g * d
    fused = torch.cat([q.reshape(g, per_group, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (per_group + 2 * d), *rest)


def _qkv_to_hf(dims: Dims, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g, d = dims.groups, dims.head_dim
    rest = tuple(t.shape[1:])
    per_group = dims.heads // g * d
    grouped = t.reshape(g, per_group + 2 * d, *rest)
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return (q.reshape(g * per_group, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def _gated_to_mcore(dims: Dims, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Megatron's linear_fc1 of a gated MLP is [gate; up] along the output dimension."""
    import torch

    return torch.cat([gate, up], dim=0)


def _gated_to_hf(dims: Dims, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gate, up = t.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    import torch

    if rows == t.shape[0]:
        return t
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _vocab_to_mcore(dims: Dims, t: torch.Tensor) -> torch.Tensor:
    """Pad rows with zeros up to the padded vocabulary."""
    return _pad_rows(t, dims.padded_vocab)


def _vocab_to_hf(dims: Dims, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Strip the padding rows (or pad with zeros when Megatron had fewer rows than Hugging Face)."""
    if t.shape[0] >= dims.vocab:
        return (t[: dims.vocab],)
    return (_pad_rows(t, dims.vocab),)


@dataclass(frozen=True)
class Transform:
    name: str
    to_mcore: Callable[..., Any]
    to_hf: Callable[..., tuple[Any, ...]]


TRANSFORMS: dict[str, Transform] = {
    t.name: t
    for t in (
        Transform("copy", _copy_to_mcore, _copy_to_hf),
        Transform("qkv", _qkv_to_mcore, _qkv_to_hf),
        Transform("gated_mlp", _gated_to_mcore, _gated_to_hf),
        Transform("vocab", _vocab_to_mcore, _vocab_to_hf),
    )
}
