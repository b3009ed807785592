"""The health check's decision (runtime/health/health.py, pure), the team's recorded figures, the straggler
summary (runtime/health/stragglers.py), and what the chain, `status` and goodput make of an `unhealthy_node`
segment (over the real Chain; the scheduler is the recorder of tests/unit/test_nodes.py)."""

from __future__ import annotations

import json

import pytest
from tests.unit.test_chain import _outcome
from tests.unit.test_nodes import _NoSlurm, events, slurm_chain

from megalaunch.config.loader import load_recipe
from megalaunch.errors import MegalaunchError
from megalaunch.launcher.accounting.nodes import NodeHealth
from megalaunch.launcher.prepare.job_inputs import runtime_settings
from megalaunch.rundir.files import append_jsonl
from megalaunch.runtime.health.health import Baselines, RankFigures, judge
from megalaunch.runtime.health.stragglers import StepTimer, describe, summarize
from megalaunch.runtime.rank.settings import RuntimeSettings


def fig(rank: int, node: str, tflops: float | None, error: str | None = None) -> RankFigures:
    return RankFigures(rank=rank, node=node, device="cpu fp32 n=256 threads=1", tflops=tflops,
                       allreduce_gbps=1.0, seconds=0.5, error=error)


def test_a_rank_slower_than_the_median_by_more_than_the_margin_is_unhealthy() -> None:
    figures = [fig(0, "node1", 100.0), fig(1, "node1", 98.0), fig(2, "node2", 101.0), fig(3, "node2", 70.0)]
    v = judge(figures, margin=0.2)
    assert not v.healthy and v.unhealthy_nodes == ["node2"]
    assert v.median_tflops == pytest.approx(99.0)
    assert "node2: rank 3 70 TFLOP/s, more than 20% below the job's median 99" in v.reason
    # within the margin: healthy (81 > 0.8 x 99 = 79.2)
    assert judge([*figures[:3], fig(3, "node2", 81.0)], margin=0.2).healthy


def test_a_failing_rank_is_unhealthy_and_does_not_drag_the_median() -> None:
    v = judge([fig(0, "node1", 100.0), fig(1, "node2", None, error="RuntimeError: CUDA error")], margin=0.2)
    assert v.unhealthy_nodes == ["node2"] and v.median_tflops == 100.0
    assert "rank 1 failed the check: RuntimeError: CUDA error" in v.reason
    summary = v.summary()
    assert summary["ranks"][1]["error"] == "RuntimeError: CUDA error" and summary["unhealthy_nodes"] == ["node2"]


def test_a_check_of_thousands_of_ranks_is_one_small_record_that_keeps_what_tells() -> None:
    import json as _json

    from megalaunch.launcher.status_history import health_lines

    figures = [fig(r, f"snode{r // 8 + 1}", 100.0 + (r % 7)) for r in range(8000)]
    figures[4321] = fig(4321, "snode541", 20.0)  # one slow GPU
    v = judge(figures, margin=0.2)
    s = v.summary()
    assert v.unhealthy_nodes == ["snode541"] and s["rank_count"] == 8000 and s["nodes"] == "snode[1-1000]"
    kept = {r["rank"] for r in s["ranks"]}
    assert set(range(4320, 4328)) <= kept and len(kept) <= 8 + 5, sorted(kept)  # snode541's 8 ranks + extremes
    assert s["min_tflops"] == 20.0 and s["max_tflops"] == 106.0
    assert len(_json.dumps(s)) < 4000
    (line,) = health_lines([{"event": "health_check", "job_id": "9", **s}])
    assert "UNHEALTHY snode541" in line and "8000 ranks on snode[1-1000]" in line, line
    # a small job keeps every rank
    assert len(judge(figures[:16], margin=0.2).summary()["ranks"]) == 16


def test_one_rank_is_judged_against_the_recorded_figure_only() -> None:
    assert judge([fig(0, "node2", 10.0)], margin=0.2).healthy  # nothing to compare with
    v = judge([fig(0, "node2", 10.0)], margin=0.2, baseline=100.0)
    assert v.unhealthy_nodes == ["node2"] and "below the recorded figure for the device 100" in v.reason
    assert judge([fig(0, "node2", 90.0)], margin=0.2, baseline=100.0).healthy
    assert not judge([fig(0, "node1", None, error="boom")], margin=0.2).healthy  # a failing rank, even alone


