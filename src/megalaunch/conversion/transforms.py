"""Named tensor transforms between Hugging Face and Megatron-core layouts.

Every transform of the Llama family moves whole rows (dimension 0): fusing q/k/v with Megatron's
per-group interleave, concatenating gate and up, padding the vocabulary. So each one is declared as
a list of row blocks, `Block(source, start, rows, dest)`: rows `start:start+rows` of Hugging Face
tensor `source` are rows `dest:dest+rows` of the Megatron tensor; rows no block covers are zeros
(vocabulary padding). The same blocks drive both directions and the I/O: hf-to-mcore reads each block
from the safetensors file straight into its place in the Megatron tensor, mcore-to-hf writes each
block from the Megatron tensor straight to its place in the safetensors file; nothing is copied in
between. `to_mcore`/`to_hf` apply the blocks to tensors (tests, and any tensor already in memory)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalaunch.conversion.dims import Dims

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Block:
    source: int
    """Index of the Hugging Face tensor."""
    start: int
    """First row in the Hugging Face tensor."""
    rows: int
    dest: int
    """First row in the Megatron tensor."""


def _copy(dims: Dims, hf_rows: list[int], mcore_rows: int) -> list[Block]:
    return [Block(0, 0, min(hf_rows[0], mcore_rows), 0)]


def _qkv(dims: Dims, hf_rows: list[int], mcore_rows: int) -> list[Block]:
    """Megatron interleaves per query group: [the group's query heads, k_g, v_g] for each group g.
    Rows are output features, so this works for weights [out, hidden] and biases [out] alike."""
    d = dims.head_dim
    per = dims.heads // dims.groups * d
    out = []
    for g in range(dims.groups):
        base = g * (per + 2 * d)
        out += [Block(0, g * per, per, base), Block(1, g * d, d, base + per), Block(2, g * d, d, base + per + d)]
    return out


def _gated(dims: Dims, hf_rows: list[int], mcore_rows: int) -> list[Block]:
    """Megatron's linear_fc1 of a gated MLP is [gate; up] along the output dimension."""
    return [Block(0, 0, hf_rows[0], 0), Block(1, 0, hf_rows[1], hf_rows[0])]


# The vocabulary transform is a copy of the common rows: Megatron's padding rows are zeros on the way
# in and dropped on the way out; if Megatron has fewer rows than Hugging Face, the rest are zeros.
TRANSFORMS: dict[str, Callable[[Dims, list[int], int], list[Block]]] = {
    "copy": _copy, "vocab": _copy, "qkv": _qkv, "gated_mlp": _gated,
}


def blocks(name: str, dims: Dims, hf_rows: list[int], mcore_rows: int) -> list[Block]:
    return TRANSFORMS[name](dims, hf_rows, mcore_rows)


def to_mcore(name: str, dims: Dims, sources: list[torch.Tensor], mcore_shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    out = torch.zeros(mcore_shape, dtype=sources[0].dtype)
    for b in blocks(name, dims, [s.shape[0] for s in sources], mcore_shape[0]):
        out[b.dest:b.dest + b.rows] = sources[b.source][b.start:b.start + b.rows]
    return out


def to_hf(name: str, dims: Dims, tensor: torch.Tensor, hf_shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    import torch

    outs = [torch.zeros(s, dtype=tensor.dtype) for s in hf_shapes]
    for b in blocks(name, dims, [s[0] for s in hf_shapes], tensor.shape[0]):
        outs[b.source][b.start:b.start + b.rows] = tensor[b.dest:b.dest + b.rows]
    return outs
