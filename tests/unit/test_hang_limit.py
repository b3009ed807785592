"""The hang limits that follow the measured step (runtime/health/hang_limit.py): the arithmetic, the measure
and the phase from beats (between saves, during a save until its checkpoint is written, during an
evaluation), the in-Python watchdog and the watcher outside Python on a fake clock, what is recorded and
shown, and explicit values that behave exactly as before."""

from __future__ import annotations

import inspect
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from megalaunch.launcher.status_format import _watch_lines
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.hangwatch import HangWatch, Limits, outer_s, record_limits
from megalaunch.runtime.health import hang_limit as hl
from megalaunch.runtime.health.hang_limit import EVAL, SAVE, TRAIN
from megalaunch.runtime.health.watchdog import EXIT_HUNG, Watchdog, backstop_after_s, feed
from megalaunch.runtime.loop import eval_seam


def beat(phase: str, iteration: int | None = None, seq: int = 1, **extra: Any) -> bytes:
    return json.dumps({"phase": phase, "iteration": iteration, "seq": seq, "step_id": "0", **extra}).encode()


def test_the_limit_arithmetic() -> None:
    assert hl.between_saves_s(1.0) == 45.0  # the floor
    assert hl.between_saves_s(20.0) == 200.0  # 10 x 20
    assert hl.phase_limits(1.0, 60.0, 8.0) == {TRAIN: 45.0, SAVE: 105.0, EVAL: 53.0}
    assert hl.save_allowance_s(None, 60.0) == 60.0  # no save seen: the estimate
    assert hl.save_allowance_s(10.0, 60.0) == 60.0  # a fast save does not shrink the estimate
    assert hl.save_allowance_s(45.0, 60.0) == 90.0  # a slow one: twice the longest
    assert hl.eval_allowance_s(None) == 300.0 and hl.eval_allowance_s(4.0) == 8.0
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
    assert p.step_s is None and p.phase == TRAIN  # 2 measured, 3 needed
    p.save_started(102.5, 3)
    assert p.phase == SAVE
    p.save_ended(132.5, 3)
    p.written(132.5, 3)
    assert p.phase == TRAIN
    p.iteration(140.0, 4)  # after a save: starts the measure again, 7.5 s is not a step
    p.iteration(150.0, 14)  # a heartbeat every 5 s or more: 10 iterations in 10 s
    assert p.step_s == 1.0 and p.longest_save_s == 30.0


def test_an_asynchronous_write_keeps_the_save_limit_until_its_checkpoint_is_written() -> None:
    """Any later point may block on the write (the next save, a stop, the loop's end): the save's limit
    holds behind the iterations, and the save is measured from its start to its complete checkpoint."""
    p = hl.Progress()
    p.save_started(10.0, 5)
    p.save_ended(12.0, 5)  # the hand-off returned
    assert p.phase == SAVE and p.longest_save_s == 2.0
    for t, i in ((13.0, 6), (14.0, 7), (15.0, 8), (16.0, 9)):
        p.iteration(t, i)
    assert p.phase == SAVE and p.step_s == 1.0  # iterations are measured while it writes
    p.written(40.0, 5)
    assert p.phase == TRAIN and p.longest_save_s == 30.0


def test_an_evaluation_is_its_own_phase_measured_by_its_longest_silence() -> None:
    p = hl.Progress()
    for t in (0.0, 1.0, 2.0, 3.0):
        p.iteration(t, int(t) + 1)
    p.eval_beat(3.5)  # started
    assert p.phase == EVAL
    for t in (5.5, 6.0, 6.5):  # batches: the first one 2 s after the start
        p.eval_beat(t)
    p.eval_ended(7.0)
    assert p.phase == TRAIN and p.longest_eval_gap_s == 2.0
    p.iteration(8.0, 5)  # the evaluation is not a step
    assert p.longest_step_s == 1.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr("megalaunch.runtime.health.watchdog.time.monotonic", lambda: now[0])
    return now


def _steps(wd: Watchdog, clock: list[float], first: int, last: int, step_s: float = 1.0) -> None:
    for i in range(first, last + 1):
        clock[0] += step_s
        wd.beat(f"iteration {i}")


