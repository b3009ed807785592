"""The Megatron-core side: checkpoint directories as Megatron writes them, and streaming
save/load through `megatron.core.dist_checkpointing` (torch_dist format).

Layout (what `megatron.training` writes and reads):
    CKPT/latest_checkpointed_iteration.txt      "N" or "release", written last (atomically)
    CKPT/iter_000000N/ (or CKPT/release/)        metadata.json, .metadata, __0_*.distcp
Tensors are Megatron's global tensors (layer tensors stacked on a leading layer axis), saved as
sharded tensors so any TP/PP loads them. Saving resolves each tensor only when the writer reaches
it, one tensor per file, so memory holds one tensor group at a time instead of the model."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.conversion.errors import ConversionError, IncompleteCheckpointError, MissingFileError

if TYPE_CHECKING:
    import torch

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"


def iteration_dir_name(iteration: int | None) -> str:
    return RELEASE if iteration is None else f"iter_{iteration:07d}"


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: its directory and iteration (None for a release checkpoint)."""

    path: Path
    iteration: int | None


def read_tracker(root: Path) -> int | None:
    """The tracker's iteration (None for "release"); raises if it is absent or garbled."""
    tracker = root / TRACKER
    if not tracker.is_file():
        raise IncompleteCheckpointError(f"no {TRACKER} in {root}: no complete checkpoint was saved there",
                                        fix="pass the checkpoint directory a training run saved into, "
                                            "or --iteration N for a specific iter_N directory")
    text = tracker.read_text().strip()
    if text == RELEASE:
        return None
    if not text.isdigit():
        raise IncompleteCheckpointError(f"{tracker} holds {text!r}, not an iteration or 'release'")
    return int(text)


def checkpoint_root(path: Path) -> Path:
    """A run directory -> its checkpoints/; a checkpoint directory stays itself."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{path} does not exist")
    if (path / "checkpoints").is_dir() and not (path / TRACKER).exists():
        return path / "checkpoints"
    return path


def _refuse_untracked(root: Path, iteration: int) -> None:
    """Megatron updates the tracker after a save completes: an iteration beyond it may be half written."""
    if not (root / TRACKER).is_file():
        return
    tracked = read_tracker(root)
    if tracked is not None and iteration > tracked:
        raise IncompleteCheckpointError(f"iteration {iteration} is newer than the tracker's {tracked} in {root}: "
                                        "it may be incomplete (still being written, or interrupted)",
                                        fix=f"use --iteration {tracked} or leave --iteration out")


def resolve(path: Path, iteration: int | None = None) -> CheckpointRef:
    """Find the complete checkpoint meant by `path`: a run directory, a checkpoint directory (its
    tracker, or `iteration`), or an iteration directory itself."""
    path = Path(path)
    if (path / "metadata.json").is_file() and iteration is None:
        name = path.name
        it = int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None
        if it is not None:
            _refuse_untracked(path.parent, it)
        check_complete(path)
        return CheckpointRef(path, it)
    root = checkpoint_root(path)
    if iteration is None:
        tracked = read_tracker(root)
        ref = CheckpointRef(root / iteration_dir_name(tracked), tracked)
        if not ref.path.is_dir():
            raise IncompleteCheckpointError(f"the tracker in {root} points at {ref.path.name}, which does not exist")
    else:
        _refuse_untracked(root, iteration)
        ref = CheckpointRef(root / iteration_dir_name(iteration), iteration)
        if not ref.path.is_dir():
            have = sorted(p.name for p in root.glob("iter_*"))
            raise MissingFileError(f"{ref.path} does not exist", valid=", ".join(have) or "no iter_* directories")
    check_complete(ref.path)
    return ref


def check_complete(ckpt: Path) -> None:
    """metadata.json names torch_dist, .metadata exists, and every data file it references is there
    and long enough."""
    meta = ckpt / "metadata.json"
    if not meta.is_file():
        raise IncompleteCheckpointError(f"{ckpt} has no metadata.json: the save did not finish")
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except json.JSONDecodeError as e:
        raise IncompleteCheckpointError(f"{meta} is not valid JSON ({e.msg})") from None
    if backend != "torch_dist":
        raise ConversionError(f"{ckpt} is a {backend!r} checkpoint; only torch_dist converts",
                              fix="save with --ckpt-format torch_dist (megalaunch's default)")
    if not (ckpt / ".metadata").is_file():
        raise IncompleteCheckpointError(f"{ckpt} has no .metadata: the save did not finish")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as e:  # a truncated pickle raises anything
        raise IncompleteCheckpointError(f"{ckpt}/.metadata is unreadable ({type(e).__name__})") from None
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in need.items():
        f = ckpt / rel
        if not f.is_file():
            raise IncompleteCheckpointError(f"{ckpt} lacks data file {rel}")
        if f.stat().st_size < size:
            raise IncompleteCheckpointError(f"{f} is truncated ({f.stat().st_size} of {size} bytes)")


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


# ---------------------------------------------------------------------------------------------- save


@dataclass(frozen=True)
class LazyShard:
    """One chunk of a global tensor, produced on demand."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    """Global offset of the chunk along each dimension (layer axis first for stacked tensors)."""
    local_shape: tuple[int, ...]
    """Chunk shape without the stacked layer axis."""
    stacked: bool
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    allow_shape_mismatch: bool = False
    nbytes: int = 0


def _sharded_tensor(shard: LazyShard) -> Any:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = torch.empty(shard.local_shape, dtype=shard.dtype, device="meta")
    return _from_offsets(ShardedTensor, shard.key, data, shard.global_shape, shard.offset, shard.stacked,
                         shard.allow_shape_mismatch)


def _from_offsets(cls: Any, key: str, data: Any, global_shape: tuple[int, ...], offset: tuple[int, ...],
                  stacked: bool, allow_shape_mismatch: bool = False) -> Any:
    """A ShardedTensor as Megatron's layers build them: layer tensors get a prepended layer axis
    (one fragment per layer), everything else is one whole-tensor chunk."""
    layer_axis = ((0, offset[0], global_shape[0]),) if stacked else ()
    return cls.from_rank_offsets(key, data, *layer_axis, replica_id=0, prepend_axis_num=len(layer_axis),
                                 allow_shape_mismatch=allow_shape_mismatch)


def save(directory: Path, shards: list[LazyShard], common: dict[str, Any], *, threads: int = 1,
         extra_state: tuple[str, ...] = (), num_layers: int = 0, fsync: bool = False,
         on_written: Callable[[LazyShard], None] | None = None) -> None:
    """Write a torch_dist checkpoint into the empty `directory` from lazily produced shards.
    `extra_state`: layer modules (`mlp.linear_fc1`) whose empty `_extra_state` objects Megatron expects."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    lookup = {(s.key, tuple(s.offset)): s for s in shards}
    state: dict[str, Any] = dict(common)
    model: dict[str, Any] = {f"{s.key}@{','.join(map(str, s.offset))}": _sharded_tensor(s) for s in shards}
    for module in extra_state:
        key = f"decoder.layers.{module}._extra_state"
        for i in range(num_layers):
            model[f"{key}@{i}"] = ShardedObject(key, None, (num_layers,), (i,), replica_id=0)
    state["model"] = model
    strategy = _lazy_strategy_class()(lookup, threads=threads, fsync=fsync, on_written=on_written)
    dist_checkpointing.save(state, str(directory), sharded_strategy=strategy, validate_access_integrity=True)


