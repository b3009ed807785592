"""Goodput accounting from the records a segment leaves (launcher/accounting/goodput.py): the components
partition the wall time, whatever phases a segment reached (end-to-end: tests/megatron/test_goodput.py
and the Slurm chain test)."""

from __future__ import annotations

import pytest

from megalaunch.launcher.accounting.goodput import (
    COMPONENTS,
    checkpoint_interval_hint,
    checkpoint_saves,
    mfu,
    peak_tflops,
    segment_time,
)

PHASES = {"process_start": 101.0, "runtime_start": 102.0, "setup_done": 110.0, "model_build_start": 113.0,
          "load_start": 114.0, "load_end": 118.0, "data_end": 119.0, "first_iteration_end": 120.0,
          "last_iteration_end": 160.0, "signal_received": 159.5, "decision": 170.0, "exit": 170.5}


def _tl(phases=PHASES, saves=((140, 130.0, 135.0), (150, 160.0, 170.0)), last=150, start_iteration=100):
    return {"phases": dict(phases), "saves": [list(s) for s in saves], "iterations": {"first": 101, "last": last},
            "start_iteration": start_iteration, "gpu": "NVIDIA H100 80GB HBM3", "world": 8}


def _sum(seg) -> float:
    return sum(seg.parts.values())


def test_a_saved_segment_is_cut_at_its_phases() -> None:
    seg = segment_time("7", {"time": 100.0}, {"time": 175.0, "outcome": "saved"}, _tl(), [], now=999.0)
    p = seg.parts
    assert set(p) == set(COMPONENTS) and _sum(seg) == pytest.approx(75.0)
    assert (p["launch"], p["imports"], p["init"], p["model_build"], p["checkpoint_load"], p["data_setup"]) == \
        pytest.approx((1.0, 9.0, 3.0, 1.0, 4.0, 1.0))
    assert p["checkpoint_save"] == pytest.approx(15.0) and p["lost_work"] == 0.0
    assert p["productive"] == pytest.approx(170.0 - 119.0 - 15.0)
    assert (p["exit"], p["teardown"], p["failed"]) == pytest.approx((0.5, 4.5, 0.0))


def test_a_failure_after_the_last_checkpoint_loses_the_work_since_it() -> None:
    tl = _tl(phases={k: v for k, v in PHASES.items() if k not in ("decision", "exit", "signal_received")},
             saves=((140, 130.0, 135.0),), last=158)
    seg = segment_time("7", {"time": 100.0}, {"time": 190.0, "outcome": "failed"}, tl, [], now=999.0)
    p = seg.parts
    assert _sum(seg) == pytest.approx(90.0)
    assert p["lost_work"] == pytest.approx(160.0 - 135.0) and p["failed"] == pytest.approx(30.0)
    assert p["productive"] == pytest.approx(135.0 - 119.0 - 5.0) and p["teardown"] == 0.0


def test_a_vanished_segment_ends_at_its_last_sign_of_life_not_at_the_next_start() -> None:
    tl = _tl(phases={k: v for k, v in PHASES.items() if k not in ("decision", "exit", "signal_received")},
             saves=((140, 130.0, 135.0),), last=158)
    metrics = [{"job_id": "7", "iteration": 158, "time": 161.0}]
    ended = {"time": 5000.0, "outcome": "killed", "accounted_by": "8"}  # the next segment began hours later
    seg = segment_time("7", {"time": 100.0}, ended, tl, metrics, now=9999.0)
    assert seg.end == pytest.approx(161.0)  # the last metrics line, not the successor's start
    assert _sum(seg) == pytest.approx(61.0) and seg.parts["failed"] == pytest.approx(1.0)
    assert seg.parts["lost_work"] == pytest.approx(160.0 - 135.0)


def test_a_running_segment_counts_the_time_since_its_last_record_as_training() -> None:
    tl = _tl(phases={k: v for k, v in PHASES.items() if k not in ("decision", "exit", "signal_received")},
             saves=((140, 130.0, 135.0),), last=158)
    seg = segment_time("7", {"time": 100.0}, None, tl, [], now=165.0)
    assert seg.running and _sum(seg) == pytest.approx(65.0)
    assert seg.parts["teardown"] == 0.0 and seg.parts["failed"] == 0.0


def test_a_segment_without_a_trainer_timeline_is_untracked() -> None:
    seg = segment_time("7", {"time": 100.0}, {"time": 130.0, "outcome": "saved"}, None, [], now=999.0)
    assert seg.parts["untracked"] == pytest.approx(30.0) and _sum(seg) == pytest.approx(30.0)


def test_a_wait_for_an_asynchronous_save_is_save_time_not_exit() -> None:
    """Its checkpoint's second interval (the loop's end waited for it after an abort): checkpoint_save,
    the iterations before it lost work from the save's first interval; Young/Daly counts one save."""
    phases = {**PHASES, "decision": 165.0, "exit": 172.0}
    tl = _tl(phases=phases, saves=((140, 130.0, 135.0), (140, 161.0, 171.0)), last=158)
    seg = segment_time("7", {"time": 100.0}, {"time": 175.0, "outcome": "aborted"}, tl, [], now=999.0)
    p = seg.parts
    assert _sum(seg) == pytest.approx(75.0)
    assert p["checkpoint_save"] == pytest.approx(5.0 + 10.0) and p["exit"] == pytest.approx(1.0)
    assert p["lost_work"] == pytest.approx(160.0 - 135.0) and seg.last_checkpoint == 140
    assert checkpoint_saves(seg.saves) == {140: (pytest.approx(15.0), 171.0)}
    hint = checkpoint_interval_hint({"wall": 75.0, "segments": [{"outcome": "aborted", "saves": seg.saves}]}, None)
    assert (hint["saves"], hint["save_s"]) == (1, pytest.approx(15.0))


@pytest.mark.parametrize(("gpu", "peak"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                           ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                           ("NVIDIA GH200 480GB", 989.0), ("Tesla T4", None)])
def test_peak_table(gpu: str, peak: float | None) -> None:
    assert peak_tflops(gpu) == peak
    assert peak_tflops(gpu, override=500.0) == 500.0
    assert mfu(445.0, "NVIDIA H200") == pytest.approx(0.45, abs=1e-3)


def test_young_daly_uses_machine_failures_only() -> None:
    chain = {"wall": 36000.0, "segments": [
        {"outcome": "failed", "saves": [[10, 0.0, 20.0]]}, {"outcome": "config_error", "saves": []},
        {"outcome": "saved", "saves": [[20, 0.0, 20.0]]}]}
    hint = checkpoint_interval_hint(chain, step_s=2.0)
    assert hint["failures"] == 1 and hint["mtbf_s"] == 36000.0
    assert hint["interval_s"] == pytest.approx((2 * 36000.0 * 20.0) ** 0.5)
    assert hint["interval_iters"] == int(hint["interval_s"] / 2.0)


def test_process_start_time_is_accurate_to_the_clock_tick() -> None:
    """From /proc/<pid>/stat and /proc/uptime (btime alone is whole seconds: up to 1 s early)."""
    import subprocess
    import sys
    import time

    from megalaunch.runtime.observation.timeline import process_start_time

    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    try:
        started = process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    assert started is not None and before - 0.05 <= started <= time.time()
