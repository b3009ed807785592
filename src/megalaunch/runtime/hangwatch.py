"""The hang killer outside Python: `megalaunch job watch RUN --shell-pid PID`, started in the background
by the job script just before `srun` and stopped when it returns. Standard library only.

It watches rank 0's heartbeat (runtime/health/heartbeat.py). Two limits:
- before the first iteration, `chain.startup_timeout_s` without a sign of life: the step's start, the
  trainer's start, imports, rendezvous, NCCL init, model build, checkpoint load, data;
- after it, `chain.hang_timeout_s` plus the time the in-Python watchdog (runtime/health/watchdog.py) needs to
  dump its stacks and end the ranks itself, so that one always gets its chance first.

On a hang it asks every process of the step for its Python stacks (`scancel --signal=URG JOB.STEP`:
ignored by default, faulthandler's handler in the trainer), waits STACKS_WAIT_S, writes outcome `hung`
(unless the segment already has an outcome) and kills the step (`scancel --signal=KILL JOB.STEP`: the
step only, so the job script goes on to `job end`, the chain continues and the allocation is
released). If Slurm does not answer, it retries, then makes the local `srun` end the step (two SIGINTs
within a second), then kills `srun`.

"Slurm did not answer" is never evidence: the watcher fires only on a stale heartbeat, and only while
Slurm says the job RUNNING (a suspended job makes no progress). When Slurm does not answer, or the
heartbeat cannot be read, it waits: it fires on that evidence alone only once the heartbeat has been
silent for twice the limit."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import append_jsonl, atomic_write_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import read_outcome, write_outcome
from megalaunch.runtime.health.hang_limit import (
    AUTO,
    EVAL,
    PHASES,
    SAVE,
    TRAIN,
    BeatPhases,
    HangLimit,
    configured_s,
    is_auto,
    measured_startups,
    startup_limit,
)
from megalaunch.runtime.health.heartbeat import TRAINING_PHASES
from megalaunch.runtime.health.node_beat import StepSilence
from megalaunch.runtime.health.node_loss import StepNodes, end_lost_step, ended_lines, silent_lines
from megalaunch.runtime.health.slurm_step import SlurmStep, alive, kill_step, log
from megalaunch.runtime.health.watchdog import backstop_after_s

OUTER_MARGIN_S = 30.0  # after the in-Python watchdog's backstop: it had its chance
STACKS_WAIT_S = 5.0  # for faulthandler to write every rank's stacks

# what a segment does after each phase: a hang "after setup_done" is stuck in the rendezvous
NEXT = {"step_start": "srun starting the tasks", "task_start": "the trainer's start",
        "runtime_start": "importing torch", "torch_imported": "importing Megatron",
        "megatron_imported": "setting up (W&B)", "setup_done": "the rendezvous and process groups (NCCL/gloo)",
        "model_build_start": "building the model", "model_build_end": "choosing the checkpoint",
        "load_start": "loading the checkpoint", "load_end": "building the datasets",
        "data_start": "building the datasets", "data_end": "the first iteration",
        "first_iteration_end": "an iteration", "iteration": "an iteration", "save_start": "a checkpoint save",
        "save_end": "an iteration", "save_written": "an iteration", "eval_start": "an evaluation",
        "eval": "an evaluation", "eval_end": "an iteration"}

def outer_s(inner_s: float) -> float:
    """The watcher's limit for an in-Python limit: after the watchdog has surely acted."""
    return backstop_after_s(inner_s) + OUTER_MARGIN_S


@dataclass(frozen=True)
class Limits:
    startup_s: float
    hang_s: float  # explicit; with `auto`, until the step is measured (runtime/health/hang_limit.py)
    auto: bool = False
    save_estimate_s: float = 60.0
    startup_why: str = "chain.startup_timeout_s"

    @classmethod
    def for_settings(cls, startup_timeout_s: float | str | None, hang_timeout_s: float | str | None, *,
                     save_estimate_s: float = 60.0, startups: list[float] | None = None) -> Limits:
        """`startups`: the earlier segments' measured start-ups (hang_limit.measured_startups), for `auto`."""
        startup, why = startup_limit(startup_timeout_s, startups or [])
        return cls(startup, outer_s(configured_s(hang_timeout_s)), is_auto(hang_timeout_s), save_estimate_s, why)

    @classmethod
    def for_run(cls, paths: RunPaths, job_id: str) -> Limits:
        """From the run's runtime.json and its earlier segments' timelines."""
        from megalaunch.runtime.rank.settings import RuntimeSettings

        s = RuntimeSettings.load(paths)
        return cls.for_settings(s.startup_timeout_s, s.hang_timeout_s, save_estimate_s=s.save_time_estimate_s,
                                startups=measured_startups(paths.timeline(job_id).parent, job_id))


