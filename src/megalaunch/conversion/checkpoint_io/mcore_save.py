"""Saving a Megatron-core checkpoint as a stream: each tensor is produced only when a writer thread
takes it, one tensor per file, under a byte budget for the tensors in flight (scheduler.py), so
memory holds about that budget instead of the model. Sharded tensors, so any TP/PP loads them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LazyShard:
    """One chunk of a global tensor, produced on demand into a buffer the writer provides."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    """Global offset of the chunk along each dimension (layer axis first for stacked tensors)."""
    local_shape: tuple[int, ...]
    """Chunk shape without the stacked layer axis."""
    stacked: bool
    dtype: torch.dtype
    produce: Callable[[torch.Tensor, torch.Tensor | None], None]
    """produce(out, scratch) fills `out` (local_shape, dtype); scratch: scratch_bytes of uint8, or None."""
    allow_shape_mismatch: bool = False
    nbytes: int = 0
    expert_axis: bool = False
    """A routed expert's tensor: the global tensor's second axis is the expert index (offset[1]), stacked too."""
    scratch_bytes: int = 0
    """Working memory produce needs besides `out` (a dtype conversion reads through it)."""


@dataclass
class SaveStats:
    """What the bounded writer did (for the report and the benchmark)."""

    max_inflight_bytes: int = 0
    threads: int = 0
    peak_inflight_bytes: int = 0
    peak_buffer_bytes: int = 0
    max_concurrent: int = 0


def _sharded_tensor(shard: LazyShard) -> Any:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = torch.empty(shard.local_shape, dtype=shard.dtype, device="meta")
    return _from_offsets(ShardedTensor, shard.key, data, shard.global_shape, shard.offset, shard.stacked,
                         shard.allow_shape_mismatch, shard.expert_axis)


def _from_offsets(cls: Any, key: str, data: Any, global_shape: tuple[int, ...], offset: tuple[int, ...],
                  stacked: bool, allow_shape_mismatch: bool = False, expert_axis: bool = False) -> Any:
    """A ShardedTensor as Megatron's layers build them: layer tensors get a prepended layer axis
    (one fragment per layer), a routed expert's tensor also the expert axis after it (one fragment per
    layer and expert), everything else is one whole-tensor chunk."""
    axes: tuple[tuple[int, int, int], ...] = ((0, offset[0], global_shape[0]),) if stacked else ()
    if expert_axis:  # after the layer axis, or first for a layer under its own key
        n = len(axes)
        axes += ((n, offset[n], global_shape[n]),)
    return cls.from_rank_offsets(key, data, *axes, replica_id=0, prepend_axis_num=len(axes),
                                 allow_shape_mismatch=allow_shape_mismatch)


def save(directory: Path, shards: list[LazyShard], common: dict[str, Any], *, max_inflight_bytes: int,
         threads: int = 4, extra_state: tuple[str, ...] = (), num_layers: int = 0, fsync: bool = False,
         crc32: bool = False, on_written: Callable[[LazyShard], None] | None = None,
         expert_extra_state: tuple[str, ...] = (), num_experts: int = 0,
         objects: list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None) -> SaveStats:
    """Write a torch_dist checkpoint into the empty `directory` from lazily produced shards.

    Up to `threads` shards are produced and written at once, as long as their bytes fit in
    `max_inflight_bytes` (a shard larger than that is written alone); each shard's buffer is released
    as soon as its file is written. `extra_state`: layer modules (`mlp.linear_fc1`) whose empty
    `_extra_state` objects Megatron expects; `expert_extra_state` the same per layer and routed expert
    (`mlp.experts.experts.linear_fc1`: [layers, experts] objects, as SequentialMLP saves them). crc32: write zip checksums into the torch.save archives
    (torch.load does not check them; computing them costs about as much as writing the data). `objects`: more
    empty `_extra_state` objects as (key, global shape, offset), for layers saved under keys of their own."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megalaunch.conversion.checkpoint_io.scheduler import BufferPool

    lookup = {(s.key, tuple(s.offset)): s for s in shards}
    state: dict[str, Any] = dict(common)
    model: dict[str, Any] = {f"{s.key}@{','.join(map(str, s.offset))}": _sharded_tensor(s) for s in shards}
    for module in extra_state:
        key = f"decoder.layers.{module}._extra_state"
        for i in range(num_layers):
            model[f"{key}@{i}"] = ShardedObject(key, None, (num_layers,), (i,), replica_id=0)
    for module in expert_extra_state:
        key = f"decoder.layers.{module}._extra_state"
        for i in range(num_layers):
            for e in range(num_experts):
                model[f"{key}@{i},{e}"] = ShardedObject(key, None, (num_layers, num_experts), (i, e), replica_id=0)
    for key, shape, offset in objects or ():
        model[f"{key}@{','.join(map(str, offset))}"] = ShardedObject(key, None, shape, offset, replica_id=0)
    state["model"] = model
    pool: BufferPool = BufferPool(max_inflight_bytes)
    strategy = _lazy_strategy_class()(lookup, pool=pool, threads=threads, fsync=fsync, on_written=on_written)
    with _crc32(crc32):
        dist_checkpointing.save(state, str(directory), sharded_strategy=strategy, validate_access_integrity=True)
    pool.clear()
    return SaveStats(max_inflight_bytes=pool.limit, threads=threads, peak_inflight_bytes=pool.peak_leased,
                     peak_buffer_bytes=pool.peak_held, max_concurrent=pool.max_leases)


