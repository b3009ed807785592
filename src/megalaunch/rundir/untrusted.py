"""Reading what another user may have written (docs/security.md).

The job runs as the run's owner; a team member can plant anything where members may write (the trigger
directory, the team's node-health ledger): a symbolic link to the owner's private file, a hard link, a
FIFO that blocks whoever opens it, a directory, gigabytes, binary junk. Every read of such a place goes
through `open_member_file`: it never follows a link, never blocks, never reads past a bound, and
accepts only a regular file with one name. What it refuses is described (what it was, who owns it),
never read; the caller records that and goes on. Standard library only: the CLI and the job use it.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass

MAX_TRIGGER_BYTES = 4096  # a trigger is a few hundred bytes of JSON
MAX_TEAM_LEDGER_BYTES = 16 * 1024 * 1024  # the node-health ledger: years of events


@dataclass(frozen=True)
class Refused:
    """A member-writable entry that was not read: `kind` says what it was, `owner` who planted it."""

    name: str
    kind: str  # symlink | fifo | directory | socket | device | hardlink | oversized | binary | malformed | unreadable
    owner: str | None
    uid: int | None
    size: int | None
    why: str
    inode: tuple[int, int, int] | None = None  # (device, inode, ctime): the same entry is reported once

    def record(self) -> dict[str, object]:
        """The fields a ledger event carries (never any of the entry's contents)."""
        return {"name": self.name, "kind": self.kind, "planted_by": self.owner, "uid": self.uid,
                "size": self.size, "why": self.why}


@dataclass(frozen=True)
class MemberFile:
    """A regular file read within its bound: its bytes and who wrote it (the file's owner)."""

    name: str
    data: bytes
    uid: int
    owner: str
    inode: tuple[int, int, int]


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _kind(mode: int) -> str | None:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return None if stat.S_ISREG(mode) else "unknown"


def _refused(name: str, st: os.stat_result, kind: str, why: str) -> Refused:
    return Refused(name, kind, user_name(st.st_uid), st.st_uid, st.st_size, why,
                   (st.st_dev, st.st_ino, st.st_ctime_ns))


def open_member_file(path: str | os.PathLike[str], max_bytes: int) -> MemberFile | Refused | None:
    """Read `path` if it is a regular file with a single link and at most `max_bytes` long; None if it
    does not exist. The checks hold for what is read: the file is opened without following links and
    without blocking, and the open descriptor is checked (a swap after `lstat` changes nothing)."""
    name = os.path.basename(os.fspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return Refused(name, "unreadable", None, None, None, e.strerror or str(e))
    kind = _kind(st.st_mode)
    if kind is not None:
        return _refused(name, st, kind, f"a {kind}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # became a link after lstat
            return _refused(name, st, "symlink", "a symlink, not a regular file")
        return _refused(name, st, "unreadable", e.strerror or str(e))
    try:
        st = os.fstat(fd)
        kind = _kind(st.st_mode)
        if kind is not None:
            return _refused(name, st, kind, f"a {kind}, not a regular file")
        if st.st_nlink != 1:
            return _refused(name, st, "hardlink", f"a file with {st.st_nlink} names (a hard link)")
        if st.st_size > max_bytes:
            return _refused(name, st, "oversized", f"{st.st_size} bytes, more than {max_bytes}")
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:  # grew after fstat
            return _refused(name, st, "oversized", f"more than {max_bytes} bytes")
        return MemberFile(name, data, st.st_uid, user_name(st.st_uid), (st.st_dev, st.st_ino, st.st_ctime_ns))
    finally:
        os.close(fd)


def same_entry(path: str | os.PathLike[str], inode: tuple[int, int, int]) -> bool:
    """Whether `path` still names the entry that was read (so removing it removes what was read)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino, st.st_ctime_ns) == inode


def printable(value: object, limit: int) -> str | None:
    """A member's free text made safe for records and terminals: a string, control characters dropped,
    at most `limit` characters; anything else is None."""
    if not isinstance(value, str):
        return None
    text = "".join(c if c.isprintable() else " " for c in value).strip()
    return text[:limit] if text else None
