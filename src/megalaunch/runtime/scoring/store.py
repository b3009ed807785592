"""The score store: what a frozen model (DPO's reference, a distillation teacher) says about every token
of a chat dataset, computed once by a scoring stage and stored beside the data (docs/post_training.md).

A store is a directory S (RUN/scores/reference, RUN/scores/teacher) holding, for each chat dataset prefix
P (P.bin/.idx/.mask of `megalaunch data sft`) named N (P's basename):
- `N.logp` float32 [tokens] (kind "logprobs"): row j of document d is log p(token j | tokens < j);
- `N.topk_ids` int32 [tokens, k] and `N.topk_logp` float32 [tokens, k] (kind "topk"): the k largest
  log-probabilities of the distribution predicting token j (the rest of the mass: 1 - sum(exp)).
Rows follow P's token stream (same offsets as P.mask); row 0 of each document is unused (zeros), as are
rows past what the job's sequences hold. Raw little-endian arrays, memory-mappable.
- `meta.json` (atomic): {"kind", "top_k", "model": {"fingerprint", "source"}, "data": {N: {"idx_sha256",
  "documents", "tokens"}}, "documents_done": {N: n}, "complete", "seconds", "tokens_per_s"}.
Documents are appended in order; a stage that stops continues from documents_done (`ScoreWriter`).
Standard library + numpy only: the login node reads stores too (storage budget, status)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megalaunch.rundir.files import atomic_write_json, read_json

META = "meta.json"
KINDS = ("logprobs", "topk")
TRACKER = "latest_checkpointed_iteration.txt"


def file_sha256(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(source: str | os.PathLike[str], sample: int = 1 << 20) -> str:
    """A fingerprint of a model directory (a Megatron checkpoint, a Hugging Face model) or file: sha256 over
    every file's relative path, size and first and last `sample` bytes (a checkpoint of any size is read in
    seconds; the in-job check of the first micro-batch's log-probabilities covers what sampling misses).
    A Megatron checkpoint directory is fingerprinted by the iteration its tracker names; hidden files
    (markers) are left out."""
    root = Path(source)
    tracker = root / TRACKER
    if tracker.is_file():  # a Megatron checkpoint directory: the iteration its tracker names
        step = tracker.read_text().strip()
        root = root / (step if step == "release" else f"iter_{int(step):07d}")
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for p in files:
        rel = p.relative_to(root).as_posix() if root.is_dir() else p.name
        if rel.startswith(".") or "/." in rel:
            continue
        size = p.stat().st_size
        digest.update(f"{rel}\0{size}\0".encode())
        with open(p, "rb") as f:
            digest.update(f.read(sample))
            if size > 2 * sample:
                f.seek(size - sample)
                digest.update(f.read(sample))
    return digest.hexdigest()


def prefix_name(prefix: str | os.PathLike[str]) -> str:
    return os.path.basename(os.fspath(prefix))


_MAGIC = b"MMIDIDX\x00\x00"
_TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                 8: np.uint16}  # Megatron's DType codes (megatron.core.datasets.indexed_dataset)


def _index(prefix: str | os.PathLike[str]) -> tuple[Any, np.ndarray, np.ndarray]:
    """(token dtype, offsets in tokens, lengths) of every document of `<prefix>.idx`."""
    path = os.fspath(prefix) + ".idx"
    with open(path, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or not head.startswith(_MAGIC):
        raise ValueError(f"{path} is not a Megatron index; fix: write the dataset again with `megalaunch data sft`")
    _, code, n, _ = struct.unpack("<QBQQ", head[len(_MAGIC):])
    dtype = _TOKEN_DTYPES[code]
    lengths = np.fromfile(path, dtype=np.int32, count=n, offset=34).astype(np.int64)
    pointers = np.fromfile(path, dtype=np.int64, count=n, offset=34 + 4 * n)
    return dtype, pointers // np.dtype(dtype).itemsize, lengths


def document_layout(prefix: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of every document of P in tokens: the same offsets ChatDocuments and P.mask use."""
    _, offsets, lengths = _index(prefix)
    return offsets, lengths