def test_a_whole_slow_node_is_caught_by_the_recorded_figure_not_its_own_median() -> None:
    slow = [fig(0, "node2", 40.0), fig(1, "node2", 41.0)]
    assert judge(slow, margin=0.2).healthy
    assert judge(slow, margin=0.2, baseline=100.0).unhealthy_nodes == ["node2"]
    # a lower recorded figure never hides a slow peer: the reference is the higher of the two
    assert judge([fig(0, "node1", 100.0), fig(1, "node2", 50.0), fig(2, "node1", 100.0)], margin=0.2,
                 baseline=10.0).unhealthy_nodes == ["node2"]


def test_baselines_are_per_device_medians_of_the_newest_records(tmp_path) -> None:
    b = Baselines(tmp_path / "nh")
    assert b.reference("cpu") is None
    for v in (1.0, 2.0, 3.0, *[10.0] * 10):
        b.record("cpu", v, run="r", job_id="1", nodes=["node1"])
    b.record("gpu", 500.0, run="r", job_id="1", nodes=["node1"])
    with open(b.file, "a") as f:
        f.write('{"device": "cpu", "tfl')  # a torn line of a crashed writer
    assert b.reference("cpu") == 10.0  # the old, low figures fell out of the window
    assert b.reference("gpu") == 500.0


def test_health_check_settings_resolve_from_the_recipe() -> None:
    def settings(*sets: str) -> RuntimeSettings:
        return runtime_settings(load_recipe("tiny", list(sets)).recipe)

    assert not settings().health_check  # tiny is CPU: auto is off
    assert settings("cluster.gpus_per_node=8", "cluster.health_check=auto").health_check
    assert not settings("cluster.gpus_per_node=8", "cluster.health_check=off").health_check
    on = settings("cluster.health_check=on", "cluster.health_check_margin=0.5")
    assert on.health_check and on.health_check_margin == 0.5
    with pytest.raises((MegalaunchError, ValueError), match=r"cluster.health_check_margin must be a fraction"):
        settings("cluster.health_check_margin=20")
    with pytest.raises((MegalaunchError, ValueError), match=r"cluster.health_check"):
        settings("cluster.health_check=sometimes")


def test_straggler_summary_names_the_slowest_rank_and_its_node() -> None:
    ranks = [{"rank": 0, "node": "node1", "steps": 9, "mean_s": 1.0}, {"rank": 1, "node": "node1", "steps": 9,
             "mean_s": 1.02}, {"rank": 2, "node": "node2", "steps": 8, "mean_s": 1.5},
             {"rank": 3, "node": "node2", "steps": 9, "mean_s": 1.01}]
    s = summarize(ranks, threshold=0.1)
    assert s is not None
    assert s["slowest"] == {"rank": 2, "node": "node2", "mean_s": 1.5} and s["fastest"]["rank"] == 0
    assert s["median_step_s"] == pytest.approx(1.015) and s["spread"] == pytest.approx(0.4778, abs=1e-3)
    assert s["straggling"] and s["steps"] == 8
    assert "slowest rank 2 on node2 1.5 s forward/step, 48% above the median" in describe(s)
    assert not summarize(ranks[:2], threshold=0.1)["straggling"]  # type: ignore[index]
    assert summarize([{"rank": 0, "node": "n", "steps": 0, "mean_s": None}], threshold=0.1) is None


def test_step_timer_leaves_out_the_first_iteration() -> None:
    t = StepTimer()
    for _ in range(4):
        t.forward_begin()
        t.forward_end()
        t.iteration()
    st = t.stats()
    assert st["steps"] == 3 and isinstance(st["mean_s"], float) and st["mean_s"] >= 0


def _unhealthy_outcome(monkeypatch, paths, job: str) -> None:  # type: ignore[no-untyped-def]
    v = judge([fig(0, "node2", 10.0)], margin=0.2, baseline=100.0)
    _outcome(monkeypatch, paths, job, "unhealthy_node", iteration=0, reason=str(v.reason),
             health_check=v.summary())