@dataclass
class HangWatch:
    """The decision, fed with what was observed: no I/O of its own (tests drive it with a fake clock)."""

    limits: Limits
    last_change: float  # when the heartbeat last changed (the watcher's monotonic clock); start = a beat
    phase: str = "step_start"
    iteration: int | None = None
    step_id: str | None = None
    training: bool = False
    unreadable: str | None = None  # why the heartbeat could not be read (unknown, not stale)
    _seen: bytes | None = field(default=None, repr=False)
    hang: HangLimit | None = field(default=None, repr=False)  # auto: the in-Python limit, measured here too
    beats: BeatPhases = field(default_factory=BeatPhases, repr=False)  # a save, an evaluation, or training
    _told: tuple[float, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.limits.auto and self.hang is None:
            self.hang = HangLimit(AUTO, self.limits.save_estimate_s)

    def observe(self, now: float, content: bytes | OSError | None) -> None:
        """The heartbeat file's bytes (None: not written yet; an OSError: could not be read)."""
        if isinstance(content, OSError):
            self.unreadable = str(content)
            return
        self.unreadable = None
        if content is None or content == self._seen:
            return
        self._seen, self.last_change = content, now
        data = _json(content)
        self.phase = str(data.get("phase") or self.phase)
        self.iteration = data["iteration"] if isinstance(data.get("iteration"), int) else self.iteration
        self.step_id = str(data["step_id"]) if data.get("step_id") not in (None, "") else self.step_id
        self.training = self.training or self.phase in TRAINING_PHASES
        self.beats.observe(self.hang, now, self.phase, data, self.iteration)

    def phase_s(self, kind: str) -> float:
        """The watcher's limit in phase `kind`: after the in-Python watchdog's for that phase."""
        return outer_s(self.hang.for_phase(kind)) if self.hang is not None and self.hang.measured else self.limits.hang_s

    @property
    def hang_s(self) -> float:
        return self.phase_s(self.beats.kind)

    @property
    def limit_s(self) -> float:
        return self.hang_s if self.training else self.limits.startup_s

    def limit_change(self) -> dict[str, Any] | None:
        """The effective limits, when they changed since the last call (the first call: always)."""
        now = (self.limits.startup_s, *(self.phase_s(k) for k in PHASES))
        if now == self._told:
            return None
        self._told = now
        inner = self.hang.record() if self.hang is not None else {"hang_s": None, "why": "chain.hang_timeout_s"}
        return {"startup_s": self.limits.startup_s, "startup_why": self.limits.startup_why,
                "in_python_s": inner.pop("hang_s"), "in_python_save_s": inner.pop("save_hang_s", None),
                "in_python_eval_s": inner.pop("eval_hang_s", None), "hang_s": round(self.phase_s(TRAIN), 3),
                "save_hang_s": round(self.phase_s(SAVE), 3), "eval_hang_s": round(self.phase_s(EVAL), 3),
                "hang_why": inner.pop("why"), **inner}

    def idle_s(self, now: float) -> float:
        return now - self.last_change

    def decide(self, now: float, job_state: str | None) -> str:
        """'ok', 'fire', 'unknown' (stale, but Slurm did not answer or the heartbeat could not be read:
        wait) or 'paused' (Slurm says the job is not running: suspended, completing)."""
        idle = self.idle_s(now)
        if idle < self.limit_s:
            return "ok"
        if job_state is not None and job_state != "RUNNING":
            return "paused"
        if job_state is None or self.unreadable is not None:
            return "fire" if idle >= 2 * self.limit_s else "unknown"
        return "fire"

    def resume_clock(self, now: float) -> None:
        """Time the job spent not running (suspended) is not time without progress."""
        self.last_change = now

    def reason(self, now: float) -> str:
        which = "hang_timeout_s" if self.training else "startup_timeout_s"
        if self.training and self.hang is not None and self.hang.measured:
            which += f" {self.hang.describe(self.beats.kind)}:"
        elif not self.training and self.limits.startup_why != "chain.startup_timeout_s":
            which += f" {self.limits.startup_why}:"
        at = f" at iteration {self.iteration}" if self.training and self.iteration is not None else ""
        return (f"no sign of life for {self.idle_s(now):.0f} s ({which} limit {self.limit_s:g} s): stuck in "
                f"{NEXT.get(self.phase, 'what follows ' + self.phase)} (last phase: {self.phase}{at})")


def record_limits(paths: RunPaths, job_id: str, change: dict[str, Any]) -> None:
    """The effective limits: a `hang_limit` ledger line and RUN/state/hang_limit/<job>.json (status reads it)."""
    record = {"time": time.time(), "job_id": job_id, **change}
    try:
        append_jsonl(paths.ledger, {"event": "hang_limit", **record})
        paths.hang_limit(job_id).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(paths.hang_limit(job_id), record)
    except OSError as e:
        log(f"could not record the hang limits: {e}")
    log(f"limits: start-up {change['startup_s']:g} s ({change['startup_why']}), then {change['hang_s']:g} s "
        f"({change['hang_why']})")


def _json(content: bytes) -> dict[str, Any]:
    import json

    try:
        data = json.loads(content)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def read_beat(path: Path) -> bytes | OSError | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return e


def record_hang(paths: RunPaths, job_id: str, reason: str, watch: HangWatch) -> None:
    """Outcome `hung` (unless the segment has its own outcome) and a ledger line naming the stacks."""
    stacks = sorted(str(p) for p in paths.debug.glob(f"stacks*-job{job_id}-rank*.txt") if _non_empty(p))
    full = reason + (f"; stacks: {paths.debug}/stacks*-job{job_id}-*.txt" if stacks else "; no stacks could be gathered")
    try:
        if read_outcome(paths, job_id) is None:
            write_outcome(paths, "hung", iteration=watch.iteration, reason=full, job_id=job_id, by="hang watcher",
                          phase=watch.phase, stacks=stacks)
        append_jsonl(paths.ledger, {"event": "hang_killed", "time": time.time(), "job_id": job_id, "reason": reason,
                                    "phase": watch.phase, "iteration": watch.iteration, "stacks": stacks})
    except OSError as e:
        log(f"could not record the hang: {e}")


def _non_empty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def watch(paths: RunPaths, job_id: str, limits: Limits, step: SlurmStep, *,
          check_s: float | None = None, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep, loss: StepNodes | None = None,
          silence: StepSilence | None = None) -> str:
    """Watch until the heartbeat goes stale, then gather stacks, record and kill; or until a node of the step
    is lost (its ranks alone did not end: runtime/health/node_loss.py; it stopped beating while the others
    beat: runtime/health/node_beat.py), then end the step. Returns what it did."""
    check_s = check_s or max(1.0, min(10.0, limits.startup_s / 10, limits.hang_s / 10))
    beat_file = paths.heartbeat(job_id)
    hw = HangWatch(limits, clock())
    nodes = StepNodes.from_env(paths.tasks(job_id), paths.segment_log(job_id)) if loss is None else loss
    quiet = StepSilence.from_env(paths.root, job_id) if silence is None else silence
    told_unknown = False  # said once per silent spell that the evidence is unknown
    while True:
        sleep(min(check_s, 1.0) if nodes is not None or quiet is not None else check_s)
        if step.shell_pid and not alive(step.shell_pid):
            return "the job script is gone"
        now = clock()
        if nodes is not None and (lost := nodes.check(now)):
            return end_lost_step(paths, job_id, ended_lines(lost, nodes.decision.grace_s), hw.step_id, step, sleep)
        if quiet is not None and (lost := quiet.check(now)):
            return end_lost_step(paths, job_id, silent_lines(lost, quiet.decision, now), hw.step_id, step, sleep)
        hw.observe(now, read_beat(beat_file))
        if (change := hw.limit_change()) is not None:
            record_limits(paths, job_id, change)
        if hw.idle_s(now) < hw.limit_s:
            told_unknown = False
            continue
        verdict = hw.decide(now, step.job_state())
        if verdict == "paused":
            hw.resume_clock(now)
            continue
        if verdict == "unknown":
            if not told_unknown:
                log(f"heartbeat silent for {hw.idle_s(now):.0f} s, but "
                    + (f"it could not be read ({hw.unreadable})" if hw.unreadable else "Slurm did not answer")
                    + f": unknown, not a hang; waiting (at most until {2 * hw.limit_s:g} s of silence)")
                told_unknown = True
            continue
        return _fire(paths, job_id, hw, step, clock, sleep)


def _fire(paths: RunPaths, job_id: str, hw: HangWatch, step: SlurmStep,
          clock: Callable[[], float], sleep: Callable[[float], None]) -> str:
    reason = hw.reason(clock())
    log(f"HUNG: {reason}; asking every task for its stacks, then killing the step")
    step_ids = [f"{job_id}.{hw.step_id}"] if hw.step_id else step.step_ids()
    for s in step_ids:
        step.signal("URG", s)  # faulthandler in each trainer: every thread's stack under RUN/debug/
    sleep(STACKS_WAIT_S)
    record_hang(paths, job_id, reason, hw)
    how = kill_step(step, step_ids, sleep)
    log(f"{how}; outcome hung; the job script goes on to `job end`")
    return how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megalaunch job watch", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--shell-pid", type=int, required=True, help="the job script's pid (srun's parent)")
    opts = parser.parse_args(argv)
    job_id = os.environ.get("MEGALAUNCH_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        parser.error("no SLURM_JOB_ID in the environment: the job script runs this")
    paths = RunPaths(Path(opts.run_dir).absolute())
    limits = Limits.for_run(paths, job_id)
    log(f"watching {paths.heartbeat(job_id)}: startup limit {limits.startup_s:g} s, then {limits.hang_s:g} s")
    watch(paths, job_id, limits, SlurmStep(job_id, opts.shell_pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
