"""Which ranks' output reaches the segment log (`logging.rank_output`, issue 33). At 1,000 nodes x 8 GPUs
every rank printing its warnings and start-up lines makes a log of 8,000 interleaved copies that nobody
reads, on a shared filesystem. With `failing` (the default) the output of rank 0 and of the last rank
(where Megatron prints its iteration lines: `print_rank_last`) passes through; every other rank's task
supervisor (runtime/task.py) holds its rank's output in memory, the last HOLD_LINES lines
(HOLD_BYTES at most), and writes it to the log, under a header, only when the rank fails (a non-zero
exit, killed by a signal) or says it is slow: the trainer prints SLOW_MARK when the straggler check
finds its compute above the median by more than `cluster.straggler_threshold`
(runtime/observation/observe.py); from then on that rank's output passes through. With `all`, every
rank's output passes through, as Slurm writes it.

Standard library only: the supervisor imports it (~1 ms). Cost: one reader thread per held rank and a
copy of each line; nothing on rank 0."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from typing import BinaryIO

SLOW_MARK = "[megalaunch keep-log]"
HOLD_LINES = 400
HOLD_BYTES = 256 * 1024
MAX_LINE = 64 * 1024  # a line without a newline (a progress bar) is cut into pieces this long


class HeldOutput:
    """One rank's output, read from its pipe: held, or passed to `out` once the rank is slow or fails."""

    def __init__(self, pipe: BinaryIO, rank: int, out: BinaryIO | None = None) -> None:
        self.pipe = pipe
        self.rank = rank
        self.out = out if out is not None else sys.stdout.buffer
        self.lines: deque[bytes] = deque()
        self.size = 0
        self.dropped = 0
        self.passing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="rank-output", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        mark = SLOW_MARK.encode()
        for line in iter(lambda: self.pipe.readline(MAX_LINE), b""):
            with self._lock:
                if not self.passing and mark in line:
                    self._release("it reported itself slow")
                if self.passing:
                    self._write(line)
                    continue
                self.lines.append(line)
                self.size += len(line)
                while len(self.lines) > HOLD_LINES or self.size > HOLD_BYTES:
                    self.size -= len(self.lines.popleft())
                    self.dropped += 1

    def _write(self, data: bytes) -> None:
        try:
            self.out.write(data)
            self.out.flush()
        except (OSError, ValueError):  # the log is gone: nothing to keep it for
            pass

    def _release(self, why: str) -> None:
        """Write what is held under a header, then pass everything through."""
        earlier = f"; {self.dropped} earlier line(s) not kept" if self.dropped else ""
        self._write(f"[megalaunch task] rank {self.rank}'s output ({why}; logging.rank_output: failing holds "
                    f"the output of ranks other than 0 until they fail or are slow{earlier}):\n".encode()
                    + b"".join(self.lines))
        self.lines.clear()
        self.size = 0
        self.passing = True

    def finish(self, failed: str | None, timeout: float = 5.0) -> None:
        """The rank ended (`failed`: how, or None): read what is left, then write it if it failed."""
        self._thread.join(timeout)
        with self._lock:
            if failed and not self.passing:
                self._release(failed)
            elif not self.passing:
                self.lines.clear()


def start(command: list[str], *, hold: bool, rank: int, **popen: object) -> tuple[subprocess.Popen[bytes], HeldOutput | None]:
    """Start `command`; with `hold`, its output goes through a HeldOutput."""
    if not hold:
        return subprocess.Popen(command, **popen), None  # type: ignore[call-overload]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)  # type: ignore[call-overload]
    assert child.stdout is not None
    return child, HeldOutput(child.stdout, rank)
