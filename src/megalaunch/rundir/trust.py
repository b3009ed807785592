"""The run directory's trust boundary (docs/security.md): the owner's files are written only by the
owner; members write only in `triggers/` (sticky), which holds nothing the job executes or reads as
configuration.

Three checks make that hold for what the job runs, and they run where it matters:
- **modes**: the run directory and everything the job trusts are the owner's and not writable by the
  group (`tighten` repairs a run made by an older megalaunch, whose directory was 2770);
- **the path**: no directory on the way to the run lets another user rename it (group- or
  world-writable without the sticky bit), or the whole run could be swapped for a member's copy;
- **hashes**: `manifest.json` records the sha256 of every file the job executes or reads as
  configuration (at submit, and again by `resume --set`, which the ledger records). `job begin` checks
  them before a step starts and before a successor is queued, and the successor is submitted from the
  bytes that were checked, never by re-reading the file.
Standard library only."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from megalaunch.errors import RunDirError
from megalaunch.rundir.paths import RunPaths

# What the job executes or reads as configuration (relative to the run directory).
TRUSTED_FILES = ("job.sbatch", "megatron.args", "runtime.json", "run.yaml", "data_blend.txt")
RUN_DIR_MODE = 0o2750  # the owner writes, the group reads; setgid keeps the run's group
TRIGGER_DIR_MODE = 0o3770  # members create triggers; sticky: nobody removes or renames another's file
TEAM_DIR_MODE = 0o3770  # a directory every member writes (runs of a team, the node-health ledger)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_hashes(files: dict[str, str]) -> dict[str, str]:
    """sha256 of each trusted file among `files` (relative path -> text), for manifest.json."""
    return {rel: sha256_of(text.encode()) for rel, text in sorted(files.items()) if rel in TRUSTED_FILES}


def recorded_hashes(paths: RunPaths) -> dict[str, str] | None:
    """The hashes manifest.json records, or None for a run made before they were recorded."""
    import json

    try:
        manifest = json.loads(paths.manifest.read_bytes())
    except (OSError, ValueError):
        return None
    hashes = manifest.get("trusted_sha256") if isinstance(manifest, dict) else None
    return hashes if isinstance(hashes, dict) else None


def read_trusted(paths: RunPaths, rel: str) -> bytes:
    """A trusted file's bytes, checked: the owner's regular file (no link), not group-writable, and
    equal to the hash the owner recorded. Raises RunDirError naming what differs."""
    path = paths.root / rel
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise RunDirError(f"{path} cannot be read without following links: {e.strerror}",
                          fix="the file the owner submitted was replaced; submit the recipe again") from None
    try:
        st = os.fstat(fd)
        _require_owned(path, st)
        if not stat.S_ISREG(st.st_mode):
            raise RunDirError(f"{path} is not a regular file", fix="submit the recipe again")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    hashes = recorded_hashes(paths)
    if hashes is not None and rel in hashes and sha256_of(data) != hashes[rel]:
        raise RunDirError(f"{rel} differs from what the run's owner recorded (sha256 {hashes[rel][:12]}..., now "
                          f"{sha256_of(data)[:12]}...): a changed file is never run",
                          fix="restore it, or change settings through `megalaunch resume RUN --set` (recorded)")
    return data


def verify_trusted(paths: RunPaths) -> dict[str, bytes]:
    """Every trusted file that exists, checked (`read_trusted`); raises on the first that fails."""
    hashes = recorded_hashes(paths) or {}
    out: dict[str, bytes] = {}
    for rel in TRUSTED_FILES:
        if rel in hashes or os.path.lexists(paths.root / rel):
            out[rel] = read_trusted(paths, rel)
    return out


def _require_owned(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid():
        raise RunDirError(f"{path} belongs to uid {st.st_uid}, not to the run's owner (you, uid {os.getuid()})",
                          fix="only the owner's files are run; submit the recipe again")
    if st.st_mode & 0o022:
        raise RunDirError(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})",
                          fix=f"chmod go-w {path}")


def check_path(root: Path) -> None:
    """Refuse a run directory that another user could swap: the directory must be the owner's, and no
    directory above it may be writable by another user unless it is sticky (as /tmp is) or theirs."""
    me = os.getuid()
    st = os.stat(root)
    if st.st_uid != me:
        raise RunDirError(f"{root} belongs to uid {st.st_uid}: only the run's owner runs its jobs",
                          fix="submit your own run")
    check_ancestors(root)


def check_ancestors(path: Path) -> None:
    """No directory above `path` (as written, and with links resolved) lets another user rename its
    entries: group- or world-writable directories must be sticky or this user's."""
    me = os.getuid()
    seen: set[Path] = set()
    for d in [*Path(os.path.abspath(path)).parents, *Path(os.path.realpath(path)).parents]:
        if d in seen:
            continue
        seen.add(d)
        try:
            ds = os.stat(d)
        except OSError:
            continue
        if ds.st_mode & 0o022 and not ds.st_mode & stat.S_ISVTX and ds.st_uid != me:
            raise RunDirError(f"{d} (above the run directory) is writable by other users and not sticky: any of "
                              "them could rename the run and put their own in its place",
                              field="run.root", valid="a run root under directories only you (or root) can change, "
                              "or sticky ones like /tmp",
                              fix=f"ask the owner of {d} to `chmod +t` it, or --set run.root=~/megalaunch-runs")


def check_layout(paths: RunPaths) -> None:
    """The directories the job writes into are the owner's own, not links a member left in an older,
    group-writable run directory."""
    for d in (paths.state, paths.checkpoints, paths.logs, paths.debug, paths.consumed_triggers, paths.triggers):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise RunDirError(f"{d} is not a directory of the run's owner (a link, or another user's)",
                              fix="only the owner's files are trusted: submit the recipe again")


def tighten(paths: RunPaths) -> list[str]:
    """Give a run made by an older megalaunch (2770 directory, group-writable ledger) the current modes.
    Only the owner can; returns what changed (for the ledger)."""
    changed: list[str] = []

    def fix(path: Path, want: int, mask: int = 0o7777) -> None:
        try:
            st = os.lstat(path)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
            return
        if stat.S_IMODE(st.st_mode) & mask != want & mask:
            os.chmod(path, (stat.S_IMODE(st.st_mode) & ~mask) | (want & mask))
            changed.append(f"{path.relative_to(paths.root) if path != paths.root else '.'} "
                           f"{stat.S_IMODE(st.st_mode):o}->{stat.S_IMODE(os.lstat(path).st_mode):o}")

    fix(paths.root, RUN_DIR_MODE, 0o7022)  # setgid, nobody else writes
    for d in (paths.state, paths.checkpoints, paths.logs, paths.debug, paths.consumed_triggers, paths.tokenizer):
        fix(d, 0, 0o022)
    for rel in (*TRUSTED_FILES, "manifest.json"):
        fix(paths.root / rel, 0, 0o022)
    fix(paths.ledger, 0, 0o022)
    fix(paths.triggers, TRIGGER_DIR_MODE, 0o1000)  # sticky
    return changed
