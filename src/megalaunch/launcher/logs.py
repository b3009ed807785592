"""What `megalaunch logs` prints: a segment's log (all of it, its last N lines, or what follows
Megatron's argument dump) and, with `-f`, the chain as it goes on: each new segment's log in turn,
until no segment of the run is running or queued any more.

Segments are numbered once, in the ledger (`rundir.ledger.segment_numbers`), so `logs --segment N`
means the segment `status` shows as N."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from megalaunch.errors import RunDirError
from megalaunch.launcher.chain.backend import unfinished
from megalaunch.rundir.ledger import Ledger, Segment, number_ranges, segment_numbers
from megalaunch.rundir.paths import RunPaths

# Megatron's `_print_args` frames its ~1,100-line dump of every argument with these two lines
# (megatron/training/arguments.py: "---- arguments ----" ... "---- end of arguments ----").
ARGS_BEGIN = re.compile(rb"-{3,} arguments -{3,}\s*$")
ARGS_END = re.compile(rb"-{3,} end of arguments -{3,}\s*$")
# States in which a job may still write to its log (squeue also lists jobs that ended a moment ago).
WRITING_STATES = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")
POLL_S = 0.5


@dataclass(frozen=True)
class SegmentLog:
    number: int
    job_id: str
    path: Path


def segment_logs(paths: RunPaths, segments: list[Segment]) -> list[SegmentLog]:
    """The segments that have a log file, in order, with their numbers."""
    numbers = segment_numbers(segments)
    return [SegmentLog(numbers[s.job_id], s.job_id, p) for s in segments if (p := paths.segment_log(s.job_id)).exists()]


def choose_log(paths: RunPaths, number: int | None) -> SegmentLog:
    """Segment `number`'s log (None: the newest log), or a one-line error listing the numbers that have one."""
    segments = Ledger(paths).segments()
    logs = segment_logs(paths, segments)
    if not logs:
        raise RunDirError(f"no segment has written a log yet in {paths.logs}", fix=f"megalaunch status {paths.root}")
    if number is None:
        return logs[-1]
    for log in logs:
        if log.number == number:
            return log
    if 1 <= number <= len(segments):
        s = segments[number - 1]
        why = (f"job {s.job_id} never started (queued, cancelled or skipped)" if s.started is None and not s.skipped
               else f"job {s.job_id} was skipped (it started after the chain had stopped)" if s.skipped
               else f"job {s.job_id}'s log {paths.segment_log(s.job_id)} is gone")
    else:
        why = f"the run has {len(segments)} segment(s)"
    raise RunDirError(f"segment {number} has no log: {why}", field="--segment",
                      valid=f"segments with a log: {number_ranges([log.number for log in logs])}",
                      fix=f"megalaunch status {paths.root} lists every segment with its number")


def after_argument_dump(path: Path) -> int:
    """The offset of the first line after Megatron's argument dump, or 0 when the log has none (yet)."""
    offset = 0
    with open(path, "rb") as f:
        for line in f:
            offset += len(line)
            if ARGS_END.search(line.rstrip(b"\n")):
                return offset
    return 0


def tail_offset(path: Path, lines: int, floor: int = 0) -> int:
    """The offset where the last `lines` lines of the file start (not before `floor`), reading backwards."""
    with open(path, "rb") as f:
        end = f.seek(0, 2)
        if lines <= 0:
            return end
        pos = end
        if end > floor:  # the newline that ends the file closes the last line, it starts no other
            f.seek(end - 1)
            pos = end - 1 if f.read(1) == b"\n" else end
        seen = 0
        while pos > floor:
            size = min(65536, pos - floor)
            f.seek(pos - size)
            block = f.read(size)
            i = len(block)
            while (i := block.rfind(b"\n", 0, i)) != -1:
                seen += 1
                if seen == lines:
                    return pos - size + i + 1
            pos -= size
    return floor


class DumpFilter:
    """Drops Megatron's argument dump from a stream of log bytes (header through end line), whole
    lines at a time; without `active` it passes everything through unchanged."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.inside = False
        self.partial = b""

    def feed(self, data: bytes) -> bytes:
        if not self.active:
            return data
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return b"".join(self._keep(line + b"\n") for line in lines)

    def flush(self) -> bytes:
        rest, self.partial = self.partial, b""
        return self._keep(rest) if rest else b""

    def _keep(self, line: bytes) -> bytes:
        text = line.rstrip(b"\n")
        if not self.inside and ARGS_BEGIN.search(text):
            self.inside = True
            return b""
        if self.inside:
            if ARGS_END.search(text):
                self.inside = False
            return b""
        return line


def separator(log: SegmentLog) -> bytes:
    return f"==> segment {log.number} (job {log.job_id}): {log.path} <==\n".encode()


def chain_over(backend: object, segments: list[Segment], current: str) -> bool:
    """No segment of the run is queued or running, the current one included (its job may still write
    after `job end` recorded its end). A backend that does not answer is no proof: not over."""
    watch = list(unfinished(segments))
    for s in segments:
        if s.job_id == current and (s.ended is not None or s.skipped):
            watch.append(replace(s, ended=None, skipped=False))
    live, error = backend.live(watch)  # type: ignore[attr-defined]
    if error is not None:
        return False
    return not any(v.state in WRITING_STATES for v in live.values())


def print_logs(paths: RunPaths, out: BinaryIO, *, number: int | None = None, tail: int | None = None,
               since_start: bool = False, follow: bool = False, backend: object = None,
               poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep) -> str | None:
    """Print segment `number`'s log (default: the newest); with `follow`, keep printing it as it grows,
    move on to each later segment's log (after a separator line naming it) and return the line that
    says why it stopped once the chain is over. `backend` (for `follow`) answers which jobs still run."""
    log = choose_log(paths, number)
    start = after_argument_dump(log.path) if since_start else 0
    if tail is not None:
        start = tail_offset(log.path, tail, floor=start)
    while True:
        with open(log.path, "rb") as f:
            f.seek(start)
            then = _stream(paths, log, f, out, DumpFilter(since_start), follow, backend, poll_s, sleep)
        if not isinstance(then, SegmentLog):
            return then
        log, start = then, 0
        out.write(separator(log))
        out.flush()


def _stream(paths: RunPaths, log: SegmentLog, f: BinaryIO, out: BinaryIO, filt: DumpFilter, follow: bool,
            backend: object, poll_s: float, sleep: Callable[[float], None]) -> SegmentLog | str | None:
    """Copy one log to `out`; then (with `follow`) the next segment's log, the end line, or None."""
    while True:
        chunk = f.read(65536)
        if chunk:
            out.write(filt.feed(chunk))
            out.flush()
            continue
        if not follow:
            out.write(filt.flush())
            out.flush()
            return None
        segments = Ledger(paths).segments()
        newer = [s for s in segment_logs(paths, segments) if s.number > log.number]
        if newer or chain_over(backend, segments, log.job_id):
            # its job has ended (a successor starts only then): what it wrote last, then move on or stop
            out.write(filt.feed(f.read()) + filt.flush())
            out.flush()
            if newer:
                return newer[0]
            stopped = Ledger(paths).stopped()
            return (f"==> chain stopped: {stopped.get('reason')} <==" if stopped else
                    f"==> no segment of this run is running or queued: megalaunch status {paths.root} <==")
        sleep(poll_s)