class Documents:
    """A chat dataset's documents (tokens, loss mask) without Megatron: what a scoring stage reads."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = os.fspath(prefix)
        dtype, self.offsets, self.lengths = _index(prefix)
        total = int(self.lengths.sum())
        self.tokens = np.memmap(self.prefix + ".bin", dtype=dtype, mode="r") if total else np.zeros(0, dtype)
        self.masks = np.memmap(self.prefix + ".mask", dtype=np.uint8, mode="r") if total else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[doc]), int(self.offsets[doc] + self.lengths[doc])
        return self.tokens[start:end], self.masks[start:end]


def data_entry(prefix: str | os.PathLike[str]) -> dict[str, Any]:
    """meta.json's record of a dataset: what ties the stored rows to it (a rewritten dataset differs)."""
    _, _, lengths = _index(prefix)
    return {"idx_sha256": file_sha256(os.fspath(prefix) + ".idx"), "documents": len(lengths),
            "tokens": int(lengths.sum())}


def _files(kind: str, name: str) -> list[tuple[str, Any, int]]:
    """(file name, dtype, columns per row) of one dataset's arrays."""
    return [(f"{name}.logp", np.float32, 1)] if kind == "logprobs" else \
        [(f"{name}.topk_ids", np.int32, 0), (f"{name}.topk_logp", np.float32, 0)]


@dataclass(frozen=True)
class StoreMismatch:
    """Why an existing store cannot be continued (None of these: it can)."""

    reason: str


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    meta = read_json(Path(directory) / META)
    return meta if isinstance(meta, dict) else None


def mismatch(meta: dict[str, Any], *, kind: str, top_k: int | None, model: dict[str, str],
             data: dict[str, dict[str, Any]]) -> StoreMismatch | None:
    """Why the store described by `meta` does not hold these scores (None: it does, as far as it goes)."""
    if meta.get("kind") != kind or (kind == "topk" and meta.get("top_k") != top_k):
        return StoreMismatch(f"it holds {meta.get('kind')} (top_k {meta.get('top_k')}), not {kind} (top_k {top_k})")
    if (meta.get("model") or {}).get("fingerprint") != model.get("fingerprint"):
        return StoreMismatch(f"it was computed by model {(meta.get('model') or {}).get('source')!r} "
                             f"(fingerprint {str((meta.get('model') or {}).get('fingerprint'))[:12]}), not "
                             f"{model.get('source')!r} (fingerprint {str(model.get('fingerprint'))[:12]})")
    for name, entry in data.items():
        held = (meta.get("data") or {}).get(name)
        if held != entry:
            return StoreMismatch(f"dataset {name} changed since it was scored ({held} != {entry})")
    if set(meta.get("data") or {}) != set(data):
        return StoreMismatch(f"it scores datasets {sorted(meta.get('data') or {})}, not {sorted(data)}")
    return None


