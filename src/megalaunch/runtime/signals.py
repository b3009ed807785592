"""The stop-signal flag. Slurm's `--signal=USR2@LEAD` reaches every srun task; the handler only
records the fact, and the training loop acts on it at the next step boundary."""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNAL_NAMES = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT")


def resolve_signal(name: str) -> signal.Signals:
    norm = name.upper()
    if not norm.startswith("SIG"):
        norm = "SIG" + norm
    if norm not in SIGNAL_NAMES:
        raise ValueError(f"unsupported stop signal {name!r}; valid: {', '.join(SIGNAL_NAMES)}")
    return signal.Signals[norm]


class SignalFlag:
    """Records that a signal arrived. Install it as early as possible: before the handler is in
    place the default action of SIGUSR2 would kill the process."""

    def __init__(self, sig: signal.Signals = signal.SIGUSR2) -> None:
        self.sig = sig
        self._event = threading.Event()
        self._previous = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._event.set()

    @property
    def received(self) -> bool:
        return self._event.is_set()

    def restore(self) -> None:
        signal.signal(self.sig, self._previous)
