"""The stop-signal flag (docs/training.md, "Who receives the stop signal").

Slurm's `--signal=USR2@LEAD` goes to **every process of the job step**, not only to the ranks:
Megatron's checkpoint writer pool, multiprocessing's resource tracker and managers, data-loader
workers all get it too, and SIGUSR2's default action kills them (a save then fails with a broken
pipe). So the stop signal is *blocked*, not handled: a blocked signal stays blocked across fork and
exec, so every child the trainer starts inherits the mask and never acts on it, whoever starts the
child and however. The trainer itself receives it in one thread that waits for it (`sigwait`) and
records the fact; the training loop acts on it at the next step boundary.

`megalaunch.runtime.task` blocks the signal before it starts the trainer, so there is no window at
start-up in which the signal could kill a rank either."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

SIGNAL_NAMES = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT")


def resolve_signal(name: str) -> signal.Signals:
    norm = name.upper()
    if not norm.startswith("SIG"):
        norm = "SIG" + norm
    if norm not in SIGNAL_NAMES:
        raise ValueError(f"unsupported stop signal {name!r}; valid: {', '.join(SIGNAL_NAMES)}")
    return signal.Signals[norm]


def block(sig: signal.Signals) -> None:
    """Block `sig` in the calling thread; threads and processes started afterwards inherit it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})


class SignalFlag:
    """Records that the stop signal arrived, without letting it reach any child process.

    Create it in the main thread before any other thread exists (the mask is per thread and
    inherited at creation). A Python handler stays installed as well, for a thread that some
    library created earlier with the signal unblocked: the signal is then recorded, never fatal."""

    def __init__(self, sig: signal.Signals = signal.SIGUSR2) -> None:
        self.sig = sig
        self._event = threading.Event()
        self._closing = False
        self._previous = signal.signal(sig, self._handle)
        block(sig)
        self._waiter = threading.Thread(target=self._wait, name=f"megalaunch-{sig.name}", daemon=True)
        self._waiter.start()

    received_at: float | None = None  # when it first arrived (time.time())

    def _set(self) -> None:
        if self.received_at is None:
            self.received_at = time.time()
        self._event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._set()

    def _wait(self) -> None:
        while not self._closing:
            signal.sigwait({self.sig})
            if not self._closing:
                self._set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the signal has arrived (waits up to `timeout` seconds)."""
        return self._event.wait(timeout)

    @property
    def received(self) -> bool:
        return self._event.is_set()

    def restore(self) -> None:
        """Stop waiting, unblock the signal in this thread and put the previous handler back."""
        self._closing = True
        if self._waiter.ident is not None and self._waiter.is_alive():
            signal.pthread_kill(self._waiter.ident, self.sig)
            self._waiter.join(timeout=5)
        signal.signal(self.sig, self._previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.sig})
