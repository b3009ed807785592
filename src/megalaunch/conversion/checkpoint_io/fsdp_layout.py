"""Megatron-FSDP's `fsdp_dtensor` checkpoints (`parallel.data_sharding`), read for conversion: the model's
weights rewritten as a torch_dist checkpoint (weights, args, iteration), which every other reader of
megalaunch takes (conversion to Hugging Face, evaluation at milestones).

The layout, as megatron-core 0.19.2 writes it (torch.distributed.checkpoint, no `metadata.json`):
    model.module.embedding.word_embeddings.weight                 one tensor per parameter, per layer:
    model.module.decoder.layers.<i>.self_attention.linear_qkv.weight   torch_dist stacks the layers instead
    model.module.decoder.layers.<i>.mlp.linear_fc1.weight_w / _v   SwiGLU's two halves, saved apart
    args, iteration, optimizer.*, rng_state.*, ...
The layers are stacked on a new first axis (torch_dist's `decoder.layers.<name>`, the local layers' norms
renamed as torch_dist names them) and fc1's halves put back one after the other (W, then V: torch_dist's
global fc1). Each tensor is read when the writer needs it, so
memory holds the writer's budget, not the model."""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.conversion.errors import ConversionError

if TYPE_CHECKING:
    import torch

PREFIX = "model.module."
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
HALVES = ("_w", "_v")
# The local layers' norms under the names torch_dist gives them (Megatron's sharded_state_dict_keys_map)
TORCH_DIST_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
                    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


def _tensor_keys(ckpt: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k[len(PREFIX):]: v for k, v in meta.items() if k.startswith(PREFIX) and hasattr(v, "size")}


def _load(ckpt: Path, state: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)


def weights(ckpt: Path) -> tuple[dict[str, tuple[tuple[int, ...], Any, list[list[str]]]], int]:
    """torch_dist key -> (global shape, dtype, the fsdp keys of each slice: per layer, fc1's halves in order),
    and the number of layers."""
    keys = _tensor_keys(ckpt)
    layers: dict[str, dict[int, list[str]]] = defaultdict(dict)
    out: dict[str, tuple[tuple[int, ...], Any, list[list[str]]]] = {}
    for key in sorted(keys):
        m = LAYER.fullmatch(key)
        if m is None:
            out[key] = (tuple(keys[key].size), keys[key].properties.dtype, [[PREFIX + key]])
            continue
        name = m.group(2)
        if name.endswith(HALVES):
            base = name[:-2]
            parts = layers[f"decoder.layers.{base}"].setdefault(int(m.group(1)), [])
            parts.append(PREFIX + key)
            parts.sort(key=lambda k: HALVES.index(k[-2:]))
        else:
            layers[f"decoder.layers.{TORCH_DIST_NAMES.get(name, name)}"][int(m.group(1))] = [PREFIX + key]
    count = max((max(per) + 1 for per in layers.values()), default=0)
    for name, per in layers.items():
        if sorted(per) != list(range(count)):
            raise ConversionError(f"{ckpt}: {name} is saved for layers {sorted(per)} of {count}")
        first = [keys[k[len(PREFIX):]] for k in per[0]]
        rows = sum(int(f.size[0]) for f in first)
        out[name] = ((count, rows, *map(int, first[0].size[1:])), first[0].properties.dtype,
                     [per[i] for i in range(count)])
    return out, count


def saved_objects(ckpt: Path) -> dict[str, Any]:
    """The run's Megatron args and iteration, as saved."""
    state: dict[str, Any] = {"args": None, "iteration": None}
    _load(ckpt, state)
    return state


def to_torch_dist(ckpt: Path, target: Path, *, max_inflight_bytes: int = 2**30) -> int:
    """Write `ckpt`'s model weights as a torch_dist checkpoint into the empty directory `target`, in the run's
    precision (bf16 for a bf16 run, as torch_dist stores the model; FSDP saved fp32 main weights); returns the
    iteration. Megatron reads it as weights (the optimizer's state stays in the fsdp_dtensor checkpoint)."""
    import torch

    from megalaunch.conversion.checkpoint_io import mcore_save
    from megalaunch.conversion.tables import EXTRA_STATE_MODULES

    table, count = weights(ckpt)
    saved = saved_objects(ckpt)
    meta = _tensor_keys(ckpt)
    lock = threading.Lock()

    def producer(parts: list[str]) -> Any:
        def produce(out: torch.Tensor, scratch: torch.Tensor | None) -> None:
            del scratch
            with lock:  # one reader of the checkpoint's files at a time
                state: dict[str, Any] = {}
                for k in parts:
                    info = meta[k[len(PREFIX):]]
                    state[k] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
                _load(ckpt, state)
            out.copy_(torch.cat([state[k] for k in parts]) if len(parts) > 1 else state[parts[0]])
        return produce

    args = saved["args"]
    working = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
    shards = []
    for key, (shape, saved_dtype, slices) in table.items():
        dtype = working or saved_dtype  # FSDP saves the fp32 main weights; torch_dist the model's (bf16)
        stacked = len(slices) > 1 or key.startswith("decoder.layers.")
        for i, parts in enumerate(slices):
            local = shape[1:] if stacked else shape
            offset = ((i,) if stacked else ()) + (0,) * len(local)
            nbytes = int(torch.Size(local).numel()) * dtype.itemsize
            shards.append(mcore_save.LazyShard(key, shape, offset, local, stacked, dtype, producer(parts),
                                               nbytes=nbytes))
    common = {"args": saved["args"], "checkpoint_version": 3.0, "iteration": int(saved["iteration"] or 0)}
    target.mkdir(parents=True, exist_ok=True)
    mcore_save.save(target, shards, common, max_inflight_bytes=max_inflight_bytes, threads=2,
                    extra_state=EXTRA_STATE_MODULES, num_layers=count)
    return int(common["iteration"])