class ScoreWriter:
    """Appends documents' scores in order, per dataset; `flush` makes them durable and records
    documents_done; opened on a store of the same model, kind and data it continues where that stopped,
    else (none yet, or one of another model / data) it starts afresh."""

    def __init__(self, directory: str | os.PathLike[str], *, kind: str, prefixes: list[str],
                 model: dict[str, str], top_k: int | None = None) -> None:
        if kind not in KINDS or (kind == "topk" and not top_k):
            raise ValueError(f"score kind must be one of {KINDS} (topk with top_k), got {kind!r}, {top_k!r}")
        self.directory, self.kind, self.top_k = Path(directory), kind, top_k
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefixes = {prefix_name(p): str(p) for p in prefixes}
        data = {name: data_entry(p) for name, p in self.prefixes.items()}
        old = read_meta(self.directory)
        self.restarted_because = None if old is None else mismatch(old, kind=kind, top_k=top_k, model=model, data=data)
        if old is None or self.restarted_because is not None:
            old = None
            for name in data:
                for fname, _, _ in _files(kind, name):
                    (self.directory / fname).unlink(missing_ok=True)
        self.meta: dict[str, Any] = old or {
            "kind": kind, "top_k": top_k, "model": dict(model), "data": data,
            "documents_done": {name: 0 for name in data}, "complete": False, "seconds": 0.0, "tokens_per_s": 0.0}
        self.layout = {name: document_layout(p) for name, p in self.prefixes.items()}
        self._handles: dict[str, Any] = {}
        if old is None:
            self.flush()

    def done(self, name: str) -> int:
        return int(self.meta["documents_done"][name])

    def _handle(self, fname: str) -> Any:
        if fname not in self._handles:
            path = self.directory / fname
            self._handles[fname] = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115 (closed in close)
        return self._handles[fname]

    def append(self, name: str, rows: list[Any]) -> None:
        """Scores of the next documents of dataset `name`, in order: for logprobs each an array [n <= length]
        (row j of the document; rows past n are zeros), for topk each a pair (ids [n, k], logp [n, k])."""
        offsets, lengths = self.layout[name]
        for item in rows:
            doc = self.done(name)
            if doc >= len(lengths):
                raise ValueError(f"{name} holds {len(lengths)} documents; a score for document {doc} is one too many")
            arrays = [item] if self.kind == "logprobs" else list(item)
            for (fname, dtype, _), arr in zip(_files(self.kind, name), arrays, strict=True):
                width = 1 if self.kind == "logprobs" else int(self.top_k or 0)
                full = np.zeros((int(lengths[doc]), width), dtype=dtype)
                got = np.asarray(arr, dtype=dtype).reshape(-1, width)[: int(lengths[doc])]
                full[: len(got)] = got
                f = self._handle(fname)
                f.seek(int(offsets[doc]) * width * np.dtype(dtype).itemsize)
                f.write(full.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes())
            self.meta["documents_done"][name] = doc + 1

    def flush(self, *, seconds: float = 0.0, tokens: int = 0, complete: bool = False) -> None:
        """Durable: the arrays are synced before meta.json says how far they go. `seconds` and `tokens`: this
        stretch's time and scored tokens, added to the store's totals (tokens_per_s over all of them)."""
        for f in self._handles.values():
            f.flush()
            os.fsync(f.fileno())
        meta = self.meta
        scored = meta.get("tokens_scored", 0) + int(tokens)
        meta.update(seconds=float(meta.get("seconds", 0.0)) + float(seconds), tokens_scored=scored, complete=complete)
        meta["tokens_per_s"] = scored / meta["seconds"] if meta["seconds"] > 0 else 0.0
        atomic_write_json(self.directory / META, meta)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


class ScoreReader:
    """A complete store, memory-mapped: per-document rows aligned with ChatDocuments.get(doc)."""

    def __init__(self, directory: str | os.PathLike[str], prefixes: list[str] | None = None) -> None:
        self.directory = Path(directory)
        meta = read_meta(self.directory)
        if meta is None:
            raise FileNotFoundError(f"{self.directory / META} does not exist: no scores stored there")
        self.meta = meta
        self.kind, self.top_k = meta["kind"], meta.get("top_k")
        self.prefixes = {prefix_name(p): str(p) for p in prefixes or []}
        self._maps: dict[str, Any] = {}
        self._layout: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def complete(self) -> bool:
        return bool(self.meta.get("complete"))

    def _array(self, fname: str, dtype: Any, width: int) -> Any:
        if fname not in self._maps:
            flat = np.memmap(self.directory / fname, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
            self._maps[fname] = flat if width == 1 else flat.reshape(-1, width)
        return self._maps[fname]

    def layout(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        if name not in self._layout:
            if name not in self.prefixes:
                raise KeyError(f"no dataset prefix given for {name!r}: ScoreReader(directory, prefixes=[...])")
            self._layout[name] = document_layout(self.prefixes[name])
        return self._layout[name]

    def get(self, name: str, doc: int) -> Any:
        """Document `doc`'s rows: logprobs -> float32 [length]; topk -> (int32 [length, k], float32 [length, k])."""
        offsets, lengths = self.layout(name)
        if doc >= int(self.meta["documents_done"].get(name, 0)):
            raise IndexError(f"document {doc} of {name} is not scored yet (documents_done "
                             f"{self.meta['documents_done'].get(name, 0)})")
        start, end = int(offsets[doc]), int(offsets[doc] + lengths[doc])
        if self.kind == "logprobs":
            return self._array(f"{name}.logp", np.float32, 1)[start:end]
        k = int(self.top_k or 0)
        return (self._array(f"{name}.topk_ids", np.int32, k)[start:end],
                self._array(f"{name}.topk_logp", np.float32, k)[start:end])


def store_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes the files under `directory` hold on disk (0: none)."""
    total = 0
    for dirpath, _, filenames in os.walk(directory):
        for fname in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, fname)).st_blocks * 512
    return total
