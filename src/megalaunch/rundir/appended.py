"""Records of an append-only JSON-lines file (a run's ledger, its metrics) parsed once per user: `status RUN`
of a run with thousands of segments would otherwise parse megabytes on every call (issue 33: <= 1 s).

What was parsed up to the last complete line is kept in the user's own cache (XDG_CACHE_HOME or ~/.cache,
megalaunch/appended/, private: 0700/0600; marshal, so only plain JSON values) with the file's identity
(device, inode), the byte offset and the bytes just before it; the next read parses only what was appended
since. A file that was replaced, truncated or rewritten before the offset (its identity or those bytes
differ) is parsed whole again. A cache that cannot be read or written changes nothing but the time: the
run directory is never written, so any member of the group may run `status` on it."""

from __future__ import annotations

import contextlib
import hashlib
import marshal
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

VERSION = 1
TAIL = 64  # bytes before the offset that must still be there
MIN_CACHED = 64 * 1024  # smaller files are parsed
# read_json_cached caches only in a process that asked for it (`status`): a job's own reads never write here
CACHE_JSON = False


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megalaunch" / "appended"


def read_appended(path: Path, key: str, parse: Callable[[list[str]], list[dict[str, Any]]],
                  prune: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = lambda r: r) -> list[dict[str, Any]]:
    """prune(parse(every line of `path`)), parsing only the lines appended since the last call with this
    `key` (which names `parse` and `prune`: a different selection needs another key). `parse` takes the
    file's lines in order and must be applicable chunk by chunk; `prune` must be idempotent."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return []
    if st.st_size < MIN_CACHED:  # parsed in less time than a cache file takes to read
        with open(path, "rb") as f:
            return prune(parse(f.read().decode(errors="replace").splitlines()))
    cache = _cache_file(path, key)
    records, offset = _cached(cache, path, st)
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # only complete lines are kept: a line being written is parsed each time
    if end:
        records = prune(records + parse(data[:end].decode(errors="replace").splitlines()))
        with open(path, "rb") as f:
            f.seek(max(0, offset + end - TAIL))
            tail = f.read(min(TAIL, offset + end))
        _store(cache, {"dev": st.st_dev, "ino": st.st_ino, "offset": offset + end, "tail": tail, "records": records})
    rest = data[end:].decode(errors="replace").splitlines()
    return prune(records + parse(rest)) if rest else records


def read_json_cached(path: Path) -> Any:
    """files.read_json, through the user's cache while CACHE_JSON is on: a file rewritten whole from time to
    time (state/goodput.json, megabytes for a chain of thousands of segments) is parsed again only when its
    identity, size or modification time changed."""
    from megalaunch.rundir.files import read_json

    try:
        st = os.stat(path)
    except OSError:
        return None
    if not CACHE_JSON:
        return read_json(path)
    cache = _cache_file(path, "json")
    stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
    try:
        data = marshal.loads(cache.read_bytes())
        if data["stamp"] == stamp:
            return data["value"]
    except (OSError, EOFError, ValueError, TypeError, KeyError):
        pass
    value = read_json(path)
    _store(cache, {"stamp": stamp, "value": value})
    return value


def by_stamp(name: str, stamps: dict[str, Any], compute: Callable[[str], Any]) -> dict[str, Any]:
    """key -> compute(key) for every key of `stamps`, reusing the value cached under the user's cache `name`
    where the key's stamp (what its value derives from: files' sizes and modification times) is unchanged.
    A key whose compute raises is left out (and not cached). Values are plain JSON-like values."""
    cache = cache_dir() / f"{name}.marshal"
    try:
        old = marshal.loads(cache.read_bytes())
        old = old if isinstance(old, dict) and old.get("version") == [VERSION, sys.version] else {}
    except (OSError, EOFError, ValueError, TypeError):
        old = {}
    entries: dict[str, Any] = old.get("entries") or {}
    out, fresh, changed = {}, {}, len(entries) != len(stamps)
    for key, stamp in stamps.items():
        hit = entries.get(key)
        if isinstance(hit, list) and len(hit) == 2 and hit[0] == stamp:
            out[key] = hit[1]
        else:
            try:
                out[key] = compute(key)
            except Exception:
                changed = True
                continue
            changed = True
        fresh[key] = [stamp, out[key]]
    if changed:
        _store(cache, {"version": [VERSION, sys.version], "entries": fresh})
    return out


def stamp(*paths: str) -> list[Any]:
    """What by_stamp compares: each file's size, modification time and inode (None: missing)."""
    out: list[Any] = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append([st.st_size, st.st_mtime_ns, st.st_ino])
        except OSError:
            out.append(None)
    return out


def _cache_file(path: Path, key: str) -> Path:
    name = hashlib.sha256(f"{os.path.realpath(path)}\0{key}\0{VERSION}\0{sys.version}".encode()).hexdigest()[:40]
    return cache_dir() / f"{name}.marshal"


def _cached(cache: Path, path: Path, st: os.stat_result) -> tuple[list[dict[str, Any]], int]:
    try:
        data = marshal.loads(cache.read_bytes())
        offset, tail = int(data["offset"]), bytes(data["tail"])
        if (data["dev"], data["ino"]) != (st.st_dev, st.st_ino) or offset > st.st_size:
            return [], 0
        with open(path, "rb") as f:
            f.seek(offset - len(tail))
            if f.read(len(tail)) != tail:
                return [], 0
        return list(data["records"]), offset
    except (OSError, EOFError, ValueError, TypeError, KeyError):
        return [], 0


def _store(cache: Path, data: dict[str, Any]) -> None:
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps(data))
        os.replace(tmp, cache)
    except (OSError, ValueError):  # no cache: the next call parses again
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