def test_an_unhealthy_node_becomes_suspect_and_the_successor_excludes_it(tmp_path, monkeypatch) -> None:
    from megalaunch.launcher.status import run_status
    from megalaunch.launcher.status_format import format_run_status

    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 1, "node2")
    assert chain.begin("41").proceed and sched.submitted == ["100"]
    _unhealthy_outcome(monkeypatch, paths, "41")
    append_jsonl(paths.ledger, {"event": "health_check", "job_id": "41", "time": 2.0,
                                **json.loads(paths.outcome.read_text())["health_check"]})
    verdict = chain.end("41", 0)
    assert verdict.proceed  # the chain goes on, off the node
    (end,) = events(paths, "ended")
    assert end["outcome"] == "unhealthy_node" and "node2: rank 0 10 TFLOP/s" in end["reason"]
    (sus,) = events(paths, "node_suspected")
    assert sus["node"] == "node2" and sus["evidence"] == ["rank 0 matmul 10.0 TFLOP/s (10% of the reference 100)"]
    assert set(NodeHealth(RuntimeSettings.load(paths).node_health_dir or "").active()) == {"node2"}
    assert sched.excluded == {"100": ["node2"]}
    monkeypatch.setattr("megalaunch.launcher.status.backend_for", lambda name: _NoSlurm())
    text = format_run_status(run_status(paths))
    assert "nodes: suspect node2 after job 41: health check: rank 0 matmul 10.0 TFLOP/s" in text
    assert "health check: job 41: UNHEALTHY node2, matmul TFLOP/s node2 r0 10 (reference 100)" in text
    assert "UNHEALTHY_NODE" in text


def test_unhealthy_segments_count_against_the_crash_loop_budget(tmp_path, monkeypatch) -> None:
    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 1, "node2")
    budget = RuntimeSettings.load(paths).max_segments_without_progress
    for i in range(budget):
        job = str(50 + i)
        assert chain.begin(job).proceed
        _unhealthy_outcome(monkeypatch, paths, job)
        last = chain.end(job, 0)
    assert not last.proceed and "consecutive segments without a new checkpoint" in last.reason


def test_goodput_counts_the_health_check_apart(tmp_path, monkeypatch) -> None:
    from megalaunch.launcher.accounting.goodput import segment_time

    started = {"time": 100.0}
    ended = {"time": 140.0, "outcome": "unhealthy_node"}
    tl = {"phases": {"process_start": 101.0, "setup_done": 105.0, "distributed_ready": 106.0,
                     "health_check_start": 106.0, "health_check_end": 131.0, "exit": 132.0}}
    seg = segment_time("1", started, ended, tl, [], 200.0)
    assert seg.parts["health_check"] == pytest.approx(25.0)
    assert sum(seg.parts.values()) == pytest.approx(40.0) and seg.parts["failed"] == 0
    # a healthy segment: the check is carved out of init
    tl2 = {"phases": {**tl["phases"], "model_build_start": 133.0, "load_start": 134.0, "load_end": 134.0,
                      "data_end": 135.0, "last_iteration_end": 138.0, "exit": 139.0}}
    seg2 = segment_time("2", started, {"time": 140.0, "outcome": "saved"}, tl2, [], 200.0)
    assert seg2.parts["health_check"] == pytest.approx(25.0) and seg2.parts["init"] == pytest.approx(3.0)
    assert sum(seg2.parts.values()) == pytest.approx(40.0)


def test_nvrx_scores_leave_out_sections_without_new_timings(monkeypatch) -> None:
    """nvidia-resiliency-ext 0.7 (run on 2x H200) scored {0: 0.948, 1: 1.0} at a save and NaN for both
    ranks at the segment's end right after it; NaN is not JSON, so such sections are left out."""
    import json
    import types

    from megalaunch.runtime.health import stragglers

    def detector(scores: dict[str, dict[int, float]]) -> types.SimpleNamespace:
        report = types.SimpleNamespace(section_relative_perf_scores=scores)
        return types.SimpleNamespace(Detector=types.SimpleNamespace(generate_report=lambda: report))

    monkeypatch.setattr(stragglers, "_nvrx", detector({"forward": {0: 0.948, 1: 1.0}}))
    assert stragglers.nvrx_scores() == {"forward": {"0": 0.948, "1": 1.0}}
    monkeypatch.setattr(stragglers, "_nvrx", detector({"forward": {0: float("nan"), 1: float("nan")}}))
    assert stragglers.nvrx_scores() is None
    monkeypatch.setattr(stragglers, "_nvrx", detector({"forward": {0: 0.5, 1: float("nan")}, "x": {}}))
    assert json.loads(json.dumps(stragglers.nvrx_scores(), allow_nan=False)) == {"forward": {"0": 0.5}}


