"""The hang watcher outside Python (runtime/hangwatch.py): its decision (a stale heartbeat fires, a beat
resets the clock, the first iteration switches to the hang limit, Slurm not answering is unknown, a
suspended job pauses the clock), and the whole watch -> stacks -> outcome -> kill sequence over real
files and real processes, faked only at the subprocess boundary (squeue/scancel)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.hangwatch import HangWatch, Limits, SlurmStep, watch
from megalaunch.runtime.health.heartbeat import Heartbeat
from megalaunch.runtime.health.watchdog import backstop_after_s

LIMITS = Limits(startup_s=20.0, hang_s=100.0)


def beat(phase: str, iteration: int | None = None, seq: int = 1) -> bytes:
    return f'{{"phase": "{phase}", "iteration": {iteration or "null"}, "seq": {seq}, "step_id": "0"}}'.encode()


def test_stale_heartbeat_fires_after_the_startup_limit_and_says_where_it_is_stuck() -> None:
    hw = HangWatch(LIMITS, last_change=0.0)
    hw.observe(5.0, beat("setup_done"))
    assert hw.decide(24.9, "RUNNING") == "ok"
    hw.observe(25.0, beat("setup_done"))  # the same content again is no sign of life
    assert hw.decide(25.0, "RUNNING") == "fire"
    assert hw.step_id == "0"
    reason = hw.reason(25.0)
    assert "startup_timeout_s limit 20 s" in reason and "rendezvous" in reason and "setup_done" in reason


def test_the_step_start_counts_as_a_beat_when_no_heartbeat_was_ever_written() -> None:
    hw = HangWatch(LIMITS, last_change=100.0)
    hw.observe(119.0, None)
    assert hw.decide(119.0, "RUNNING") == "ok"
    assert hw.decide(120.0, "RUNNING") == "fire" and "srun starting the tasks" in hw.reason(120.0)


def test_beats_reset_the_clock_and_the_first_iteration_switches_to_the_hang_limit() -> None:
    hw = HangWatch(LIMITS, last_change=0.0)
    for t, content in ((15.0, beat("setup_done")), (30.0, beat("load_start")), (45.0, beat("data_end"))):
        hw.observe(t, content)
        assert hw.decide(t + 19.0, "RUNNING") == "ok"
    hw.observe(60.0, beat("first_iteration_end", 1))
    assert hw.limit_s == 100.0
    assert hw.decide(159.0, "RUNNING") == "ok"
    hw.observe(159.0, beat("iteration", 40, seq=2))
    assert hw.decide(258.0, "RUNNING") == "ok" and hw.decide(259.0, "RUNNING") == "fire"
    assert "hang_timeout_s" in hw.reason(259.0) and "iteration 40" in hw.reason(259.0)


def test_slurm_not_answering_is_unknown_not_a_hang() -> None:
    hw = HangWatch(LIMITS, last_change=0.0)
    assert hw.decide(20.0, None) == "unknown"
    assert hw.decide(39.0, None) == "unknown"
    assert hw.decide(39.0, "RUNNING") == "fire"  # once Slurm answers, the heartbeat decides
    # silent for twice the limit: the heartbeat alone is evidence enough
    assert hw.decide(40.0, None) == "fire"


def test_an_unreadable_heartbeat_is_unknown_and_a_suspended_job_pauses_the_clock() -> None:
    hw = HangWatch(LIMITS, last_change=0.0)
    hw.observe(21.0, PermissionError(13, "Permission denied"))
    assert hw.decide(21.0, "RUNNING") == "unknown"
    hw.observe(22.0, None)  # readable again (still silent)
    assert hw.decide(22.0, "RUNNING") == "fire"
    hw = HangWatch(LIMITS, last_change=0.0)
    assert hw.decide(30.0, "SUSPENDED") == "paused"
    hw.resume_clock(30.0)
    assert hw.decide(49.0, "RUNNING") == "ok"


def test_the_outer_hang_limit_leaves_the_in_python_watchdog_its_chance() -> None:
    limits = Limits.for_settings(1800, 300)
    assert limits.startup_s == 1800 and limits.hang_s > backstop_after_s(300) > 300


class FakeSlurm:
    """squeue/scancel at the subprocess boundary: `answer` False plays a slurmctld that does not answer."""

    def __init__(self, *, answer: bool) -> None:
        self.answer = answer
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        if not self.answer:
            raise subprocess.TimeoutExpired(argv, kw.get("timeout", 0))
        out = "RUNNING\n" if argv[0] == "squeue" and "--steps" not in argv else ""
        return subprocess.CompletedProcess(argv, 0, out, "")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        time.sleep(0.001)


def _paths(tmp_path: Path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.state.mkdir(parents=True)
    return paths


def test_a_stale_step_gets_stacks_asked_then_killed_through_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _paths(tmp_path)
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "42")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    Heartbeat(paths, "42", enabled=True).beat("setup_done")  # rank 0 reached the rendezvous, no more
    slurm, clock = FakeSlurm(answer=True), FakeClock()
    started = clock()
    how = watch(paths, "42", LIMITS, SlurmStep("42", os.getpid(), run=slurm), clock=clock, sleep=clock.sleep)
    assert "scancel --signal=KILL" in how
    assert LIMITS.startup_s <= clock() - started <= LIMITS.startup_s + 2 * 2.0 + 5.0  # 2 s checks, 5 s for stacks
    scancels = [c for c in slurm.calls if c[0] == "scancel"]
    assert scancels == [["scancel", "--signal=URG", "42.0"], ["scancel", "--signal=KILL", "42.0"]]
    outcome = read_json(paths.outcome)
    assert outcome["status"] == "hung" and outcome["job_id"] == "42" and outcome["by"] == "hang watcher"
    assert "rendezvous" in outcome["reason"] and "no stacks could be gathered" in outcome["reason"]
    assert [e["event"] for e in map(__import__("json").loads, paths.ledger.read_text().splitlines())] == ["hang_limit", "hang_killed"]


def test_an_outcome_the_trainer_wrote_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megalaunch.rundir.state import write_outcome

    paths = _paths(tmp_path)
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "42")
    write_outcome(paths, "hung", reason="the in-Python watchdog fired on rank 3")
    clock = FakeClock()
    watch(paths, "42", LIMITS, SlurmStep("42", os.getpid(), run=FakeSlurm(answer=True)), clock=clock, sleep=clock.sleep)
    assert read_json(paths.outcome)["reason"] == "the in-Python watchdog fired on rank 3"


def test_slurm_not_answering_delays_the_kill_then_the_local_srun_ends_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No slurmctld at all: no fire at the limit (unknown); at twice the limit the heartbeat alone
    decides and the job script's srun (here a real process named srun, our child) gets two SIGINTs."""
    paths = _paths(tmp_path)
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "42")
    srun = tmp_path / "srun"
    srun.symlink_to(sys.executable)
    proc = subprocess.Popen([str(srun), "-c", "import time; time.sleep(120)"])
    try:
        slurm, clock = FakeSlurm(answer=False), FakeClock()
        started = clock()
        how = watch(paths, "42", LIMITS, SlurmStep("42", os.getpid(), run=slurm), clock=clock, sleep=clock.sleep)
        assert 2 * LIMITS.startup_s <= clock() - started < 2 * LIMITS.startup_s + 60
        assert how == "srun ended the step (two SIGINTs)"
        assert proc.wait(timeout=10) != 0
        assert read_json(paths.outcome)["status"] == "hung"
        assert any(c[0] == "squeue" for c in slurm.calls)
    finally:
        proc.kill()
        proc.wait()
