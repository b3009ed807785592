"""rundir/appended.read_appended: an append-only JSON-lines file parsed once per user, then only what was
appended; anything else about the file (replaced, truncated, rewritten before the offset, a torn last
line, an unreadable cache) gives the same records as a full parse."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from megalaunch.rundir import appended
from megalaunch.rundir.appended import cache_dir, read_appended
from megalaunch.rundir.files import parse_jsonl


@pytest.fixture(autouse=True)
def _cache_every_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(appended, "MIN_CACHED", 0)


class Counting:
    def __init__(self) -> None:
        self.lines = 0

    def __call__(self, lines: list[str]) -> list[dict[str, Any]]:
        self.lines += len(lines)
        return parse_jsonl(lines)


def _write(path: Path, *records: dict[str, Any], mode: str = "a") -> None:
    with open(path, mode) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def test_only_what_was_appended_is_parsed_and_the_result_is_a_full_parse(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    _write(path, *({"event": "x", "i": i} for i in range(100)))
    parse = Counting()
    assert read_appended(path, "k", parse) == parse_jsonl(path.read_text().splitlines())
    assert parse.lines == 100
    _write(path, {"event": "y", "i": 100})
    with open(path, "a") as f:
        f.write('{"event": "z", "i": 1')  # a line being written: parsed (and skipped) each time, never cached
    assert read_appended(path, "k", parse) == parse_jsonl(path.read_text().splitlines())
    assert parse.lines == 100 + 2
    assert read_appended(path, "k", parse)[-1] == {"event": "y", "i": 100} and parse.lines == 100 + 3
    assert [p.stat().st_mode & 0o777 for p in cache_dir().iterdir()] == [0o600]
    assert cache_dir().stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("change", ["replaced", "truncated", "rewritten", "cache damaged"])
def test_a_file_that_changed_otherwise_is_parsed_whole(tmp_path: Path, change: str) -> None:
    path = tmp_path / "ledger.jsonl"
    _write(path, *({"event": "x", "i": i} for i in range(50)))
    read_appended(path, "k", parse_jsonl)
    if change == "replaced":
        _write(tmp_path / "new", {"event": "other"})
        os.replace(tmp_path / "new", path)
    elif change == "truncated":
        _write(path, {"event": "x", "i": 0}, mode="w")
    elif change == "rewritten":  # same length and inode, other bytes before the offset
        text = path.read_text()
        path.write_text(text.replace('"i": 49', '"i": 77'))
    else:
        for f in cache_dir().iterdir():
            f.write_bytes(b"\x00not marshal")
    parse = Counting()
    assert read_appended(path, "k", parse) == parse_jsonl(path.read_text().splitlines())
    assert parse.lines == len(path.read_text().splitlines())


def test_a_small_file_is_parsed_without_a_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(appended, "MIN_CACHED", 64 * 1024)
    path = tmp_path / "ledger.jsonl"
    _write(path, {"event": "x"})
    assert read_appended(path, "k", parse_jsonl) == [{"event": "x"}] and not cache_dir().exists()


def test_an_unwritable_cache_changes_nothing_but_the_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ledger.jsonl"
    _write(path, {"event": "x"})
    monkeypatch.setattr(appended, "cache_dir", lambda: Path("/proc/no/such/dir"))
    assert read_appended(path, "k", parse_jsonl) == [{"event": "x"}]
    assert read_appended(tmp_path / "missing.jsonl", "k", parse_jsonl) == []


def test_prune_applies_across_the_cached_part_and_the_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    _write(path, *({"event": "x", "i": i} for i in range(10)))
    last3 = lambda records: records[-3:]  # noqa: E731
    assert [r["i"] for r in read_appended(path, "last3", parse_jsonl, last3)] == [7, 8, 9]
    _write(path, {"event": "x", "i": 10})
    assert [r["i"] for r in read_appended(path, "last3", parse_jsonl, last3)] == [8, 9, 10]