def test_the_in_python_watchdog_follows_the_phase(tmp_path: Path, clock: list[float]) -> None:
    told: list[dict[str, float]] = []
    wd = Watchdog(tmp_path, rank=0, job_id="1", timeout_s="auto", on_hang=lambda r: None, save_estimate_s=30.0,
                  on_limit=lambda limit: told.append(dict(limit.limits)))
    assert wd.timeout_s == 1800.0 and wd.check_s == 30.0 and wd.grace_s == 60.0  # not measured yet
    wd.beat("health check done")
    _steps(wd, clock, 1, 5)  # 1 s steps
    assert told == [{TRAIN: 45.0, SAVE: 75.0, EVAL: 345.0}]
    assert wd.timeout_s == 45.0 and wd.check_s == 4.5 and wd.grace_s == 10.0  # the floor's period and grace
    wd.beat("save at iteration 5 started")
    assert wd.timeout_s == 75.0  # 45 + the estimate, during the save
    clock[0] += 40.0
    wd.beat("save at iteration 5 done")
    wd.beat("checkpoint of iteration 5 written")
    assert wd.timeout_s == 45.0 and told[-1][SAVE] == 125.0  # between saves again; the allowance 2 x 40 s
    _steps(wd, clock, 6, 9)
    wd.beat("evaluation started")
    assert wd.timeout_s == 45.0 + 300.0  # no evaluation measured yet: the fallback allowance
    for _ in range(3):
        clock[0] += 0.5
        wd.beat("evaluation batch")
    clock[0] += 0.5
    wd.beat("evaluation done")
    assert wd.timeout_s == 45.0 and told[-1][EVAL] == 46.0  # measured: 45 + 2 x 0.5 s
    clock[0] += 20.0  # a long evaluation no longer beats: its silence is judged by the eval limit
    wd.beat("evaluation started")
    assert wd.timeout_s == 46.0
    assert "auto, during an evaluation: max(10 x step 1 s, 45 s) + eval allowance 1 s" in wd.limit.describe()


def test_explicit_values_hold_in_every_phase(tmp_path: Path, clock: list[float]) -> None:
    told: list[object] = []
    fixed = Watchdog(tmp_path, rank=0, job_id="1", timeout_s=300.0, on_hang=lambda r: None, on_limit=told.append)
    _steps(fixed, clock, 1, 5)
    fixed.beat("save at iteration 5 started")
    assert fixed.timeout_s == 300.0 and fixed.check_s == 30.0 and told == []
    limits = Limits.for_settings(20.0, 100.0)
    assert limits == Limits(startup_s=20.0, hang_s=backstop_after_s(100.0) + 30.0) and not limits.auto
    hw = HangWatch(limits, last_change=0.0)
    for i, t in enumerate((1.0, 2.0, 3.0, 4.0, 5.0), start=1):
        hw.observe(t, beat("iteration", i, seq=i))  # 1 s steps change nothing
    hw.observe(6.0, beat("save_start", 5, seq=6, writing=True))
    assert hw.hang is None and hw.limit_s == limits.hang_s
    assert "(hang_timeout_s limit" in hw.reason(6.0 + limits.hang_s)