def _lazy_strategy_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class LazyPlanner(MCoreSavePlanner):
        def __init__(self, lookup: dict[tuple[str, tuple[int, ...]], LazyShard],
                     on_written: Callable[[LazyShard], None] | None, **kw: Any) -> None:
            super().__init__(**kw)
            self.lookup = lookup
            self.on_written = on_written

        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            if getattr(data, "is_meta", False):
                shard = self.lookup[(write_item.index.fqn, tuple(write_item.index.offset))]
                tensor = shard.produce()
                if tuple(tensor.shape) != shard.local_shape or tensor.dtype != shard.dtype:
                    raise ConversionError(f"{shard.key}: produced {tensor.dtype}{list(tensor.shape)}, "
                                          f"expected {shard.dtype}{list(shard.local_shape)}")
                data = tensor.contiguous().view(data.shape)
                if self.on_written is not None:
                    self.on_written(shard)
            return data

    class OneTensorPerFileWriter(FileSystemWriter):
        """Byte objects share one file; each tensor gets its own, so the writer holds one tensor
        per thread (torch's writer keeps every tensor of a file alive until the file is closed)."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            import queue

            from torch.distributed.checkpoint.planner import WriteItemType

            prefix = plan.storage_data.prefix
            files: queue.Queue = queue.Queue()
            byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
            groups = ([byte_items] if byte_items else []) + [[i] for i in tensor_items]
            for n, group in enumerate(groups):
                name = f"{prefix}{n}.distcp"
                files.put((self.fs.concat_path(self.path, name), name, group))
            return self._write_data(planner, files)

    class LazyTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def __init__(self, lookup: dict[tuple[str, tuple[int, ...]], LazyShard], *, threads: int, fsync: bool,
                     on_written: Callable[[LazyShard], None] | None) -> None:
            super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=threads)
            self.lookup = lookup
            self.fsync = fsync
            self.on_written = on_written

        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded, False)
            writer = OneTensorPerFileWriter(str(checkpoint_dir), single_file_per_rank=True,
                                            thread_count=self.thread_count, sync_files=self.fsync)
            planner = LazyPlanner(self.lookup, self.on_written, dedup_replicated_tensors=False,
                                  flatten_state_dict=False, flatten_sharded_tensors=False)
            dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)

    return LazyTorchDistSaveStrategy


def write_tracker(root: Path, iteration: int | None) -> None:
    tmp = root / (TRACKER + ".tmp")
    tmp.write_text(("release" if iteration is None else str(iteration)) + "\n")
    os.replace(tmp, root / TRACKER)


# ---------------------------------------------------------------------------------------------- load


def tensors_metadata(ckpt: Path) -> dict[str, Any]:
    """key -> ShardedTensor without data (global shape and dtype) for every tensor in the checkpoint."""
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_tensors_metadata(str(ckpt)))


def load_common(ckpt: Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

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
