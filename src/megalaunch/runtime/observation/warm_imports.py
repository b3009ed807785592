"""Start-up: the torch and Megatron modules a segment imports after its health check, imported during it.

Why: after torch.distributed is up, Megatron imports torch subsystems on first use (Dynamo, the
distributed checkpoint, DTensor, Inductor's decompositions, ~140 custom-op registrations), ~2 s of
Python on a resumed segment's critical path (docs/results.md, issue #35), while the health check leaves
the interpreter idle waiting on the GPU for ~1.6 s. So:

- every segment's rank 0 records, in the run's state directory, the `torch.*` and `megatron.*` modules
  that were imported between `distributed_ready` and the end of its first iteration, in import order
  (merged with the names already recorded);
- a later segment imports that list on a thread while its health check's GPU works through a queue of
  matmuls (runtime/health/health.py measure_matmul; on the CPU, during the whole check). The main thread
  imports nothing meanwhile; when the check ends it tells the thread to stop between two modules and
  joins it, so no import of the thread ever runs beside Megatron's own (two threads importing modules
  that import each other could see a half-initialised module). The imports hold the GIL for tens of ms
  at a time (torch's C++ op registrations): a check timed on the host would wait for them, which is why
  the GPU's work is queued first and timed with CUDA events.

Best effort: a module that fails to import is skipped (Megatron imports it later and reports it then); a
missing or unreadable list is no list. Only names of the two packages are imported, whatever the file
says (the run directory is the owner's, but a module list is code to run). MEGALAUNCH_WARM_IMPORTS=0 turns it
off (for measuring what it saves: bench/storage_chain.py)."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import atomic_write_json

FILE_NAME = "startup-modules.json"
OFF_ENV = "MEGALAUNCH_WARM_IMPORTS"
_NAME = re.compile(r"(torch|megatron)(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_MODULES = 5000


def modules_file(state_dir: Path) -> Path:
    return state_dir / FILE_NAME


def recorded(state_dir: Path) -> list[str]:
    """The recorded names, valid ones only; [] when there is no readable list (or it is turned off)."""
    if os.environ.get(OFF_ENV, "1") == "0":
        return []
    try:
        data = json.loads(modules_file(state_dir).read_text())
    except (OSError, ValueError):
        return []
    names = data.get("modules") if isinstance(data, dict) else None
    if not isinstance(names, list):
        return []
    return [n for n in names[:MAX_MODULES] if isinstance(n, str) and _NAME.fullmatch(n)]


def imported_since(before: set[str]) -> list[str]:
    """torch/megatron modules in sys.modules now that were not in `before`, in import order."""
    return [n for n in list(sys.modules) if n not in before and _NAME.fullmatch(n)]


def record(state_dir: Path, new: list[str]) -> bool:
    """Merge `new` into the recorded list (kept order, new names after); True if the file changed."""
    have = recorded(state_dir)
    known = set(have)
    added = [n for n in new if n not in known]
    if not added:
        return False
    atomic_write_json(modules_file(state_dir), {"modules": (have + added)[:MAX_MODULES]})
    return True


class WarmImports:
    """Imports `names` on a daemon thread until stop(); the figures for the timeline."""

    def __init__(self, names: list[str]) -> None:
        self.names = [n for n in names if n not in sys.modules]
        self.done = 0
        self.failed = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megalaunch-warm-imports", daemon=True)

    def start(self) -> WarmImports:
        """Start importing (once: later calls do nothing)."""
        if self.names and self._thread.ident is None and not self._stop.is_set():
            self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        for name in self.names:
            if self._stop.is_set():
                break
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # Megatron imports it later and says why
                    self.failed += 1
            self.done += 1
        self.seconds = time.perf_counter() - t0

    def stop(self) -> dict[str, Any]:
        """Stop between two modules, wait for the one under way; the figures."""
        self._stop.set()
        waited = time.perf_counter()
        if self._thread.ident is not None:  # started
            self._thread.join()
        return {"modules": len(self.names), "imported": self.done - self.failed, "failed": self.failed,
                "seconds": round(self.seconds, 3), "waited_s": round(time.perf_counter() - waited, 3)}
