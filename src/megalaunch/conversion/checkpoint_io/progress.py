"""A byte-counting progress bar on stderr (tqdm; quiet and sparse when stderr is not a terminal,
e.g. in a Slurm log)."""

from __future__ import annotations

import sys
import threading
from typing import Any


class Progress:
    def __init__(self, total_bytes: int, desc: str, enabled: bool = True) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()  # updated from hf-to-mcore's writer threads
        if enabled:
            from tqdm import tqdm

            tty = sys.stderr.isatty()
            self._bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, mininterval=0.2 if tty else 30.0, dynamic_ncols=True,
                             leave=True)

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
