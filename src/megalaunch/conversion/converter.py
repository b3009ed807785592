"""What the two conversions share (they live in to_mcore.py and to_hf.py), streaming tensor group by
tensor group.

hf_to_mcore: Hugging Face safetensors -> Megatron-core torch_dist checkpoint (`release` or iter_N).
mcore_to_hf: a complete Megatron-core checkpoint (a run, its checkpoints/ or an iteration directory)
             -> Hugging Face safetensors + config.json in the checkpoint's dtype.

Both work one Megatron tensor at a time (its sources: a layer's q/k/v, gate/up, ...): mcore_to_hf
one after the other, hf_to_mcore several at once on a few threads under a byte budget for the tensors
in flight (1.5x the largest tensor group by default). Peak memory stays near the largest tensor group
(the embedding for most models) instead of the model."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.conversion.checkpoint_io import mcore_layout
from megalaunch.conversion.dims import Dims
from megalaunch.conversion.errors import ConversionError, MissingFileError
from megalaunch.conversion.tables import Item

if TYPE_CHECKING:
    import torch

CONVERSION_KEY = "megalaunch_conversion"
ASSETS_DIR = "hf_assets"
# hf-to-mcore: writer threads, and the default budget for the bytes of tensors in flight (a multiple
# of the largest tensor group: room for the largest one plus smaller ones alongside it).
DEFAULT_THREADS = 4
INFLIGHT_FACTOR = 1.5
# Files that travel with the weights: tokenizer and generation settings.
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


@dataclass
class Report:
    """What a conversion did (printed by the CLI, measured by the benchmark)."""

    output: Path
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    largest_group_bytes: int = 0
    threads: int = 1
    max_inflight_bytes: int = 0
    """hf-to-mcore: the byte budget for tensors in flight."""
    peak_inflight_bytes: int = 0
    """hf-to-mcore: most bytes of tensors in flight at once (<= max_inflight_bytes unless one tensor is larger)."""
    notes: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds else 0.0


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    if name in (None, "", "auto"):
        return None
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = getattr(torch, aliases.get(name, name), None)
    if not isinstance(value, torch.dtype):
        raise ConversionError(f"dtype {name!r}", field="--dtype", valid="bfloat16, float16, float32, auto")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist", fix="point at a Hugging Face model directory")
    return dict(json.loads(path.read_text()))


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """A Hugging Face directory's config.json, or the error that says what is missing (no torch needed: the
    CLI asks before importing it)."""
    if not hf_dir.is_dir():
        raise MissingFileError(f"{hf_dir} is not a directory")
    return _read_json(hf_dir / "config.json")


def _stacked_shape(item: Item, dims: Dims) -> tuple[int, ...]:
    """The global tensor's shape: layer tensors stacked on a leading layer axis, expert tensors also on the
    expert axis after it."""
    shape = dims.shape(item.rule.mcore_shape)
    layer = (dims.num_layers,) if item.stacked else ()  # a layer under its own key has no layer axis
    return (*layer, dims.num_experts, *shape) if item.rule.per_expert else (*layer, *shape)


def _hf_shapes(item: Item, dims: Dims) -> list[tuple[int, ...]]:
    return [dims.shape(s) for s in item.rule.hf_shapes]


def largest_group_bytes(work: list[Item], dims: Dims, element_size: int) -> int:
    """Bytes of the largest tensor group converted together: the embedding (or output layer) on its own,
    or one transformer layer without its routed experts, or one routed expert (a layer of 128 experts is
    converted expert by expert: its size does not decide the budget). Peak memory is bounded by about twice this."""
    sizes: dict[object, int] = {}
    for item in work:
        group = (item.layer, item.expert) if item.rule.per_expert else item.layer if item.rule.per_layer \
            else item.rule.mcore
        sizes[group] = sizes.get(group, 0) + _numel(dims.shape(item.rule.mcore_shape)) * element_size
    return max(sizes.values())


def _prepare_output(out: Path, iteration: int | None, overwrite: bool) -> Path:
    target = out / mcore_layout.iteration_dir_name(iteration)
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise ConversionError(f"{target} already exists and is not empty",
                                  fix="choose another --out, or pass --overwrite")
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    return target


# ----------------------------------------------------------------------------------- HF -> Megatron


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Staging:
    """One reusable buffer (mcore-to-hf reads each Megatron tensor into it and writes it out before
    reading the next, so fresh pages are not faulted in for every tensor)."""

    buffer: torch.Tensor | None = None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> torch.Tensor:
        import torch

        if self.buffer is None:
            # torch.empty leaves the pages untouched until used (a bytearray zeroes all of them)
            self.buffer = torch.empty(capacity, dtype=torch.uint8)
        nbytes = _numel(shape) * dtype.itemsize
        return self.buffer[:nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


# A dtype conversion (--dtype) reads the source rows through a scratch buffer of at most this size.
def _offset(item: Item, ndim: int) -> tuple[int, ...]:
    """Global offset of one item: its layer on the stacked axis (and its expert on the expert axis), then zeros."""
    layer = (item.layer or 0,) if item.stacked else ()
    expert = (item.expert or 0,) if item.rule.per_expert else ()
    return layer + expert + (0,) * ndim
