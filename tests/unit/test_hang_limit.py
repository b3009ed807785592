"""The hang limits that follow the measured step (runtime/health/hang_limit.py): the arithmetic, the measure
from beats, the watcher's decision with an auto limit on a fake clock, what is recorded, and explicit values
that behave exactly as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.hangwatch import HangWatch, Limits, outer_s, record_limits
from megalaunch.runtime.health import hang_limit as hl
from megalaunch.runtime.health.watchdog import Watchdog, backstop_after_s


def beat(phase: str, iteration: int | None = None, seq: int = 1) -> bytes:
    return json.dumps({"phase": phase, "iteration": iteration, "seq": seq, "step_id": "0"}).encode()


def test_the_limit_arithmetic() -> None:
    assert hl.hang_limit_s(1.0, 60.0) == 120.0  # the floor
    assert hl.hang_limit_s(20.0, 60.0) == 260.0  # 10 x 20 + 60
    assert hl.save_allowance_s(None, 60.0) == 60.0  # no save seen: the estimate
    assert hl.save_allowance_s(10.0, 60.0) == 60.0  # a fast save does not shrink the estimate
    assert hl.save_allowance_s(45.0, 60.0) == 90.0  # a slow one: twice the longest
    assert hl.startup_limit("auto", []) == (1800.0, "auto: no start-up measured yet, 1800 s")
    assert hl.startup_limit("auto", [40.0, 90.0])[0] == 300.0  # 3 x 90 < the floor
    assert hl.startup_limit("auto", [40.0, 200.0])[0] == 600.0
    assert hl.startup_limit(45.0, [200.0]) == (45.0, "chain.startup_timeout_s")  # explicit wins
    assert hl.configured_s("auto") == 1800.0 and hl.configured_s(20) == 20.0


def test_the_step_is_measured_after_the_first_iteration_and_saves_break_the_measure() -> None:
    p = hl.Progress()
    p.iteration(100.0, 1)  # the first: compilation, only starts the measure
    p.iteration(101.0, 2)
    p.iteration(102.0, 3)
    assert p.step_s is None  # 2 measured, 3 needed
    p.save_started(102.5)
    p.save_ended(132.5)
    p.iteration(140.0, 4)  # after a save: starts the measure again, 7.5 s is not a step
    p.iteration(150.0, 14)  # a heartbeat every 5 s or more: 10 iterations in 10 s
    assert p.step_s == 1.0 and p.longest_save_s == 30.0


def test_an_auto_limit_follows_the_step_and_fires_on_a_fake_clock(tmp_path: Path) -> None:
    limits = Limits.for_settings("auto", "auto", save_estimate_s=20.0)
    assert limits.hang_s == outer_s(1800.0) and limits.startup_s == 1800.0
    hw = HangWatch(limits, last_change=0.0)
    hw.observe(50.0, beat("iteration", 5))
    assert hw.hang_s == outer_s(1800.0)  # not measured yet
    for i, t in enumerate((55.0, 60.0, 65.0), start=2):
        hw.observe(t, beat("iteration", 5 * i, seq=i))  # 5 iterations per 5 s: 1 s steps
    assert hw.hang is not None and hw.hang.value == 120.0  # max(10 x 1 + 20, 120)
    kill_at = 65.0 + outer_s(120.0)
    assert hw.limit_s == outer_s(120.0) < 400  # the watcher acts after the in-Python watchdog's backstop
    assert hw.decide(kill_at - 0.1, "RUNNING") == "ok" and hw.decide(kill_at, "RUNNING") == "fire"
    assert "auto: max(10 x step 1 s" in hw.reason(kill_at) and "iteration 20" in hw.reason(kill_at)
    change = hw.limit_change()
    assert change is not None and change["in_python_s"] == 120.0 and change["step_s"] == 1.0
    assert hw.limit_change() is None  # recorded once, until it changes
    paths = RunPaths(tmp_path)
    paths.state.mkdir()
    record_limits(paths, "7", change)
    (line,) = [json.loads(x) for x in paths.ledger.read_text().splitlines()]
    assert line["event"] == "hang_limit" and line["hang_s"] == outer_s(120.0) and line["job_id"] == "7"
    assert json.loads(paths.hang_limit("7").read_text())["startup_s"] == 1800.0


def test_a_long_save_raises_the_limit_and_a_small_change_is_not_adopted() -> None:
    limit = hl.HangLimit("auto", save_estimate_s=60.0)
    for t, i in ((0.0, 1), (10.0, 2), (20.0, 3), (30.0, 4)):
        limit.progress.iteration(t, i)
    assert limit.update() and limit.value == 160.0  # 10 x 10 + 60
    limit.progress.iteration(40.5, 5)  # a 10.5 s step: 165 s, within 10 %
    assert not limit.update() and limit.value == 160.0
    limit.progress.save_started(41.0)
    limit.progress.save_ended(141.0)  # 100 s: allowance 200 s
    assert limit.update() and limit.value == 305.0


def test_explicit_values_behave_as_before() -> None:
    limits = Limits.for_settings(20.0, 100.0)
    assert limits == Limits(startup_s=20.0, hang_s=backstop_after_s(100.0) + 30.0) and not limits.auto
    hw = HangWatch(limits, last_change=0.0)
    for i, t in enumerate((1.0, 2.0, 3.0, 4.0, 5.0), start=1):
        hw.observe(t, beat("iteration", i, seq=i))  # 1 s steps change nothing
    assert hw.hang is None and hw.limit_s == limits.hang_s
    assert "(hang_timeout_s limit" in hw.reason(5.0 + limits.hang_s)


def test_the_start_up_limit_comes_from_earlier_resumed_segments(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    tl = paths.timeline("1").parent
    tl.mkdir(parents=True)
    (tl / "1.json").write_text(json.dumps({"phases": {"process_start": 0.0, "first_iteration_end": 500.0}}))
    (tl / "2.json").write_text(json.dumps({"start_iteration": 40, "phases": {
        "process_start": 1000.0, "load_start": 1010.0, "first_iteration_end": 1150.0, "last_iteration_end": 2000.0}}))
    (tl / "3.json").write_text("{not json")
    (tl / "4.json").write_text(json.dumps({"start_iteration": 80, "phases": {"process_start": 0.0}}))  # it died
    assert hl.measured_startups(tl, current_job="5") == [150.0]  # 1 loaded no checkpoint
    assert hl.measured_startups(tl, current_job="2") == []
    (paths.runtime_json).write_text(json.dumps({"train_iters": 10, "save_interval": 5}))
    limits = Limits.for_run(paths, "5")
    assert limits.startup_s == 450.0 and limits.auto and "3 x the longest start-up" in limits.startup_why
    hw = HangWatch(limits, last_change=0.0)
    assert hw.decide(449.0, "RUNNING") == "ok" and hw.decide(450.0, "RUNNING") == "fire"
    assert "3 x the longest start-up measured (150 s)" in hw.reason(450.0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr("megalaunch.runtime.health.watchdog.time.monotonic", lambda: now[0])
    return now


def test_the_in_python_watchdog_adopts_the_measured_limit(tmp_path: Path, clock: list[float]) -> None:
    told: list[float] = []
    wd = Watchdog(tmp_path, rank=0, job_id="1", timeout_s="auto", on_hang=lambda r: None, save_estimate_s=30.0,
                  on_limit=lambda limit: told.append(limit.value))
    assert wd.timeout_s == 1800.0 and wd.check_s == 30.0
    wd.beat("health check done")
    for i in range(1, 6):
        clock[0] += 2.0
        wd.beat(f"iteration {i}")
    assert told == [120.0] and wd.timeout_s == 120.0 and wd.check_s == 12.0  # max(10 x 2 + 30, 120)
    wd.beat("save at iteration 5 started")
    clock[0] += 90.0
    wd.beat("save at iteration 5 done")  # allowance 2 x 90 s
    for i in range(6, 10):
        clock[0] += 2.0
        wd.beat(f"iteration {i}")
    assert told == [120.0, 200.0] and wd.timeout_s == 200.0
    fixed = Watchdog(tmp_path, rank=0, job_id="1", timeout_s=300.0, on_hang=lambda r: None, on_limit=told.append)
    for i in range(1, 6):
        clock[0] += 2.0
        fixed.beat(f"iteration {i}")
    assert fixed.timeout_s == 300.0 and len(told) == 2
