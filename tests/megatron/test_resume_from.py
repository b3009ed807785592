"""`megalaunch resume RUN --from ITER` with the real trainer on the local backend, the way a user runs it.

A chain of the tiny model (1 rank, CPU, periodic saves every 10 iterations) is stopped with an exit
trigger once checkpoints 10, 20 and 30 exist. `resume --from 10` then: segment 2 resumes at 10, moves
the newer checkpoints aside as `.abandoned-local-2` (ledger `resume_from`), consumes the request and is
stopped by the local timer's signal (`saved`); segment 3 resumes from segment 2's newest checkpoint, not
from 10 again. Last, a checkpoint whose shard is truncated passes the login node's check (no torch) but
not the job's: that segment ends with a configuration error that stops the chain, the request is
consumed and nothing is moved.

Timing: limit 50 s, lead = save 3 + step 1 + margin 4 = 8 s, so the signal comes 42 s into a segment;
the rank is forked from the tests' fork server (tests/support/forkserver.py: start-up ~3 s, where a fresh
interpreter took 5..20 s, and once, on CI's loaded machine, so long that the first segment's signal came
before checkpoint 30); an iteration is the 0.1 s pacing sleep + ~50 ms. ~2 min in all."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from harness import ledger
from tests.support import forkserver

from megalaunch.rundir.files import read_json
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import checkpoint_iterations, iter_dir

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

CLI = [sys.executable, "-m", "megalaunch.cli.main"]


def _wait[T](fn: Callable[[], T | None], timeout: float, what: str, proc: subprocess.Popen[str]) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := fn()) is not None:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the chain ended before {what}:\n{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _chain(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    return out


def _run(tmp: Path) -> RunPaths | None:
    runs = [p for p in (tmp / "runs").glob("*") if not p.name.startswith(".")]
    return RunPaths(runs[0]) if runs and (runs[0] / "state" / "ledger.jsonl").exists() else None


def _exit_when(paths: RunPaths, ready: Callable[[], bool | None], what: str, proc: subprocess.Popen[str]) -> None:
    _wait(lambda: True if ready() else None, 240, what, proc)
    trigger = _cli("trigger", "exit", str(paths.root), "--reason", "test")
    assert trigger.returncode == 0, trigger.stderr


@pytest.mark.timeout(900)
def test_resume_from_an_older_checkpoint_then_a_refused_one(tmp_path: Path) -> None:
    recipe = {
        "include": ["tiny"], "name": "resumefrom", "run": {"root": str(tmp_path / "runs")},
        "cluster": {"time": "00:00:50", "python": forkserver.python(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.1", "OMP_NUM_THREADS": "1"}},
        "training": {"train_iters": 2000, "log_interval": 1, "micro_batch_size": 2, "global_batch_size": 2},
        "checkpoint": {"save_interval": 10, "save_time_estimate_s": 3, "keep_last": 20},
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 4, "min_train_time_s": 20},
    }
    path = tmp_path / "resumefrom.yaml"
    path.write_text(yaml.safe_dump(recipe))

    # 1. a chain with checkpoints 10, 20, 30 (and the exit trigger's), stopped
    chain = _chain("submit", str(path))
    paths = _wait(lambda: _run(tmp_path), 120, "the run directory", chain)
    _exit_when(paths, lambda: (paths.read_tracker() or 0) >= 30, "checkpoint 30", chain)
    _finish(chain)
    first = checkpoint_iterations(paths)
    assert first[:3] == [10, 20, 30] and Ledger(paths).stopped()["reason"].startswith("exit trigger"), first

    # 2. resume --from 10: segment 2 starts there, segment 3 (after the timer's signal) from segment 2's newest
    chain = _chain("resume", str(paths.root), "--from", "10")
    _exit_when(paths, lambda: len(Ledger(paths).segments()) >= 3 and Ledger(paths).segments()[2].resumed,
               "segment 3 to resume", chain)
    out = _finish(chain)
    newer = ", ".join(map(str, first[1:]))
    assert f"resuming from iteration 10; checkpoints {newer} will be moved aside" in out, out
    (resumed,) = ledger(paths, "chain_resumed")
    assert resumed["from_iteration"] == 10 and resumed["user"]
    one, two, three = Ledger(paths).segments()
    assert [one.job_id, two.job_id, three.job_id] == ["local-1", "local-2", "local-3"]
    (applied,) = ledger(paths, "resume_from")  # once: segment 3 did not apply it again
    assert applied["job_id"] == "local-2" and applied["iteration"] == 10 and applied["abandoned"] == first[1:]
    assert applied["requested_by"] == resumed["user"]
    for it in first[1:]:
        assert (paths.checkpoints / f"iter_{it:07d}.abandoned-local-2").is_dir(), it
    assert not paths.resume_request.exists()
    assert read_json(paths.settled_resume_request("done", "local-2"))["iteration"] == 10
    assert two.started["resume_from"] == 10 and two.start_iteration == 10
    assert two.outcome == "saved", two.ended
    log = paths.segment_log("local-2").read_text(errors="replace")
    assert " iteration       11/" in log and " iteration       31/" in log, log[-3000:]  # retrained from 10
    saved_at = two.ended["checkpoint_iteration"]
    assert saved_at > 10 and three.started["checkpoint_iteration"] == saved_at == three.resumed["iteration"]
    assert three.outcome == "exited"
    status = _cli("status", str(paths.root))
    assert status.returncode == 0 and "resumed from iteration 10 (asked by" in status.stdout, status.stdout

    # 3. a checkpoint the login node passes (no torch: shards present) but the job refuses (truncated shard)
    tracker = paths.read_tracker()
    target = [i for i in checkpoint_iterations(paths) if i < tracker][-1]
    shard = sorted(iter_dir(paths, target).glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    before = checkpoint_iterations(paths)
    refused = _cli("resume", str(paths.root), "--from", str(target))
    assert refused.returncode == 1, refused.stderr  # the chain ended on a configuration error
    assert f"resuming from iteration {target}; checkpoint" in refused.stdout, refused.stdout
    four = Ledger(paths).segments()[3]
    assert four.job_id == "local-4" and four.outcome == "config_error", four.ended
    assert four.start_iteration == tracker and not four.ended["new_checkpoint"], four.ended  # it trained nothing
    reason = Ledger(paths).stopped()["reason"]
    assert reason.startswith(f"configuration error, no retry can fix it: megalaunch resume --from {target} (by "), reason
    assert "megalaunch resume RUN --from one of the complete checkpoints" in Ledger(paths).stopped()["fix"]
    assert f"checkpoint {target} is not usable (truncated shard {shard.name}" in reason, reason
    assert "complete ones: [" in reason and str(tracker) in reason.split("complete ones:")[1], reason
    assert not paths.resume_request.exists() and paths.settled_resume_request("refused", "local-4").exists()
    assert checkpoint_iterations(paths) == before and paths.read_tracker() == tracker  # nothing moved
    (refusal,) = ledger(paths, "resume_refused")
    assert refusal["iteration"] == target and "truncated shard" in refusal["reason"]
