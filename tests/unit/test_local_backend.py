"""The local backend end to end with the counter workload: the timer's signal saves and the next
segment resumes; triggers save/exit/abort act on the running job; a crashing workload trips the
crash-loop budget."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.unit.helpers import REPO, cli, counter_recipe

from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths


def _run_dir(tmp: Path) -> RunPaths:
    dirs = [p for p in (tmp / "runs").iterdir() if not p.name.startswith(".")]
    assert len(dirs) == 1
    return RunPaths(dirs[0])


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_chain_of_segments_resumes_exactly(tmp_path: Path) -> None:
    recipe = counter_recipe(tmp_path, training="{train_iters: 260}")
    proc = cli("submit", str(recipe), env={"COUNTER_STEP_S": "0.05"}, timeout=180)
    assert proc.returncode == 0, proc.stderr
    paths = _run_dir(tmp_path)
    segs = Ledger(paths).segments()
    assert len(segs) >= 2
    assert [s.ended["outcome"] for s in segs] == ["saved"] * (len(segs) - 1) + ["finished"]
    for prev, nxt in itertools.pairwise(segs):
        # each segment resumes at exactly the iteration the previous one saved at
        assert nxt.started["checkpoint_iteration"] == prev.ended["checkpoint_iteration"]
        log = (paths.logs / f"{paths.root.name}-{nxt.job_id}.out").read_text()
        assert f"resumes at iteration {prev.ended['checkpoint_iteration']}" in log
    assert paths.read_tracker() == 260
    state = json.loads((paths.checkpoints / "iter_0000260" / "state.json").read_text())
    assert state["total"] == sum(range(1, 261))  # no step lost or repeated across segments
    first = cli("logs", str(paths.root), "--segment", "1")
    assert first.returncode == 0 and "resumes at iteration 0" in first.stdout
    newest = cli("logs", str(paths.root))
    assert f"resumes at iteration {segs[-1].started['checkpoint_iteration']}" in newest.stdout
    bad = cli("logs", str(paths.root), "--segment", "99")
    assert bad.returncode != 0 and "--segment" in bad.stderr
    status = cli("status", str(paths.root), "--json")
    st = json.loads(status.stdout)
    assert st["chain_state"] == "stopped" and "target" in st["stop_reason"]


def _start(recipe: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "megalaunch.cli.main", "submit", str(recipe)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "COUNTER_STEP_S": "0.05"})


def _iteration(paths_holder: list[RunPaths], tmp: Path) -> int:
    if not paths_holder:
        runs = tmp / "runs"
        if not runs.exists():
            return -1
        dirs = [p for p in runs.iterdir() if not p.name.startswith(".")]
        if not dirs:
            return -1
        paths_holder.append(RunPaths(dirs[0]))
    prog = paths_holder[0].progress
    try:
        return int(json.loads(prog.read_text())["iteration"])
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def test_triggers_save_then_exit(tmp_path: Path) -> None:
    recipe = counter_recipe(tmp_path, training="{train_iters: 100000}", cluster='{time: "00:05:00"}')
    proc = _start(recipe)
    holder: list[RunPaths] = []
    try:
        _wait_for(lambda: _iteration(holder, tmp_path) >= 10, 60, "training to start")
        paths = holder[0]
        st = json.loads(cli("status", str(paths.root), "--json").stdout)
        assert st["chain_state"] == "running" and st["segments"][-1]["state"] == "RUNNING"
        assert cli("trigger", "save", str(paths.root), "--reason", "checkpoint for eval").returncode == 0
        _wait_for(lambda: not paths.trigger("save").exists(), 30, "save trigger consumed")
        (rec,) = [json.loads(r.read_text()) for r in paths.consumed_triggers.glob("*save*.json")]
        saved_at = rec["consumed_iteration"]
        assert (paths.checkpoints / f"iter_{saved_at:07d}" / "state.json").exists()  # a checkpoint at that step
        it_then = _iteration(holder, tmp_path)
        _wait_for(lambda: _iteration(holder, tmp_path) > it_then + 5, 30, "training to continue after save")
        assert proc.poll() is None
        assert cli("trigger", "exit", str(paths.root)).returncode == 0
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(paths.outcome.read_text())
    assert outcome["status"] == "exited"
    assert paths.read_tracker() == outcome["iteration"]  # saved before exiting
    records = sorted(paths.consumed_triggers.glob("*.json"))
    verbs = [json.loads(r.read_text())["verb"] for r in records]
    assert sorted(verbs) == ["exit", "save"]
    save_rec = next(json.loads(r.read_text()) for r in records if "save" in r.name)
    assert save_rec["reason"] == "checkpoint for eval" and save_rec["consumed_iteration"] is not None
    assert Ledger(paths).stopped()["reason"].startswith("exit trigger")


def test_trigger_abort_stops_without_saving(tmp_path: Path) -> None:
    recipe = counter_recipe(tmp_path, training="{train_iters: 100000}", cluster='{time: "00:05:00"}',
                            checkpoint="{save_interval: 100000, save_time_estimate_s: 1}")
    proc = _start(recipe)
    holder: list[RunPaths] = []
    try:
        _wait_for(lambda: _iteration(holder, tmp_path) >= 10, 60, "training to start")
        paths = holder[0]
        assert cli("trigger", "abort", str(paths.root)).returncode == 0
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, proc.stderr  # stopped on purpose, without a save
    assert json.loads(paths.outcome.read_text())["status"] == "aborted"
    assert paths.read_tracker() is None  # nothing saved
    assert "abort" in Ledger(paths).stopped()["reason"]


def test_crash_loop_stops_after_k_segments(tmp_path: Path) -> None:
    recipe = counter_recipe(tmp_path, chain="{max_segments_without_progress: 3, step_time_estimate_s: 0.5, "
                                            "signal_margin_s: 1, min_train_time_s: 5}")
    proc = cli("submit", str(recipe), env={"COUNTER_FAIL": "start"}, timeout=120)
    assert proc.returncode == 1, proc.stderr  # the guard stopped it: an error (tests/unit/test_exit_status.py)
    paths = _run_dir(tmp_path)
    segs = Ledger(paths).segments()
    assert len(segs) == 3 and all(s.ended["outcome"] == "failed" for s in segs)
    st = json.loads(cli("status", str(paths.root), "--json").stdout)
    assert "3 consecutive segments without a new checkpoint" in st["stop_reason"]
    assert st["last_guard"]["decision"] == "stop"


def test_a_hang_before_the_first_iteration_is_killed_and_the_chain_goes_on(tmp_path: Path) -> None:
    """The local backend runs the hang watcher's decision: the first segment never reaches its first
    iteration; 3 s without a sign of life -> stacks (SIGURG), outcome hung, killed; the next one finishes."""
    recipe = counter_recipe(tmp_path, training="{train_iters: 30}", cluster='{time: "00:01:00"}',
                            chain="{step_time_estimate_s: 0.5, signal_margin_s: 1, min_train_time_s: 5, "
                                  "startup_timeout_s: 3}")
    proc = cli("submit", str(recipe), env={"COUNTER_HANG_AT_START": "1", "COUNTER_STEP_S": "0.02"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    paths = _run_dir(tmp_path)
    segs = Ledger(paths).segments()
    assert [s.ended["outcome"] for s in segs] == ["hung", "finished"], [s.ended for s in segs]
    hung = segs[0]
    assert "startup_timeout_s limit 3 s" in hung.ended["reason"] and "last phase: setup_done" in hung.ended["reason"]
    assert hung.ended["time"] - hung.started["time"] < 3 + 15  # not the 60 s time limit
    stacks = (paths.debug / f"stacks-step-job{hung.job_id}-rank0.txt").read_text()
    assert "counter.py" in stacks and "in main" in stacks, stacks
    assert "HUNG" in proc.stdout and "outcome hung" in proc.stdout


def test_cancel_from_another_shell_stops_a_local_chain(tmp_path: Path) -> None:
    """`megalaunch cancel` on a local run: the chain's process kills its running segment (every process
    of each task) and starts no other; the ledger says who cancelled."""
    recipe = counter_recipe(tmp_path, training="{train_iters: 100000}", cluster='{time: "00:05:00"}')
    proc = _start(recipe)
    holder: list[RunPaths] = []
    try:
        _wait_for(lambda: _iteration(holder, tmp_path) >= 10, 60, "training to start")
        paths = holder[0]
        (seg,) = Ledger(paths).segments()
        t0 = time.monotonic()
        cancel = cli("cancel", str(paths.root), timeout=90)
        took = time.monotonic() - t0
        assert cancel.returncode == 0, cancel.stderr
        assert f"cancelled {seg.job_id}" in cancel.stdout, cancel.stdout
        assert took < 15, took  # the segment stopped promptly, not after cancel's 60 s wait
        proc.wait(timeout=30)  # the chain's process ended: it started no other segment
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, proc.stderr  # cancelled: stopped on purpose, without a save
    segs = Ledger(paths).segments()
    assert [s.job_id for s in segs] == [seg.job_id]
    assert Ledger(paths).stopped()["reason"].startswith("cancelled by")
    # a cancel is nobody's node fault: the machine is no suspect (Slurm's path never runs `job end`)
    assert segs[0].ended["outcome"] == "cancelled", segs[0].ended
    assert not [e for e in Ledger(paths).events() if e["event"] == "node_suspected"]
    record = json.loads(paths.task_record(seg.job_id, 0).read_text())
    assert record["signal"] == "SIGTERM"  # the segment's task was stopped as scancel stops it, not left running
    outcome = json.loads(paths.outcome.read_text()) if paths.outcome.exists() else None
    assert outcome is None or outcome["status"] != "saved"  # stopped as scancel stops it: no save on the way out
