"""Reading a torch_dist checkpoint's tensors without dist_checkpointing (`DirectReader`): each
requested region's chunks are found in the DCP `.metadata`, and a chunk's `torch.save` archive record
is read straight into the caller's buffer where its layout allows, through torch.load and a copy
otherwise. Finding and checking the checkpoint directory is mcore_layout.py's."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.conversion.errors import ConversionError, IncompleteCheckpointError

if TYPE_CHECKING:
    import torch


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
