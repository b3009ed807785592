"""The hang watchdog: no progress for `timeout_s` -> every thread's Python stack dumped under
RUN/debug/, outcome `hung` (rank 0), and the process exits. With `auto` the limit follows the measured step
and depends on what the trainer is doing (between saves, during a save, during an evaluation:
runtime/health/hang_limit.py); the check period and the grace follow the lowest limit, so a frozen rank
with 1 s steps ends every rank within a minute.

Each rank runs its own watchdog thread. A rank stuck inside a step leaves the other ranks stuck in
a collective, so every rank stops making progress and every rank dumps its stacks. The thread
needs the GIL, which blocking collectives and sleeps release; as a backstop for a thread that
holds the GIL forever, `faulthandler.dump_traceback_later` (a C thread) dumps and exits a little
later without Python's help (no outcome then: the chain sees a segment that ended without one).

The watchdog also lets the hang watcher outside Python (runtime/hangwatch.py) ask for stacks: on
STACKS_SIGNAL (SIGURG, whose default action is to be ignored, so it harms no other process of the step)
faulthandler's C handler writes every thread's stack to RUN/debug/stacks-step-job<J>-rank<R>.txt, also
while the main thread is blocked in C (a rendezvous, a collective)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from megalaunch.runtime.health.hang_limit import HangLimit, Progress

EXIT_HUNG = 75  # distinct from 0/1 so a log reader sees why the task ended
STACKS_SIGNAL = signal.SIGURG  # ignored by default: harmless to every process that does not register it


def check_period_s(timeout_s: float) -> float:
    """How often the thread looks: a tenth of the limit between saves (4.5 s at the 45 s floor)."""
    return min(30.0, max(0.5, timeout_s / 10))


def grace_s(check_s: float) -> float:
    """How long the rank that fired stays before it exits: the other ranks, stuck in a collective with it,
    fire within about one check period of it and dump their stacks before its exit turns their wait
    into an error."""
    return min(60.0, 2 * check_s + 1)


def backstop_after_s(timeout_s: float) -> float:
    """When, without progress, a rank's watchdog has surely acted: the Python thread fires by timeout +
    one check and exits a grace period later; the faulthandler backstop fires at this time."""
    check = check_period_s(timeout_s)
    return timeout_s + 2 * check + min(60.0, timeout_s)


class Watchdog:
    def __init__(self, debug_dir: Path, *, rank: int, job_id: str | None, timeout_s: float | str | None,
                 on_hang: Callable[[str], None], check_s: float | None = None,
                 exit: Callable[[int], None] = os._exit, save_estimate_s: float = 60.0,
                 on_limit: Callable[[HangLimit], None] | None = None) -> None:
        """`timeout_s`: seconds, or "auto" (runtime/health/hang_limit.py: follows the measured step);
        `on_limit`: told when an auto limit changes."""
        self.debug_dir = debug_dir
        self.rank = rank
        self.job_id = job_id or str(os.getpid())
        self.limit = HangLimit(timeout_s, save_estimate_s)
        self._fixed_check = check_s is not None
        self.check_s = check_s if check_s is not None else check_period_s(self.limit.value)
        self.on_limit = on_limit
        self.on_hang = on_hang
        self._exit = exit
        self._last = time.monotonic()
        self._what = "start"
        self._stop = threading.Event()
        self._wake = threading.Event()  # the check period changed (or stop): look again now
        self._thread = threading.Thread(target=self._run, name="megalaunch-watchdog", daemon=True)
        self._backstop_file: IO[str] | None = None
        self._armed_at = 0.0
        self._stacks_file: IO[str] | None = None

    @property
    def timeout_s(self) -> float:
        """The limit in force now: the phase's (between saves, during a save or an evaluation)."""
        return self.limit.for_phase()

    @property
    def grace_s(self) -> float:
        return grace_s(self.check_s)

    def start(self, stacks_file: Path | None = None) -> Watchdog:
        """`stacks_file`: where the stacks go when the hang watcher sends STACKS_SIGNAL."""
        if self.timeout_s > 0:
            self._thread.start()
            self._arm_backstop()
        if stacks_file is not None:
            self._register_stacks_signal(stacks_file)
        return self

    def _register_stacks_signal(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._stacks_file = open(path, "a")  # noqa: SIM115 (faulthandler writes to it until exit)
            faulthandler.register(STACKS_SIGNAL, file=self._stacks_file, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError) as e:  # stacks are a help, never a reason to fail
            print(f"[megalaunch rank {self.rank}] no stacks on {STACKS_SIGNAL.name}: {e}", file=sys.stderr, flush=True)

    def beat(self, what: str = "") -> HangLimit:
        """Progress was made (an iteration ended, a save began or ended, an evaluation began, ran a batch
        or ended). Returns the limits in force (rank 0's heartbeat carries them)."""
        now = time.monotonic()
        self._last = now
        self._what = what
        if self.limit.auto:
            before = self.timeout_s
            if self._measure(now, what) or self.timeout_s != before:
                self._armed_at = float("-inf")  # re-arm the backstop with the new limit or phase now
        # Re-arming starts a C thread: do it once per check period, not once per iteration.
        if self._backstop_file is not None and now - self._armed_at >= self.check_s:
            self._arm_backstop()
        return self.limit

    def _measure(self, now: float, what: str) -> bool:
        """Feed the measures and the phase from the beat's words (runtime/observation/observe.py's); True
        when the limits changed."""
        feed(self.limit.progress, now, what)
        if not self.limit.update():
            return False
        if not self._fixed_check:
            self.check_s = check_period_s(self.limit.value)
            self._wake.set()  # the thread may be in a long wait of the unmeasured limit's period
        if self.on_limit is not None:
            self.on_limit(self.limit)
        return True

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        faulthandler.cancel_dump_traceback_later()
        if self._backstop_file is not None:
            self._backstop_file.close()
            _remove_if_empty(self._backstop_file.name)  # the backstop never fired
            self._backstop_file = None
        if self._stacks_file is not None:
            faulthandler.unregister(STACKS_SIGNAL)
            self._stacks_file.close()
            _remove_if_empty(self._stacks_file.name)  # no dump was asked for
            self._stacks_file = None

    def stack_file(self, kind: str = "stacks") -> Path:
        return self.debug_dir / f"{kind}-job{self.job_id}-rank{self.rank}.txt"

    def hang_reported(self) -> str | None:
        """The reason, when any rank's watchdog of this job fired (its stack file exists)."""
        for path in sorted(self.debug_dir.glob(f"stacks-job{self.job_id}-rank*.txt")):
            first = path.read_text(errors="replace").splitlines()[:1]
            return first[0].lstrip("# ") if first else f"hang reported in {path.name}"
        return None

    def _arm_backstop(self) -> None:
        if self._backstop_file is None:
            self.debug_dir.mkdir(parents=True, exist_ok=True)
            self._backstop_file = open(self.stack_file("stacks-backstop"), "w")  # noqa: SIM115
        self._armed_at = time.monotonic()
        # The Python thread fires by timeout + one check; the backstop one check and a minute (or a
        # timeout) after that.
        faulthandler.dump_traceback_later(self.timeout_s + 2 * self.check_s + min(60.0, self.timeout_s),
                                          repeat=False, file=self._backstop_file, exit=True)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.check_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            idle = time.monotonic() - self._last
            if idle >= self.timeout_s:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        how = f"; {self.limit.describe()}" if self.limit.auto else ""
        reason = (f"no progress for {idle:.0f} s (hang_timeout {self.timeout_s:g} s{how}) on rank {self.rank}; "
                  f"last: {self._what or 'start'}")
        path = self.stack_file()
        faulthandler.cancel_dump_traceback_later()  # this thread runs: the backstop is not needed
        try:
            self.debug_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"# {reason}\n# pid {os.getpid()} time {time.time():.3f}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            print(f"[megalaunch rank {self.rank}] HUNG: {reason}; stacks in {path}", file=sys.stderr, flush=True)
            self.on_hang(reason)
            # Stay a little: the other ranks, stuck in a collective with this one, dump their stacks
            # too before this exit turns their wait into an error.
            time.sleep(self.grace_s)
        finally:
            self._exit(EXIT_HUNG)


def feed(progress: Progress, now: float, what: str) -> None:
    """One beat's words into the measure: iterations, a save's start, end and written checkpoint, an
    evaluation's start, batches and end."""
    number = _iteration(what)
    if what.startswith("iteration "):
        progress.iteration(now, number)
    elif what.startswith("save at") and what.endswith("started"):
        progress.save_started(now, number)
    elif what.startswith("save at"):
        progress.save_ended(now, number)
    elif what.startswith(("checkpoint of iteration", "waited for the save")):
        progress.written(now, number)
        progress.other()
    elif what in ("evaluation started", "evaluation batch"):
        progress.eval_beat(now)
    elif what == "evaluation done":
        progress.eval_ended(now)
    else:
        progress.other()


def _iteration(what: str) -> int | None:
    """The number after "iteration" in a beat's words."""
    words = what.split()
    return _int(words[words.index("iteration") + 1]) if "iteration" in words[:-1] else None


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _remove_if_empty(path: str) -> None:
    """Leave no empty file behind in RUN/debug (what is there is a stack dump to read)."""
    with contextlib.suppress(OSError):
        if os.path.getsize(path) == 0:
            os.unlink(path)
