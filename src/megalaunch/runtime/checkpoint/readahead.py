"""Checkpoint read-ahead at segment start (issue #25, start-up): the checkpoint a resumed segment will
load is read into the page cache by a background thread from the trainer's first moment, while
Python imports torch and Megatron (8-13 s), the health check runs and the model is built; Megatron's
load then reads from memory instead of the disk (13-15 s for llama3-1b's 17.3 GB at ~1.2 GB/s).

Who reads: local rank 0 of a one-node job, once for the node. With several nodes every node would
read the whole checkpoint from a shared filesystem while each rank needs only its shards: off there.
When: the checkpoint the tracker names (or `--resume-from`'s); when the segment ends up loading
another one (the newest was incomplete and moved aside), the pages read are only wasted cache.
Bounded: only when the checkpoint is at most half of the node's available memory (the page cache
gives it back under pressure; evicting the node's whole cache for it would not pay); 4 reader threads
(a local NVMe needs several requests in flight). MEGALAUNCH_READAHEAD=0 turns it off (bench A/B)."""

from __future__ import annotations

import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megalaunch.runtime.rank.dist_env import available_memory

READAHEAD_ENV = "MEGALAUNCH_READAHEAD"
THREADS = 4
CHUNK = 8 << 20
MEMORY_SHARE = 0.5


class ReadAhead:
    """One background pass over a checkpoint directory's files; `figures()` says how it went."""

    def __init__(self, directory: Path, files: list[tuple[Path, int]]) -> None:
        self.directory = directory
        self.files = files
        self.total = sum(size for _, size in files)
        self.read = 0
        self.started = time.monotonic()
        self.seconds: float | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="megalaunch-readahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with ThreadPoolExecutor(THREADS, thread_name_prefix="megalaunch-readahead") as pool:
                for _ in pool.map(self._read_file, [p for p, _ in sorted(self.files, key=lambda f: -f[1])]):
                    pass
        except Exception as e:  # a read-ahead never fails the segment: the load reads what it needs
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.monotonic() - self.started

    def _read_file(self, path: Path) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                with self._lock:
                    self.read += n

    def figures(self) -> dict[str, Any]:
        seconds = self.seconds
        done = seconds is not None
        return {"directory": self.directory.name, "bytes": self.total, "read_bytes": self.read, "done": done,
                "seconds": round(seconds if seconds is not None else time.monotonic() - self.started, 2),
                **({"error": self.error} if self.error else {})}


def start(directory: Path | None, *, local_rank: int, nodes: int) -> tuple[ReadAhead | None, str]:
    """Start reading `directory` (the checkpoint the segment is expected to load) if it pays; returns
    the reader (or None) and one line saying what was done and why."""
    if os.environ.get(READAHEAD_ENV, "1") == "0":
        return None, f"off ({READAHEAD_ENV}=0)"
    if directory is None:
        return None, "nothing to read (no checkpoint yet)"
    if local_rank != 0:
        return None, "local rank 0 reads for the node"
    if nodes > 1:
        return None, f"off with {nodes} nodes (each rank reads only its shards from the shared filesystem)"
    files: list[tuple[Path, int]] = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):  # what Megatron wrote; never a link or a FIFO left in an older run
                files.append((path, st.st_size))
    total = sum(size for _, size in files)
    if not files or total == 0:
        return None, f"nothing to read in {directory.name}"
    memory = available_memory()
    if memory is None or total > MEMORY_SHARE * memory:
        have = "unknown" if memory is None else f"{memory / 1e9:.1f} GB"
        return None, f"{directory.name} is {total / 1e9:.1f} GB, more than half the available memory ({have})"
    return ReadAhead(directory, files), f"reading {directory.name} ({total / 1e9:.2f} GB) into the page cache"
