"""Atomic file writes: state lives in plain files that are either old or new, never half-written."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megalaunch.errors import RunDirError


def _process_umask() -> int:
    """The umask, read without changing it (os.umask(0) would race with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        else:  # mkstemp creates 0600; give the file the permissions the umask would have given
            os.chmod(tmp, 0o666 & ~_process_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], data: Any, mode: int | None = None) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode=mode)


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The parsed file, or None when it does not exist or is not (yet) valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def append_jsonl(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append one JSON line with a single write() on an O_APPEND descriptor (atomic for small lines);
    a link in its place is never followed. Keys in the record's order: a ledger line starts with its
    `event`, which rundir/ledger.event_name then reads without parsing the line."""
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class UnsafeTeamFile(RunDirError, OSError):
    """A team file that is not a plain file (a member's link or FIFO): not written. An OSError too, so the
    callers that already go on after a failed write (the chain, the health check) go on after this one."""


def append_team_jsonl(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """`append_jsonl` for a file every member of the group appends to (the node-health ledger, the health
    check's recorded figures). A missing directory is created 3770 (setgid, group-writable, sticky: nobody
    removes or replaces another member's file) and a new file 0660, whatever the writer's umask (027 in
    jobs would leave colleagues read-only). What a member may have planted there is never followed: the
    file is opened without following links and without blocking, and written only if it is a regular
    file with a single name (docs/security.md)."""
    import stat

    directory = os.path.dirname(os.fspath(path)) or "."
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        os.chmod(directory, 0o3770)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o660)
    except OSError as e:
        raise UnsafeTeamFile(f"{path} cannot be appended to safely ({e.strerror}): a link or a FIFO in the team's "
                          "directory", fix=f"remove {path}; it is recreated") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise UnsafeTeamFile(f"{path} is not a regular file with one name: not written",
                              fix=f"remove {path}; it is recreated")
        if st.st_size == 0:
            os.fchmod(fd, 0o660)
        os.write(fd, line)
    finally:
        os.close(fd)


def read_team_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """`read_jsonl` of a file other members write: never follows a link, never blocks, reads at most
    `MAX_TEAM_LEDGER_BYTES`; a planted non-file reads as empty (rundir/untrusted.py)."""
    from megalaunch.rundir.untrusted import MAX_TEAM_LEDGER_BYTES, MemberFile, open_member_file

    found = open_member_file(path, MAX_TEAM_LEDGER_BYTES)
    if not isinstance(found, MemberFile):
        return []
    return parse_jsonl(found.data.decode("utf-8", errors="replace").splitlines())


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete records; a torn last line (crash mid-write) is ignored."""
    try:
        with open(path) as f:
            return parse_jsonl(f)
    except FileNotFoundError:
        return []


def parse_jsonl(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON objects among `lines` (blank lines, a torn line and non-objects skipped). One parse of
    them all as an array first (a ledger of thousands of segments: several times faster than one parse
    per line); where a line is damaged, line by line."""
    kept = [line for line in (raw.strip() for raw in lines) if line]
    try:
        records = json.loads("[" + ",".join(kept) + "]")
    except json.JSONDecodeError:
        records = None
    if not isinstance(records, list) or len(records) != len(kept):
        records = []
        for line in kept:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return [r for r in records if isinstance(r, dict)]


def args_file_text(args: list[str]) -> str:
    """RUN/megatron.args: one token per line, so values with spaces survive and the file diffs well."""
    return "\n".join(args) + "\n"


def read_args_file(path: str | os.PathLike[str]) -> list[str]:
    """The inverse of `args_file_text`: lines are split at "\n" only (not at the other characters
    `str.splitlines` breaks on, such as U+2028 or form feed, which a value may hold), and an empty
    line is an empty value, not nothing (`--split ""` must not swallow the next flag)."""
    with open(path, newline="") as f:
        text = f.read()
    return text.removesuffix("\n").split("\n") if text else []
