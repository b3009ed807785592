"""The append-only ledger of a run: state/ledger.jsonl (docs/architecture.md). Every event carries `event`,
`time` and, where it concerns a job, `job_id`. Decisions are derived from it, never stored twice."""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megalaunch.rundir.files import append_jsonl, parse_jsonl, read_jsonl
from megalaunch.rundir.paths import RunPaths

# Outcomes after which a segment made no progress unless a new checkpoint appeared.
ENDING_OUTCOMES = {"finished", "exited", "aborted"}
_EVENT_KEY = '"event"'
_EVENT_PREFIX = '"event": "'  # json.dumps's separator: a line written otherwise is parsed to tell
_EVENT_FIRST = "{" + _EVENT_PREFIX


@dataclass
class Segment:
    """One job of the chain, as the ledger tells it."""

    job_id: str
    submitted_by: str | None = None
    pid: int | None = None  # local backend: the process running the chain
    started: dict[str, Any] | None = None
    ended: dict[str, Any] | None = None
    resumed: dict[str, Any] | None = None  # the trainer's own record of the checkpoint it loaded
    fallback: dict[str, Any] | None = None  # the trainer rejected the newest checkpoint
    skipped: bool = False  # it started after the chain had stopped and did not train
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def outcome(self) -> str | None:
        return self.ended.get("outcome") if self.ended else None

    @property
    def start_iteration(self) -> int | None:
        """The checkpoint this segment actually resumed from: the trainer's record when it wrote one
        (after a fallback it differs from the tracker that `job begin` saw), else the tracker's."""
        if self.resumed is not None:
            return self.resumed.get("iteration")
        if self.fallback is not None:
            return self.fallback.get("to") or 0
        return (self.started or {}).get("checkpoint_iteration")


