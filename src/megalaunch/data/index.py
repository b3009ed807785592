"""Read Megatron's MMIDIDX index headers with the standard library only.

Layout (megatron.core.datasets.indexed_dataset, version 1)::

    magic b"MMIDIDX\\x00\\x00" | version <Q | dtype code <B | sequence count <Q | document count <Q
    sizes int32[sequence count] | pointers int64[sequence count] | document indices int64[document count]
    [modes int8[sequence count]  (multimodal only)]

The token count is the last pointer (in bytes) divided by the token size plus the last size: O(1),
read from the index, never guessed from file sizes."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.errors import PreflightError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
# Megatron's DType codes -> (name, bytes per token)
DTYPES: dict[int, tuple[str, int]] = {
    1: ("uint8", 1), 2: ("int8", 1), 3: ("int16", 2), 4: ("int32", 4),
    5: ("int64", 8), 6: ("float64", 8), 7: ("float32", 4), 8: ("uint16", 2),
}


@dataclass(frozen=True)
class IndexHeader:
    """What an `.idx` says about its dataset."""

    path: str
    version: int
    dtype_code: int
    sequence_count: int
    document_count: int
    token_count: int

    @property
    def dtype(self) -> str:
        return DTYPES[self.dtype_code][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype_code][1]

    @property
    def expected_idx_size(self) -> int:
        """Bytes of a well-formed, non-multimodal index with these counts."""
        return HEADER_SIZE + 12 * self.sequence_count + 8 * self.document_count

    @property
    def expected_bin_size(self) -> int:
        return self.token_count * self.itemsize

    @property
    def sizes_offset(self) -> int:
        return HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return HEADER_SIZE + 4 * self.sequence_count

    @property
    def document_indices_offset(self) -> int:
        return HEADER_SIZE + 12 * self.sequence_count


def split_prefix(path: str | os.PathLike[str]) -> str:
    """`x.bin`, `x.idx` or `x` -> the dataset prefix `x`."""
    text = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def read_index_header(prefix: str | os.PathLike[str]) -> IndexHeader:
    """Parse the header of `<prefix>.idx` and count its tokens; PreflightError when it is unreadable."""
    idx = Path(split_prefix(prefix) + ".idx")
    try:
        with open(idx, "rb") as f:
            head = f.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE or not head.startswith(MAGIC):
                raise PreflightError(f"{idx} is not a Megatron index (bad magic or shorter than its header)",
                                     field="data", fix="re-run the tokenization that wrote it")
            version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC):])
            if code not in DTYPES:
                raise PreflightError(f"{idx} has unknown dtype code {code}", field="data",
                                     valid=", ".join(f"{c}={n}" for c, (n, _) in DTYPES.items()))
            token_count = 0
            if n_seq:
                f.seek(HEADER_SIZE + 4 * (n_seq - 1))
                last_size = f.read(4)
                f.seek(HEADER_SIZE + 4 * n_seq + 8 * (n_seq - 1))
                last_pointer = f.read(8)
                if len(last_size) < 4 or len(last_pointer) < 8:
                    raise PreflightError(f"{idx} is truncated: its header announces {n_seq} sequences",
                                         field="data", fix="re-run the tokenization that wrote it")
                token_count = struct.unpack("<q", last_pointer)[0] // DTYPES[code][1] + \
                    struct.unpack("<i", last_size)[0]
    except FileNotFoundError:
        raise PreflightError(f"index file {idx} does not exist", field="data",
                             fix="check the prefix (without .bin/.idx) or tokenize the data first") from None
    except IsADirectoryError:
        raise PreflightError(f"{idx} is a directory, not an index", field="data") from None
    except PermissionError:
        raise PreflightError(f"index file {idx} is not readable (permission denied)", field="data",
                             fix="ask the owner to make it group-readable") from None
    return IndexHeader(path=str(idx), version=version, dtype_code=code, sequence_count=n_seq,
                       document_count=n_doc, token_count=token_count)


def find_prefixes(directory: str | os.PathLike[str]) -> list[str]:
    """Sorted prefixes of the `.bin`/`.idx` files under `directory`, recursively, following links
    (a mixture is a folder of links). Either half counts: a missing partner is reported by whoever
    checks the files, not silently skipped. Hidden files and directories are ignored."""
    names = set()
    for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith(".") and name.endswith((".bin", ".idx")):
                names.add(os.path.join(dirpath, name[:-4]))
    return sorted(names)

def read_documents(prefix: str | os.PathLike[str]) -> list[Any]:
    """Every sequence of a dataset as a numpy array (tests and small tools; memory-maps the .bin)."""
    import numpy as np

    header = read_index_header(prefix)
    n = header.sequence_count
    if n == 0:
        return []
    sizes = np.fromfile(header.path, dtype=np.int32, count=n, offset=header.sizes_offset)
    tokens = np.memmap(split_prefix(prefix) + ".bin", dtype=header.dtype, mode="r")
    ends = np.cumsum(sizes, dtype=np.int64)
    return [tokens[e - s:e] for s, e in zip(sizes, ends, strict=True)]
