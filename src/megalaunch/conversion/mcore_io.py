"""The Megatron-core side: checkpoint directories as Megatron writes them, and streaming
save/load through `megatron.core.dist_checkpointing` (torch_dist format).

Layout (what `megatron.training` writes and reads):
    CKPT/latest_checkpointed_iteration.txt      "N" or "release", written last (atomically)
    CKPT/iter_000000N/ (or CKPT/release/)        metadata.json, .metadata, __0_*.distcp
Tensors are Megatron's global tensors (layer tensors stacked on a leading layer axis), saved as
sharded tensors so any TP/PP loads them. Saving produces each tensor only when a writer thread
takes it, one tensor per file, under a byte budget for the tensors in flight (scheduler.py), so
memory holds about that budget instead of the model."""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
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
                         shard.allow_shape_mismatch)


def _from_offsets(cls: Any, key: str, data: Any, global_shape: tuple[int, ...], offset: tuple[int, ...],
                  stacked: bool, allow_shape_mismatch: bool = False) -> Any:
    """A ShardedTensor as Megatron's layers build them: layer tensors get a prepended layer axis
    (one fragment per layer), everything else is one whole-tensor chunk."""
    layer_axis = ((0, offset[0], global_shape[0]),) if stacked else ()
    return cls.from_rank_offsets(key, data, *layer_axis, replica_id=0, prepend_axis_num=len(layer_axis),
                                 allow_shape_mismatch=allow_shape_mismatch)


