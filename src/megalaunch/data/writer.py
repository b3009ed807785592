"""Write Megatron `.bin/.idx` pairs fast: one `write()` per batch of documents, sizes kept in a
compact array, the index written at close. Both files are written under temporary names and renamed
at close, so a killed job never leaves a pair that looks complete."""

from __future__ import annotations

import contextlib
import os
import struct
from array import array
from collections.abc import Sequence
from typing import Any

from megalaunch.data.index import MAGIC

# Megatron DType codes for the two token types we write.
_CODES = {"uint16": 8, "int32": 4}


def token_dtype_for_vocab(vocab_size: int) -> str:
    """uint16 while every id fits (Megatron's and datatrove's rule), int32 above."""
    return "uint16" if vocab_size <= 65536 else "int32"


class IndexedWriter:
    """Append documents (token id sequences) to `<prefix>.bin` and write `<prefix>.idx` at close."""

    def __init__(self, prefix: str | os.PathLike[str], dtype: str = "uint16") -> None:
        import numpy as np

        if dtype not in _CODES:
            raise ValueError(f"dtype {dtype!r} not in {sorted(_CODES)}")
        self.prefix = os.fspath(prefix)
        self.dtype = dtype
        self._np_dtype = np.dtype(dtype)
        self._sizes = array("i")
        self._tmp_bin = f"{self.prefix}.bin.tmp"
        self._bin = open(self._tmp_bin, "wb", buffering=1 << 22)  # noqa: SIM115 (closed in close/abort)
        self.tokens = 0

    def add_batch(self, docs: Sequence[Sequence[int]]) -> None:
        """One concatenation and one write for the whole batch."""
        import numpy as np

        if not docs:
            return
        lengths = [len(d) for d in docs]
        flat = np.fromiter((t for d in docs for t in d), dtype=self._np_dtype, count=sum(lengths))
        self._bin.write(flat.tobytes())
        self._sizes.extend(lengths)
        self.tokens += int(flat.size)

    def add_array(self, tokens: Any, lengths: Sequence[int]) -> None:
        """Append already-concatenated tokens (a numpy array of this writer's dtype) of `lengths` docs."""
        self._bin.write(memoryview(tokens).cast("B"))
        self._sizes.extend(lengths)
        self.tokens += len(tokens)

    def close(self) -> None:
        import numpy as np

        self._bin.close()
        n = len(self._sizes)
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if n else np.zeros(0, np.int32)
        pointers = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self._np_dtype.itemsize
        tmp_idx = f"{self.prefix}.idx.tmp"
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", 1, _CODES[self.dtype], n, n + 1))
            f.write(sizes.tobytes())
            f.write(pointers.tobytes())
            f.write(np.arange(n + 1, dtype=np.int64).tobytes())
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(tmp_idx, self.prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        for path in (self._tmp_bin, f"{self.prefix}.idx.tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_dataset(prefix: str | os.PathLike[str], docs: Sequence[Sequence[int]], dtype: str = "uint16") -> None:
    """Write a whole small dataset at once (tests, fixtures, tools)."""
    with IndexedWriter(prefix, dtype) as w:
        w.add_batch(docs)