@contextlib.contextmanager
def _crc32(enabled: bool) -> Iterator[None]:
    """torch.save computes a CRC32 of every record unless told not to (torch >= 2.6)."""
    import torch.serialization as ts

    get, set_ = getattr(ts, "get_crc32_options", None), getattr(ts, "set_crc32_options", None)
    if get is None or set_ is None:
        yield
        return
    before = get()
    set_(enabled)
    try:
        yield
    finally:
        set_(before)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _exact_tensor(buffer: torch.Tensor, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the first nbytes of `buffer` whose storage is exactly its own size (torch.save
    writes a tensor's whole storage)."""
    import torch

    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(memoryview(buffer.numpy())[:nbytes], dtype=dtype).view(shape)


def _fsync_all(directory: str | os.PathLike[str], names: list[str]) -> None:
    for name in names:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# Over 60 lines on purpose: the two classes subclass torch and Megatron classes, so they are defined
# when first needed (importing this module stays cheap); each of their methods is short.
def _lazy_strategy_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from megalaunch.conversion.checkpoint_io.scheduler import BufferPool, run_in_order

    class BoundedWriter(FileSystemWriter):
        """Byte objects share one file; each tensor gets its own, produced and written by a pool of
        threads under a byte budget for the tensors in flight (torch's writer resolves every tensor
        of a file before closing it, and bounds threads, not bytes)."""

        def __init__(self, path: str, *, lookup: dict[tuple[str, tuple[int, ...]], LazyShard],
                     pool: BufferPool, threads: int, fsync: bool,
                     on_written: Callable[[LazyShard], None] | None) -> None:
            super().__init__(path, single_file_per_rank=True, thread_count=1, sync_files=fsync)
            self.lookup = lookup
            self.pool = pool
            self.threads = threads
            self.on_written = on_written

        def write_data(self, plan: Any, planner: Any) -> Any:
            from torch.distributed.checkpoint.filesystem import _StorageInfo
            from torch.distributed.checkpoint.planner import WriteItemType
            from torch.distributed.checkpoint.storage import WriteResult
            from torch.futures import Future

            prefix = plan.storage_data.prefix
            byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            order = {k: n for n, k in enumerate(self.lookup)}
            tensor_items = sorted((i for i in plan.items if i.type != WriteItemType.BYTE_IO),
                                  key=lambda i: order[(i.index.fqn, tuple(i.index.offset))])
            results: list[Any] = []
            written: list[str] = []
            first = 0
            if byte_items:
                name = f"{prefix}0.distcp"
                with open(os.path.join(self.path, name), "wb") as f:
                    for item in byte_items:
                        data = planner.resolve_data(item)
                        offset = f.tell()
                        f.write(data.getbuffer())
                        results.append(WriteResult(index=item.index, size_in_bytes=f.tell() - offset,
                                                   storage_data=_StorageInfo(name, offset, f.tell() - offset)))
                written.append(name)
                first = 1
            jobs = [(f"{prefix}{first + n}.distcp", item, self.lookup[(item.index.fqn, tuple(item.index.offset))])
                    for n, item in enumerate(tensor_items)]

            def work(job: tuple[str, Any, LazyShard], buffer: Any) -> Any:
                import torch

                name, item, shard = job
                out = _exact_tensor(buffer, shard.nbytes, shard.dtype, shard.local_shape) if buffer is not None \
                    else torch.empty(shard.local_shape, dtype=shard.dtype)
                scratch = buffer[_aligned(shard.nbytes):size(job)] if shard.scratch_bytes else None
                shard.produce(out, scratch)
                data = out.view(tuple(item.tensor_data.chunk.sizes))  # with the stacked layer axis
                with open(os.path.join(self.path, name), "wb") as f:
                    torch.save(data, f)
                    length = f.tell()
                del data, out, scratch
                if self.on_written is not None:
                    self.on_written(shard)
                return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, 0, length))

            def size(job: tuple[str, Any, LazyShard]) -> int:
                shard = job[2]
                return _aligned(shard.nbytes) + shard.scratch_bytes if shard.scratch_bytes else shard.nbytes

            results += run_in_order(jobs, size, work, threads=self.threads, pool=self.pool)
            written += [j[0] for j in jobs]
            if self.sync_files:  # after all writes: the device flushes in the background meanwhile
                _fsync_all(self.path, written)
            future: Future[list[Any]] = Future()
            future.set_result(results)
            return future

    class LazyTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def __init__(self, lookup: dict[tuple[str, tuple[int, ...]], LazyShard], *, pool: BufferPool,
                     threads: int, fsync: bool, on_written: Callable[[LazyShard], None] | None) -> None:
            super().__init__("torch_dist", 1, keep_only_main_replica=True, thread_count=threads)
            self.lookup = lookup
            self.pool = pool
            self.threads = threads
            self.fsync = fsync
            self.on_written = on_written

        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded, False)
            writer = BoundedWriter(str(checkpoint_dir), lookup=self.lookup, pool=self.pool, threads=self.threads,
                                   fsync=self.fsync, on_written=self.on_written)
            planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False,
                                       flatten_sharded_tensors=False)
            dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)

    return LazyTorchDistSaveStrategy
