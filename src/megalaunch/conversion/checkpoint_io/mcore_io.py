"""The Megatron-core side: checkpoint directories as Megatron writes them, and streaming
save/load through `megatron.core.dist_checkpointing` (torch_dist format).

Layout (what `megatron.training` writes and reads):
    CKPT/latest_checkpointed_iteration.txt      "N" or "release", written last (atomically)
    CKPT/iter_000000N/ (or CKPT/release/)        metadata.json, .metadata, __0_*.distcp
Tensors are Megatron's global tensors (layer tensors stacked on a leading layer axis), saved as
sharded tensors so any TP/PP loads them. Saving streams (mcore_save.py); this module finds, checks
and reads checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.conversion.errors import ConversionError, IncompleteCheckpointError, MissingFileError
from megalaunch.rundir.paths import RunPaths

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
    run = RunPaths(path)  # a run directory: its checkpoints/
    if run.checkpoints.is_dir() and not (path / TRACKER).exists():
        return run.checkpoints
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

        from megalaunch.conversion.checkpoint_io.safetensors_io import byte_view

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