def test_a_frozen_rank_is_found_once_the_limit_is_measured_not_a_check_period_later(
        tmp_path: Path, clock: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread waits one check period of the unmeasured limit (30 s of 1800 s); the measured limit
    wakes it, so it looks at the new period at once (here 0.2 s, real time)."""
    monkeypatch.setattr("megalaunch.runtime.health.watchdog.check_period_s", lambda t: 30.0 if t >= 1800 else 0.2)
    exited = threading.Event()
    hung: list[str] = []
    wd = Watchdog(tmp_path, rank=2, job_id="9", timeout_s="auto", on_hang=hung.append, save_estimate_s=10.0,
                  exit=lambda code: exited.set() if code == EXIT_HUNG else None)
    wd._thread.start()  # the Python thread only: no faulthandler backstop in a test process
    time.sleep(0.2)  # it waits its 30 s
    _steps(wd, clock, 1, 5)
    assert wd.check_s == 0.2 and wd.timeout_s == 45.0
    clock[0] += 46.0  # a rank froze: no beat for 46 s (fake clock)
    assert exited.wait(5.0), "the watchdog did not act within 5 s after the limit was measured"
    wd.stop()
    assert hung and "no progress for 46 s (hang_timeout 45 s" in hung[0]
    assert "auto, between saves: max(10 x step 1 s, 45 s)" in hung[0] and "last: iteration 5" in hung[0]
    assert (tmp_path / "stacks-job9-rank2.txt").exists()


def test_the_watcher_outside_python_follows_the_phase_from_the_heartbeat(tmp_path: Path) -> None:
    limits = Limits.for_settings("auto", "auto", save_estimate_s=20.0)
    assert limits.hang_s == outer_s(1800.0) and limits.startup_s == 1800.0
    hw = HangWatch(limits, last_change=0.0)
    hw.observe(50.0, beat("iteration", 5))
    assert hw.hang_s == outer_s(1800.0)  # not measured yet
    for i, t in enumerate((55.0, 60.0, 65.0), start=2):
        hw.observe(t, beat("iteration", 5 * i, seq=i))  # 5 iterations per 5 s: 1 s steps
    assert hw.hang is not None and hw.hang.limits == {TRAIN: 45.0, SAVE: 65.0, EVAL: 345.0}
    kill_at = 65.0 + outer_s(45.0)
    assert hw.limit_s == outer_s(45.0) == 129.0  # after the in-Python watchdog's backstop (45 + 2 x 4.5 + 45)
    assert hw.decide(kill_at - 0.1, "RUNNING") == "ok" and hw.decide(kill_at, "RUNNING") == "fire"
    assert "auto, between saves: max(10 x step 1 s" in hw.reason(kill_at) and "iteration 20" in hw.reason(kill_at)
    change = hw.limit_change()
    assert change is not None and change["in_python_s"] == 45.0 and change["in_python_save_s"] == 65.0
    assert change["hang_s"] == outer_s(45.0) and change["save_hang_s"] == outer_s(65.0)
    hw.observe(66.0, beat("save_start", 20, seq=5, writing=True))
    assert hw.limit_s == outer_s(65.0) and hw.limit_change() is None  # a phase change is not a new limit
    hw.observe(68.0, beat("save_end", 20, seq=6, writing=True))  # an asynchronous save's hand-off
    hw.observe(73.0, beat("iteration", 25, seq=7, writing=True))
    assert hw.limit_s == outer_s(65.0)  # its checkpoint is still being written
    hw.observe(120.0, beat("save_written", 25, seq=8, writing=False))  # a 54 s save: allowance 108 s
    assert hw.beats.kind == TRAIN and hw.limit_s == outer_s(45.0) and hw.hang.limits[SAVE] == 153.0
    hw.observe(121.0, beat("eval_start", 25, seq=9))
    assert hw.limit_s == outer_s(345.0) and "an evaluation" in hw.reason(121.0 + hw.limit_s)
    paths = RunPaths(tmp_path)
    paths.state.mkdir()
    record_limits(paths, "7", hw.limit_change() or {})
    (line,) = [json.loads(x) for x in paths.ledger.read_text().splitlines()]
    assert line["event"] == "hang_limit" and line["in_python_save_s"] == 153.0 and line["job_id"] == "7"
    (shown,) = _watch_lines({"hang_limits": json.loads(paths.hang_limit("7").read_text())})
    assert "then without progress 45 s between saves, 153 s during a save, 345 s during an evaluation" in shown


def test_the_watcher_stays_after_the_watchdog_in_every_phase() -> None:
    """The same beats, every one to the watchdog, and to the watcher as it samples rank 0's heartbeat
    every 10 s (writes between its looks are missed; a save every 20 s can hide every pair of iteration
    beats from it): with rank 0's limits in the heartbeat, its limit in each phase leaves the watchdog's
    limit, check period and grace to act first."""
    inner = hl.HangLimit("auto", 10.0)
    hw = HangWatch(Limits.for_settings("auto", "auto", save_estimate_s=10.0), last_change=0.0)
    events: list[tuple[float, str, str, bool, int]] = []  # time, watchdog words, heartbeat phase, writing, iteration
    t, it = 0.0, 0
    for cycle in range(3):
        for _ in range(20):
            t, it = t + 2.0, it + 1
            events.append((t, f"iteration {it}", "iteration", cycle > 0 and it % 20 < 8, it))
        events.append((t + 0.1, f"save at iteration {it} started", "save_start", True, it))
        events.append((t + 13.0, f"save at iteration {it} done", "save_end", True, it))  # asynchronous hand-off
        t += 13.0
        events.append((t + 0.5, "evaluation started", "eval_start", True, it))
        for b in range(12):
            events.append((t + 1.0 + 3.0 * b, "evaluation batch", "eval", True, it))
        t += 40.0
        events.append((t, "evaluation done", "eval_end", True, it))
        events.append((t + 30.0, f"checkpoint of iteration {it} written", "save_written", False, it))
        t += 30.0
    next_look = 0.0
    for seq, (when, words, phase, writing, at) in enumerate(events, start=1):
        feed(inner.progress, when, words)
        inner.update()
        if when >= next_look:  # the watcher's look, every 5 s
            hw.observe(when, beat(phase, at, seq=seq, writing=writing, hang_limits=inner.published()))
            next_look = when + 10.0
    assert inner.measured and hw.hang is not None and hw.hang.measured
    for phase in (TRAIN, SAVE, EVAL):
        inside = inner.for_phase(phase)
        assert hw.phase_s(phase) >= inside + 2 * 30.0, (phase, hw.phase_s(phase), inside)
    assert hw.hang.why == inner.why and hw.limit_change()["in_python_s"] == inner.value  # type: ignore[index]


def test_an_evaluation_beats_at_its_start_each_batch_and_its_end() -> None:
    said: list[str] = []
    hooks = SimpleNamespace(evaluation=said.append)

    def forward_step(data_iterator: Any, model: Any) -> str:
        said.append("forward")
        return "loss"

    def evaluate_and_print_results(prefix: str, forward_step_func: Any, data_iterator: Any, model: Any,
                                   *rest: Any, **kw: Any) -> None:
        for _ in range(2):
            assert forward_step_func(data_iterator, model) == "loss"
        raise RuntimeError("a collective failed")

    megatron = SimpleNamespace(evaluate_and_print_results=evaluate_and_print_results)
    eval_seam.install(hooks, megatron)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        megatron.evaluate_and_print_results("iteration 10", forward_step, iter([]), [], None, verbose=False)
    assert said == ["started", "batch", "forward", "batch", "forward", "done"]
    wrapped = eval_seam.beating(hooks, forward_step)  # type: ignore[arg-type]
    assert list(inspect.signature(wrapped).parameters) == ["data_iterator", "model"]  # Megatron inspects it


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