def test_the_first_healthy_check_leaves_the_node_health_dir_writable_for_the_group(tmp_path) -> None:
    """Jobs run with umask 027. The usual first writer of a cluster's node-health directory is a healthy
    check recording its figure: the directory must stay group-writable (setgid) and the file 0660, or a
    colleague's job could neither record its figure nor mark a bad node."""
    import os
    import stat

    from megalaunch.launcher.accounting.nodes import NodeHealth
    from megalaunch.runtime.health.health import Baselines

    directory = tmp_path / "node-health"
    old = os.umask(0o027)
    try:
        Baselines(directory).record("cpu fp32 n=256", 0.1, run="r", job_id="1", nodes=["node1"])
        NodeHealth(directory).suspect("node2", reason="x", evidence=[], run="r", job_id="2", ttl_s=60)
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o3770  # sticky: nobody replaces a colleague's file
    for name in ("health_baselines.jsonl", "suspects.jsonl"):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o660, name
    assert Baselines(directory).reference("cpu fp32 n=256") == 0.1
    assert list(NodeHealth(directory).active()) == ["node2"]


class _FakeGPU:
    """torch's surface that measure_matmul touches, on a pretend GPU: a recorded call order, a clock
    that advances 2 ms per matmul and a CUDA event pair that reports the queued matmuls' time."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.clock = 0.0
        self.bfloat16 = self.float32 = object()
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool) -> None:
                self.at = 0.0

            def record(self) -> None:
                self.at = gpu.clock
                gpu.calls.append("record")

            def synchronize(self) -> None:
                gpu.calls.append("event sync")

            def elapsed_time(self, other: Event) -> float:
                return (other.at - self.at) * 1e3 * 0.5  # the GPU ran the queue twice as fast as the probe

        class Cuda:
            def synchronize(self, device: object) -> None:
                gpu.calls.append("sync")

        self.cuda = Cuda()
        self.cuda.Event = Event  # type: ignore[attr-defined]

    def randn(self, *a: object, **k: object) -> None:
        return None

    def matmul(self, a: object, b: object) -> None:
        self.clock += 0.002
        self.calls.append("matmul")


def test_on_a_gpu_the_imports_run_while_the_queued_matmuls_are_timed_by_cuda_events(monkeypatch) -> None:
    from types import SimpleNamespace

    from megalaunch.runtime.health import health

    gpu = _FakeGPU()
    monkeypatch.setattr(health.time, "perf_counter", lambda: gpu.clock)
    busy: list[int] = []
    tflops = health.measure_matmul(gpu, SimpleNamespace(type="cuda"), n=1000, seconds=1.0,
                                   while_busy=lambda: busy.append(len(gpu.calls)))
    first_record = gpu.calls.index("record")
    queued = gpu.calls[first_record + 1:].index("record")
    assert queued > 100 and busy == [first_record + queued + 2]  # after the whole queue was launched
    assert gpu.calls[busy[0]:] == ["event sync"]
    assert tflops == pytest.approx(2 * 1000**3 / 0.001 / 1e12)  # the events' time, not the host's


def test_on_the_cpu_or_a_slowed_device_the_imports_start_first(monkeypatch) -> None:
    from types import SimpleNamespace

    from megalaunch.runtime.health import health

    for device, slow in (("cpu", 1.0), ("cuda", 3.0)):
        gpu = _FakeGPU()
        monkeypatch.setattr(health.time, "perf_counter", lambda gpu=gpu: gpu.clock)
        monkeypatch.setattr(health.time, "sleep", lambda s, gpu=gpu: setattr(gpu, "clock", gpu.clock + s))
        busy: list[int] = []
        health.measure_matmul(gpu, SimpleNamespace(type=device), n=100, seconds=0.3, slow_factor=slow,
                              while_busy=lambda gpu=gpu, busy=busy: busy.append(len(gpu.calls)))
        warm_up = ["matmul"] * 3 + (["sync"] if device == "cuda" else [])
        assert busy == [len(warm_up)] and gpu.calls[:len(warm_up)] == warm_up, (device, busy)  # before timing
        assert "record" not in gpu.calls
