"""Storage: a full filesystem told apart from a node fault, and the free-space helpers a save calls.

A full disk or an exhausted quota inside a checkpoint save rarely says so. torch's serializer reports
a truncated write (`[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`,
`PytorchStreamWriter failed writing file`, `file write failed`), Megatron wraps it
(`CheckpointException ... Worker failure: An error is caught while starting worker 0`), and the
words "space" and "disk" appear nowhere (measured on one H200; the same message comes when one
Lustre storage target fills while `df` of the whole filesystem shows free space). No retry can fix it
and no node is to blame: the segment's outcome is `storage_full` and the chain stops at once.

The free-space helpers (`free_bytes`, `fits`, `describe`) take the directory a save writes into;
it need not exist yet (its nearest existing ancestor is on the same filesystem, unless something is
mounted in between later). Sizes are in GB (10^9 bytes), as `df -H` prints them.

Standard library only: the launcher and the job both import it."""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
STORAGE_ERRNOS = frozenset(n for n in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if n is not None)
STORAGE_FIX = ("free space on the checkpoint filesystem (or raise the quota), then `megalaunch resume RUN`; "
               "or keep fewer checkpoints: `megalaunch resume RUN --set checkpoint.keep_last=N`")

# The storage error itself, or the truncated write it causes inside torch's serializer: always storage.
_ERRNOS = "|".join(str(n) for n in sorted(STORAGE_ERRNOS))
_DIRECT = re.compile(
    r"No space left on device|Disk quota exceeded|\bE(?:NOSPC|DQUOT)\b|\[Errno (?:" + _ERRNOS + r")\]|"
    r"inline_container\.cc:?\d*\]?[^\n]{0,80}?unexpected pos \d+ vs \d+|"
    r"PytorchStreamWriter failed writing file|file write failed|"
    r"no room for the \w+ save at iteration \d+", re.I)  # the last: SaveDoesNotFit's own words
# Megatron's wrapper of a failed save worker: storage unless the same text names another cause.
_WORKER = re.compile(r"CheckpointException[\s\S]{0,2000}?Worker failure|Worker failure[\s\S]{0,200}?worker \d+",
                     re.I)
_OTHER_CAUSE = re.compile(r"CUDA error|out of memory|NCCL|Connection (?:refused|reset)|Broken pipe|"
                          r"PicklingError|Can't pickle|Permission denied", re.I)


def storage_evidence(text: str) -> str | None:
    """The line of `text` that shows a full filesystem or exhausted quota (trimmed), or None."""
    m = _DIRECT.search(text)
    if m is None:
        w = _WORKER.search(text)
        if w is None or _OTHER_CAUSE.search(text):
            return None
        m = w
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = " ".join(text[start:end if end >= 0 else len(text)].split())
    return line[:300]


def storage_error(error: BaseException) -> str | None:
    """Evidence that `error` (or an exception it was raised from) is a full filesystem or quota."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None and e.errno in STORAGE_ERRNOS:
            where = f": {e.filename}" if e.filename else ""
            return f"[Errno {e.errno}] {os.strerror(e.errno)}{where}"
        found = storage_evidence(f"{type(e).__name__}: {e}")
        if found is not None:
            return found
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += [c for c in getattr(e, "exceptions", ()) if isinstance(c, BaseException)]  # ExceptionGroup
    return None


class SaveDoesNotFit(Exception):
    """A save the segment cannot go on without (the stop save, the final one) does not fit the free space:
    it is never started, every rank raises this at the same save, and the segment ends `storage_full`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# --- where a directory's bytes go -------------------------------------------------------------------

@dataclass(frozen=True)
class Filesystem:
    mount: str  # the mount point
    device: str  # what is mounted there (a device, a Lustre target list, "tmpfs")
    fstype: str

    def describe(self) -> str:
        return f"filesystem {self.device} ({self.mount}, {self.fstype})"


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """`path`, or its nearest ancestor that exists (a run root is created at submit)."""
    p = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _unescape(field: str) -> str:
    """/proc/self/mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_of(path: str | os.PathLike[str]) -> Filesystem:
    """The mount that holds `path` (the longest mount point above its real path)."""
    real = os.path.realpath(nearest_existing(path))
    best: Filesystem | None = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # later lines are later mounts, which hide earlier ones at the same point
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        mount = _unescape(fields[4])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best.mount)):
            best = Filesystem(mount, _unescape(tail[1]), tail[0])
    if best is None:  # no mountinfo (not Linux): walk up to the mount point
        p = Path(real)
        while not os.path.ismount(p) and p != p.parent:
            p = p.parent
        best = Filesystem(str(p), "?", "?")
    return best


def free_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged user may still write on the filesystem of `directory` (statvfs
    f_bavail: root's reserved blocks excluded). Quotas are not included (config/storage.py)."""
    st = os.statvfs(nearest_existing(directory))
    return st.f_bavail * st.f_frsize


def free_inodes(directory: str | os.PathLike[str]) -> int | None:
    """Files an unprivileged user may still create on the filesystem of `directory` (statvfs f_favail);
    None where the filesystem has no inode limit (it reports no inodes at all)."""
    st = os.statvfs(nearest_existing(directory))
    return st.f_favail if st.f_files > 0 else None


def fits(directory: str | os.PathLike[str], need_bytes: float, margin: float = 0.05) -> bool:
    """Whether `need_bytes`, plus `margin` of it, fit the free space of `directory`'s filesystem."""
    return free_bytes(directory) >= need_bytes * (1 + margin)


def gb(n: float) -> str:
    """Bytes in GB, readable from a tiny model's megabytes to a large one's terabytes."""
    v = n / GB
    if v >= 100:
        return f"{v:,.0f} GB"
    if v >= 0.1:
        return f"{v:.1f} GB"
    return f"{v:.2g} GB"


def describe(directory: str | os.PathLike[str], need_bytes: float, *, free: int | None = None,
             fix: str | None = STORAGE_FIX) -> str:
    """'filesystem /dev/sda1 (/scratch, ext4), 12.3 GB free, 51.9 GB needed; fix: ...'"""
    fs = filesystem_of(directory)
    free = free_bytes(directory) if free is None else free
    return f"{fs.describe()}, {gb(free)} free, {gb(need_bytes)} needed" + (f"; fix: {fix}" if fix else "")