def save(directory: Path, shards: list[LazyShard], common: dict[str, Any], *, max_inflight_bytes: int,
         threads: int = 4, extra_state: tuple[str, ...] = (), num_layers: int = 0, fsync: bool = False,
         crc32: bool = False, on_written: Callable[[LazyShard], None] | None = None) -> SaveStats:
    """Write a torch_dist checkpoint into the empty `directory` from lazily produced shards.

    Up to `threads` shards are produced and written at once, as long as their bytes fit in
    `max_inflight_bytes` (a shard larger than that is written alone); each shard's buffer is released
    as soon as its file is written. `extra_state`: layer modules (`mlp.linear_fc1`) whose empty
    `_extra_state` objects Megatron expects. crc32: write zip checksums into the torch.save archives
    (torch.load does not check them; computing them costs about as much as writing the data)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megalaunch.conversion.scheduler import BufferPool

    lookup = {(s.key, tuple(s.offset)): s for s in shards}
    state: dict[str, Any] = dict(common)
    model: dict[str, Any] = {f"{s.key}@{','.join(map(str, s.offset))}": _sharded_tensor(s) for s in shards}
    for module in extra_state:
        key = f"decoder.layers.{module}._extra_state"
        for i in range(num_layers):
            model[f"{key}@{i}"] = ShardedObject(key, None, (num_layers,), (i,), replica_id=0)
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


def _lazy_strategy_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from megalaunch.conversion.scheduler import BufferPool, run_in_order

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
                for name in written:
                    fd = os.open(os.path.join(self.path, name), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
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


class _Window(io.RawIOBase):
    """A read-only file object over bytes offset:offset+length of a file (one DCP item)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.length - self.pos)
        if n <= 0:
            return 0
        data = os.pread(self.fd, n, self.base + self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _record_start(fd: int, base: int, record: Any) -> int:
    """Absolute offset of a stored zip record's data (after its local header) in an archive at `base`."""
    header = os.pread(fd, 30, base + record.header_offset)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return int(base + record.header_offset + 30 + name_len + extra_len)


class DirectReader:
    """Reads regions of a torch_dist checkpoint's tensors straight into caller buffers.

    A torch_dist checkpoint is a torch DCP directory: `.metadata` lists each tensor's chunks and
    where each chunk's `torch.save` archive lies. A chunk wholly inside the requested region whose
    place in the buffer is contiguous (a whole layer, or a TP slice of rows) is read directly from its
    archive's uncompressed data record into the buffer: one read, no intermediate tensor. Other
    chunks (column-split TP slices) go through torch.load and a copy."""

    def __init__(self, ckpt: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.ckpt = Path(ckpt)
        metadata = FileSystemReader(str(ckpt)).read_metadata()
        self.tensors = metadata.state_dict_metadata
        self.items = {(k.fqn, tuple(k.offset)): v for k, v in (metadata.storage_data or {}).items()
                      if k.offset is not None}
        self._fds: dict[str, int] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def read_into(self, key: str, offset: tuple[int, ...], target: torch.Tensor) -> None:
        """Fill `target` (a region of the global tensor `key` starting at `offset`)."""
        meta = self.tensors.get(key)
        chunks = getattr(meta, "chunks", None)
        if chunks is None:
            raise ConversionError(f"tensor '{key}' is missing from {self.ckpt}")
        lo = offset
        hi = tuple(o + s for o, s in zip(offset, target.shape, strict=True))
        filled = 0
        for chunk in chunks:
            c_lo = tuple(chunk.offsets)
            c_hi = tuple(o + s for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            i_lo = tuple(max(a, b) for a, b in zip(lo, c_lo, strict=True))
            i_hi = tuple(min(a, b) for a, b in zip(hi, c_hi, strict=True))
            if any(a >= b for a, b in zip(i_lo, i_hi, strict=True)):
                continue
            region = target[tuple(slice(a - o, b - o) for a, b, o in zip(i_lo, i_hi, lo, strict=True))]
            info = self.items[(key, c_lo)]
            whole = i_lo == c_lo and i_hi == c_hi
            if not (whole and region.is_contiguous() and self._direct(info, region)):
                self._via_torch_load(info, c_lo, i_lo, i_hi, region)
            filled += region.numel()
        if filled != target.numel():
            raise IncompleteCheckpointError(f"tensor '{key}' has no data for part of the region at {list(offset)} "
                                            f"of shape {list(target.shape)} in {self.ckpt}")

    def _fd(self, rel: str) -> int:
        if rel not in self._fds:
            self._fds[rel] = os.open(self.ckpt / rel, os.O_RDONLY)
        return self._fds[rel]

    def _direct(self, info: Any, region: torch.Tensor) -> bool:
        """Read the chunk's raw storage into `region` if the archive is the plain layout; else False."""
        import zipfile

        import torch

        from megalaunch.conversion.safetensors_io import byte_view

        if getattr(info, "transform_descriptors", None):
            return False
        fd = self._fd(info.relative_path)
        window = _Window(fd, info.offset, info.length)
        try:
            archive = zipfile.ZipFile(io.BufferedReader(window))
            records = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
            others = [i for i in archive.infolist() if "/data/" in i.filename and not i.filename.endswith("/data/0")]
            order = [i for i in archive.infolist() if i.filename.endswith("/byteorder")]
            if len(records) != 1 or others or records[0].compress_type != zipfile.ZIP_STORED:
                return False
            # read raw, not archive.read(): hf-to-mcore writes archives without CRC32s (zipfile checks them)
            if order and (order[0].compress_type != zipfile.ZIP_STORED or os.pread(
                    fd, order[0].file_size, _record_start(fd, info.offset, order[0])).strip() != b"little"):
                return False
            window.seek(0)
            meta = torch.load(io.BufferedReader(window), map_location="meta", weights_only=True)
        except (zipfile.BadZipFile, RuntimeError, ValueError):
            return False
        record = records[0]
        if (tuple(meta.shape) != tuple(region.shape) or meta.dtype != region.dtype or not meta.is_contiguous()
                or meta.storage_offset() != 0 or record.file_size != region.numel() * region.element_size()):
            return False
        start = _record_start(fd, info.offset, record)
        out = byte_view(region)
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], start + done)
            if n <= 0:
                raise IncompleteCheckpointError(f"{self.ckpt / info.relative_path} is truncated")
            done += n
        return True

    def _via_torch_load(self, info: Any, c_lo: tuple[int, ...], i_lo: tuple[int, ...], i_hi: tuple[int, ...],
                        region: torch.Tensor) -> None:
        import torch

        window = _Window(self._fd(info.relative_path), info.offset, info.length)
        chunk = torch.load(io.BufferedReader(window), map_location="cpu", weights_only=True)
        part = chunk[tuple(slice(a - c, b - c) for a, b, c in zip(i_lo, i_hi, c_lo, strict=True))]
        region.copy_(part)
