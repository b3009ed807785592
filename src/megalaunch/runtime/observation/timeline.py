"""Where a segment's time goes, as it happens: rank 0 keeps RUN/state/timeline/<job>.json up to date
with the moment each phase was reached (docs/goodput.md), so a segment killed at any point still
leaves its timeline up to the last phase it reached. launcher/accounting/goodput.py turns timelines, the ledger
and the metrics into goodput. Standard library only.

Phases, in the order a segment reaches them (absolute times, seconds since the epoch):
  process_start      the trainer's process was created (/proc: includes the interpreter's start-up)
  runtime_start      megalaunch's entry runs (standard library imported)
  setup_done         torch imported, seams installed, W&B opened: Megatron starts
  model_build_start  Megatron initialised (rendezvous, NCCL/gloo, parallel groups): the model is built
  model_build_end
  load_start         checkpoint chosen and loading (also when starting from scratch)
  load_end
  data_start         the datasets are built (index building, blend)
  data_end
  first_iteration_end
  last_iteration_end (updated every iteration; written every log interval and at exit)
  signal_received    the stop signal arrived (and `decision`: when a stop was acted on)
  exit               the outcome is written
plus `saves`: [iteration, begin, end] of every blocking save (from the decision to save, space check
and retention included; one the segment leaves with, a stop or final save, ends when its checkpoint is
complete, also when asynchronous) and of every wait for an asynchronous save to complete (`save_waited`:
one more interval for that checkpoint, or its own grown when nothing ran since); and `writes`:
[iteration, begin, complete] of every checkpoint, until it was complete on disk (the same as its save
when synchronous; an asynchronous one's write goes on after its blocking part): the chain's measure
for the signal lead.

Detail phases split the start-up further (reported by bench/goodput.py; the goodput cuts above do not
use them): torch_imported, megatron_imported (inside `imports`); distributed_ready (process groups
made, inside `init`), health_check_start/health_check_end (runtime/health/health.py; its figures in
`health_check`; goodput counts it apart) and first_collective (the first NCCL collective: communicators created)."""

from __future__ import annotations

import os
import time
from typing import Any

from megalaunch.rundir.files import atomic_write_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.health.heartbeat import Heartbeat

# Start-up, in order: each component ends at its phase (`launch` begins at `job begin`). The goodput
# accounting (launcher/accounting/goodput.py) and the trainer's W&B summary (runtime/observation/wandb_run.py) both cut here.
STARTUP_PHASES = (("launch", "process_start"), ("imports", "setup_done"), ("init", "model_build_start"),
                  ("model_build", "load_start"), ("checkpoint_load", "load_end"), ("data_setup", "data_end"))


def process_start_time(pid: int | None = None) -> float | None:
    """When process `pid` (default: this one) was created, from /proc; None where there is no /proc."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22 of stat, 20th after the command name
        with open("/proc/uptime") as f:  # seconds since boot, to 10 ms (btime in /proc/stat: whole seconds)
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """Rank 0's record of one segment (the other ranks keep one in memory and never write it)."""

    def __init__(self, paths: RunPaths, job_id: str | None, *, write: bool) -> None:
        self.path = paths.timeline(job_id or f"pid{os.getpid()}")
        self.write_enabled = write
        self.data: dict[str, Any] = {"job_id": job_id, "host": os.uname().nodename, "phases": {}, "saves": [],
                                     "writes": [], "iterations": {}}
        self._last_write = 0.0
        self.heartbeat = Heartbeat(paths, job_id, enabled=write)  # every phase and save is a sign of life
        self._writing: set[int] = set()  # saves begun whose checkpoint is not complete yet
        self.hang: Any = None  # the watchdog's HangLimit (runtime/health/hang_limit.py), from the observer
        start = process_start_time()
        if start is not None:
            self.data["phases"]["process_start"] = start

    def mark(self, phase: str, when: float | None = None, *, again: bool = False, **extra: Any) -> None:
        """Record `phase` (the first time only, unless `again`) and write the file."""
        phases = self.data["phases"]
        if phase in phases and not again:
            return
        phases[phase] = time.time() if when is None else when
        self.data.update(extra)
        self.flush()
        self.beat(phase)

    def beat(self, phase: str, *, iteration: int | None = None, force: bool = True) -> None:
        """Rank 0's heartbeat; `writing` tells the hang watcher (runtime/health/hang_limit.BeatPhases) that a
        checkpoint is still being written, an asynchronous one behind iterations: the save's limit holds;
        `hang_limits`: the watchdog's measured limits, which the watcher stays after."""
        limits = self.hang.published() if self.hang is not None else None
        self.heartbeat.beat(phase, iteration=iteration, force=force, writing=bool(self._writing),
                            **({"hang_limits": limits} if limits else {}))

    def iteration(self, iteration: int, *, flush: bool) -> None:
        """Every iteration (cheap): the first and the latest, and how far training got."""
        now = time.time()
        phases = self.data["phases"]
        if "first_iteration_end" not in phases:
            phases["first_iteration_end"] = now
            self.data["iterations"]["first"] = iteration
            flush = True
        phases["last_iteration_end"] = now
        self.data["iterations"]["last"] = iteration
        if flush:
            self.flush()
        self.beat("iteration", iteration=iteration, force=False)

    def save_started(self, iteration: int) -> None:
        """A blocking save begins (it may take minutes: the watcher knows it is alive)."""
        self._writing.add(iteration)
        self.beat("save_start", iteration=iteration)

    def save(self, iteration: int, begin: float, end: float) -> None:
        self.data["saves"].append([iteration, begin, end])
        self.flush()
        self.beat("save_end", iteration=iteration)

    def save_waited(self, iteration: int, begin: float, end: float) -> None:
        """The segment waited for the checkpoint of `iteration` (an asynchronous save) to be complete:
        save time. Right after that save (no iteration since) its interval grows to the wait's end, so
        it runs from the decision to the complete checkpoint; later (before a stop save, at the loop's
        end) the wait is an interval of its own for the same checkpoint."""
        saves = self.data["saves"]
        if saves and saves[-1][0] == iteration and saves[-1][2] >= self.data["phases"].get("last_iteration_end", 0.0):
            saves[-1][2] = max(saves[-1][2], end)
        else:
            saves.append([iteration, begin, end])
        self._writing.discard(iteration)
        self.flush()
        self.beat("save_end", iteration=iteration)

    def write(self, iteration: int, begin: float, complete: float) -> None:
        self.data["writes"].append([iteration, begin, complete])
        self._writing.discard(iteration)
        self.flush()
        self.beat("save_written", iteration=iteration)

    def evaluation(self, what: str) -> None:
        """Megatron's evaluation during training: "started", "batch" (every eval batch, written at most every
        few seconds) and "done"; the hang watcher gives it the evaluation's limit."""
        phase = {"started": "eval_start", "done": "eval_end"}.get(what, "eval")
        self.beat(phase, iteration=self.data["iterations"].get("last"), force=phase != "eval")

    def flush(self) -> None:
        if not self.write_enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, self.data)
        except OSError:
            pass  # accounting must never take training down