class Ledger:
    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": time.time(), "user": _user(), "host": socket.gethostname(), **fields}
        append_jsonl(self.paths.ledger, record)
        return record

    def events(self, only: Callable[[str | None], bool] | None = None, *, skip: frozenset[str] = frozenset(),
               newest: Mapping[str, int] | None = None, cache_key: str | None = None) -> list[dict[str, Any]]:
        """Every event, oldest first; with `only`, the events whose kind it accepts; none of the kinds in
        `skip`; of each kind `newest` names, its newest N events only. The other lines are not parsed (a run
        of thousands of segments holds megabytes of records, health checks most of them, that `status`
        never shows). With `cache_key` (which must name `only`: the same key, the same selection), parse only
        what was appended since this user's last such read (rundir/appended.py; a small ledger is parsed)."""
        newest = newest or {}
        if only is None and not skip and not newest:
            return read_jsonl(self.paths.ledger)
        if cache_key is not None:
            from megalaunch.rundir.appended import read_appended

            key = f"ledger {cache_key} skip={sorted(skip)} newest={sorted(newest.items())}"
            return read_appended(self.paths.ledger, key, lambda lines: _select(lines, only, skip, newest),
                                 lambda records: _prune(records, newest))
        return _select(_lines(self.paths), only, skip, newest)

    def current_epoch(self, events: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Events since the chain was last (re)started with `megalaunch resume`."""
        events = self.events() if events is None else events
        for i in range(len(events) - 1, -1, -1):
            if events[i]["event"] == "chain_resumed":
                return events[i:]
        return events

    def segments(self, events: list[dict[str, Any]] | None = None) -> list[Segment]:
        """Segments in submission order: segment N (the number `status`, `logs --segment` and `report`
        show) is `segments()[N - 1]`; see `segment_numbers`."""
        events = self.events() if events is None else events
        by_id: dict[str, Segment] = {}
        for e in events:
            jid = e.get("job_id")
            if jid is None:
                continue
            jid = str(jid)
            seg = by_id.get(jid)
            if seg is None:
                seg = by_id[jid] = Segment(job_id=jid)
            if e["event"] == "submitted":
                seg.submitted_by = e.get("by")
                seg.pid = e.get("pid")
            elif e["event"] == "started":
                seg.started = e
            elif e["event"] == "ended":
                seg.ended = e
            elif e["event"] == "resumed":
                seg.resumed = e
            elif e["event"] == "resume_fallback":
                seg.fallback = e
            elif e["event"] == "skipped":
                seg.skipped = True
        return list(by_id.values())

    def stopped(self, events: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """The chain_stopped event of the current epoch, if any (`events`: the ledger's, read already)."""
        for e in reversed(self.current_epoch(events)):
            if e["event"] == "chain_stopped":
                return e
        return None

    def consecutive_without_progress(self) -> int:
        """Failures counted back from the newest that made no new checkpoint: ended segments, and the
        failed steps of a segment that were restarted inside it (`restart`, launcher/chain/restart.py). A
        segment whose restarted steps saved counts from its last restart on."""
        n = 0
        for e in reversed(self.current_epoch()):
            if e["event"] == "ended":
                progress = e.get("step_new_checkpoint", e.get("new_checkpoint"))
            elif e["event"] == "restart":
                progress = e.get("new_checkpoint")
            else:
                continue
            if progress:
                break
            n += 1
        return n

    def step_progress(self, job_id: str, now: int | None) -> dict[str, Any]:
        """For `ended`: whether the segment's last step made a new checkpoint, where it restarted in-job."""
        last = next((e for e in reversed(self.events()) if e["event"] == "restart" and str(e.get("job_id")) == job_id), None)
        if last is None:
            return {}
        before = last.get("checkpoint_iteration")
        return {"restarts": last.get("step"), "step_new_checkpoint": now is not None and (before is None or now > before)}

    def last(self, event: str) -> dict[str, Any] | None:
        for e in reversed(self.events()):
            if e["event"] == event:
                return e
        return None


def event_name(line: str) -> str | None:
    """The kind of the event on one ledger line without parsing it, or None when the text alone does not
    tell (then the line is parsed). Exact for what json.dumps writes: inside a string a quote is escaped,
    so `"event"` between quotes is a key, and a line with one such key has it at its top level."""
    if line.startswith(_EVENT_FIRST):  # every writer puts `event` first (files.append_jsonl keeps the order)
        end = line.find('"', len(_EVENT_FIRST))
        name = line[len(_EVENT_FIRST):end]
        if end > 0 and "\\" not in name:
            return name
    start = line.find(_EVENT_PREFIX)
    if start < 0 or line.count(_EVENT_KEY) != 1:
        return None
    start += len(_EVENT_PREFIX)
    end = line.find('"', start)
    name = line[start:end]
    return name if end > start and "\\" not in name else None


def _select(lines: list[str], only: Callable[[str | None], bool] | None, skip: frozenset[str],
            newest: Mapping[str, int]) -> list[dict[str, Any]]:
    """Ledger.events' selection from these lines (see there)."""
    first, at = _EVENT_FIRST, len(_EVENT_FIRST)  # event_name's first case inline: 60,000 calls cost 0.1 s
    named = [(line, name if line.startswith(first) and "\\" not in (name := line[at:line.find('"', at)])
              and line.find('"', at) > 0 else event_name(line)) for line in lines if line and not line.isspace()]
    drop = _older(enumerate(name for _, name in named), newest)
    kept = [line for i, (line, name) in enumerate(named) if name is None or (
        (only is None or only(name)) and name not in skip and i not in drop)]
    records = _prune(parse_jsonl(kept), newest)  # a line the text alone did not name: parsed, then judged
    return [r for r in records if (only is None or only(r.get("event"))) and r.get("event") not in skip]


def _prune(records: list[dict[str, Any]], newest: Mapping[str, int]) -> list[dict[str, Any]]:
    if not newest:
        return records
    drop = _older(enumerate(r.get("event") for r in records), newest)
    return [r for i, r in enumerate(records) if i not in drop]


def _older(kinds: Iterable[tuple[int, str | None]], newest: Mapping[str, int]) -> set[int]:
    """The positions of the events beyond the newest N of each kind `newest` names."""
    seen: dict[str, list[int]] = {}
    for i, kind in kinds:
        if kind is not None and kind in newest:
            seen.setdefault(kind, []).append(i)
    return {i for kind, at in seen.items() for i in at[:max(0, len(at) - newest[kind])]}


def _lines(paths: RunPaths) -> list[str]:
    """The ledger's lines that hold something (read_jsonl skips blank ones too)."""
    try:
        with open(paths.ledger) as f:
            return [line for line in f.read().splitlines() if line and not line.isspace()]
    except FileNotFoundError:
        return []


def segment_numbers(segments: list[Segment]) -> dict[str, int]:
    """Job id -> segment number: the one numbering of a run's segments, 1 = the first job ever
    submitted, counting every job in submission order across resumes (queued, cancelled and skipped
    ones too, so a number never changes once shown)."""
    return {s.job_id: n for n, s in enumerate(segments, 1)}


def number_ranges(numbers: list[int]) -> str:
    """`[1, 2, 3, 5]` -> "1..3, 5": how a list of segment numbers is shown in messages."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "?"
