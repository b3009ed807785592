"""Streaming safetensors: read one tensor at a time with positioned reads, and write a sharded
checkpoint whose headers are laid out before any data, so tensors can be written in any order and
memory holds one tensor, not the model.

The format (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}} padded with spaces
to 8 bytes, then the raw data. Reading through the file (not mmap) keeps the page cache out of this
process's resident set, so peak RSS measures what conversion itself holds."""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megalaunch.conversion.errors import ConversionError, MissingFileError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


def torch_dtype(code: str) -> torch.dtype:
    import torch

    return getattr(torch, DTYPES[code])


def dtype_code(dtype: torch.dtype) -> str:
    return DTYPE_CODES[str(dtype).removeprefix("torch.")]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of the data in the file."""
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header dict, absolute offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConversionError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise ConversionError(f"{path} is not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    return header, 8 + length


class SafetensorsReader:
    """All tensors of a Hugging Face directory (single file or sharded with an index)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        files = self._files()
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for path in files:
            header, data_start = read_header(path)
            self.metadata.update(header.pop("__metadata__", None) or {})
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                self.tensors[name] = TensorInfo(name, path, entry["dtype"], tuple(entry["shape"]),
                                                data_start + begin, end - begin)
        self._handles: dict[tuple[int, Path], int] = {}
        self._lock = threading.Lock()

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_NAME
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.directory / n for n in names]
            missing = [str(p.name) for p in files if not p.is_file()]
            if missing:
                raise MissingFileError(f"{index} names shards that do not exist: {', '.join(missing)}")
            return files
        single = self.directory / SINGLE_NAME
        if single.is_file():
            return [single]
        found = sorted(self.directory.glob("*.safetensors"))
        if found:
            return found
        raise MissingFileError(f"no {SINGLE_NAME} or {INDEX_NAME} in {self.directory}",
                               fix="point at a Hugging Face model directory saved with safetensors")

    def read(self, name: str) -> torch.Tensor:
        """A fresh tensor with the stored dtype and shape."""
        import torch

        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        self.read_rows_into(name, 0, info.shape[0] if info.shape else 1, byte_view(out))
        return out

    def row_bytes(self, name: str) -> int:
        info = self.tensors[name]
        rows = info.shape[0] if info.shape else 1
        return info.nbytes // rows if rows else 0

    def read_rows_into(self, name: str, start: int, rows: int, out: memoryview) -> None:
        """Rows start:start+rows of tensor `name` into the writable buffer `out` (exactly that size)."""
        info = self.tensors[name]
        row = self.row_bytes(name)
        nbytes = rows * row
        if len(out) != nbytes:
            raise ConversionError(f"tensor '{name}': {rows} rows are {nbytes} bytes, buffer has {len(out)}")
        fd = self._fd(info.file)
        offset = info.begin + start * row
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [out[done:]], offset + done)
            if n <= 0:
                raise ConversionError(f"{info.file} ends inside tensor '{name}' (truncated file?)")
            done += n

    def _fd(self, path: Path) -> int:
        # One descriptor per thread and file: the kernel keeps readahead state per open file, and
        # interleaved reads of several threads through one descriptor look random to it.
        key = (threading.get_ident(), path)
        fd = self._handles.get(key)
        if fd is None:
            with self._lock:
                fd = self._handles[key] = os.open(path, os.O_RDONLY)
        return int(fd)

    def close(self) -> None:
        with self._lock:
            for fd in self._handles.values():
                os.close(fd)
            self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass(frozen=True)
class _Slot:
    file: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class SafetensorsWriter:
    """Writes tensors declared up front into shards of at most `max_shard_bytes` (Hugging Face's
    `model-00001-of-0000N.safetensors` + index, or one `model.safetensors`). Files are written as
    `.partial` and renamed by `close()` only when every declared tensor has been written."""

    def __init__(self, directory: Path, plan: list[tuple[str, str, tuple[int, ...]]], *,
                 max_shard_bytes: int = 5 * 2**30, metadata: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        groups: list[list[tuple[str, str, tuple[int, ...], int]]] = [[]]
        size = 0
        for name, code, shape in plan:
            nbytes = _nbytes(code, shape)
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, code, shape, nbytes))
            size += nbytes
        count = len(groups)
        self.names = [SINGLE_NAME] if count == 1 else \
            [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        self.slots: dict[str, _Slot] = {}
        self._fds: list[int] = []
        self._written: set[str] = set()
        self.total_bytes = 0
        for k, group in enumerate(groups):
            header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
            offset = 0
            for name, code, shape, nbytes in group:
                header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            fd = os.open(self._partial(k), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
            start = 8 + len(raw)
            os.ftruncate(fd, start + offset)
            self._fds.append(fd)
            for name, code, shape, nbytes in group:
                begin = header[name]["data_offsets"][0]
                self.slots[name] = _Slot(k, start + begin, nbytes, code, shape)
            self.total_bytes += offset

    def _partial(self, k: int) -> Path:
        return self.directory / (self.names[k] + ".partial")

    def write(self, name: str, tensor: torch.Tensor) -> None:
        slot = self._slot(name)
        if tuple(tensor.shape) != slot.shape or dtype_code(tensor.dtype) != slot.dtype:
            raise ConversionError(f"tensor '{name}' is {dtype_code(tensor.dtype)}{list(tensor.shape)}, "
                                  f"declared {slot.dtype}{list(slot.shape)}")
        self.write_rows(name, 0, tensor)
        self.done(name)

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Write `rows` (a tensor of whole rows, dtype as declared) as rows start:... of tensor `name`.
        Rows never written stay zero (the file is preallocated sparse)."""
        slot = self._slot(name)
        if dtype_code(rows.dtype) != slot.dtype or tuple(rows.shape[1:]) != slot.shape[1:]:
            raise ConversionError(f"tensor '{name}': rows of {dtype_code(rows.dtype)}{list(rows.shape)} do not fit "
                                  f"{slot.dtype}{list(slot.shape)}")
        data = byte_view(rows)
        row = slot.nbytes // slot.shape[0] if slot.shape and slot.shape[0] else slot.nbytes
        offset = slot.offset + start * row
        if start * row + len(data) > slot.nbytes:
            raise ConversionError(f"tensor '{name}': rows {start}+{rows.shape[0] if rows.dim() else 1} exceed "
                                  f"{list(slot.shape)}")
        done = 0
        while done < len(data):
            done += os.pwrite(self._fds[slot.file], data[done:], offset + done)

    def done(self, name: str) -> None:
        self._written.add(name)

    def _slot(self, name: str) -> _Slot:
        slot = self.slots.get(name)
        if slot is None:
            raise ConversionError(f"tensor '{name}' was not declared for writing")
        return slot

    def close(self, *, sync: bool = False) -> None:
        missing = sorted(set(self.slots) - self._written)
        if missing:
            self.abort()
            raise ConversionError(f"{len(missing)} tensors were never written, e.g. '{missing[0]}'")
        for fd in self._fds:
            if sync:
                os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        for k, name in enumerate(self.names):
            os.replace(self._partial(k), self.directory / name)
        if len(self.names) > 1:
            weight_map = {n: self.names[s.file] for n, s in self.slots.items()}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            _atomic_write(self.directory / INDEX_NAME, json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for k in range(len(self.names)):
            self._partial(k).unlink(missing_ok=True)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (a non-contiguous one is copied first)."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _nbytes(code: str, shape: tuple[int, ...]) -> int:
    size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(code, 1)
    n = 1
    for d in shape:
        n *= d
    return n * size


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
