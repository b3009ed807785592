"""Goodput of a real chain (`megalaunch submit`, local backend, the tiny model on 2 CPU ranks): every
segment's components add up to its wall time; a segment whose rank is killed with SIGKILL after its
last checkpoint shows as lost work the training done after that checkpoint (measured independently,
from the metrics the trainer logged), and the next segment redoes it from that checkpoint.

The ranks are forked from the tests' fork server (tests/support/forkserver.py), so the rank to kill is
not found by its command line (a forked one has the server's): rank 0's trainer names its pid in the
segment's heartbeat, and its supervisor's task record shows afterwards that this pid was its command
and died of the SIGKILL. 20 iterations (2 x SAVE_EVERY): the kill lands between iterations 16 and 20
(before the second checkpoint), and the second segment retrains 11..20."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import wait_for
from tests.support import forkserver

from megalaunch.launcher.accounting.goodput import chain_goodput
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

SAVE_EVERY = 10


def _trainer_pid(paths: RunPaths, past: int) -> tuple[str, int] | None:
    """Rank 0's trainer (its segment's job id and pid) once training got `past` that iteration: the pid of
    the segment's heartbeat, which the trainer writes (all but the first beat, `task_start`: the task
    supervisor's)."""
    if (read_json(paths.progress) or {}).get("iteration", 0) < past or not (segments := Ledger(paths).segments()):
        return None
    job = segments[-1].job_id
    beat = read_json(paths.heartbeat(job)) or {}
    return (job, int(beat["pid"])) if beat.get("phase") not in (None, "task_start") else None


@pytest.mark.timeout(600)
def test_parts_add_up_and_a_sigkill_after_the_last_checkpoint_is_lost_work(tmp_path: Path) -> None:
    recipe = {"include": ["tiny"], "name": "goodput", "run": {"root": str(tmp_path / "runs")},
              "cluster": {"tasks_per_node": 2, "time": "00:05:00", "python": forkserver.python(),
                          "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.3", "OMP_NUM_THREADS": "1"}},
              "training": {"train_iters": 2 * SAVE_EVERY, "log_interval": 1},
              "checkpoint": {"save_interval": SAVE_EVERY, "keep_last": 10},
              "chain": {"max_segments_without_progress": 3}}
    path = tmp_path / "goodput.yaml"
    path.write_text(yaml.safe_dump(recipe))
    chain = subprocess.Popen([sys.executable, "-m", "megalaunch.cli.main", "submit", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        run = wait_for(lambda: next((p for p in (tmp_path / "runs").glob("goodput-*")
                                  if (p / "state" / "ledger.jsonl").exists()), None) if (tmp_path / "runs").exists()
                    else None, 120, "the run directory")
        paths = RunPaths(run)
        # past the checkpoint at SAVE_EVERY by 6 iterations, then a SIGKILL to one rank's trainer
        job, pid = wait_for(lambda: _trainer_pid(paths, SAVE_EVERY + 6), 240, "training past the first checkpoint")
        os.kill(pid, signal.SIGKILL)
        out, _ = chain.communicate(timeout=420)
    finally:
        if chain.poll() is None:
            chain.kill()
    assert chain.returncode == 0, out[-3000:]
    segments = Ledger(paths).segments()
    assert [s.outcome for s in segments] == ["failed", "finished"], [s.ended for s in segments]
    # the process killed was rank 0's command (the trainer), as its task supervisor saw it
    record = read_json(paths.task_record(job, 0))
    assert job == segments[0].job_id and record["pid"] == pid and record["signal"] == "SIGKILL", (job, pid, record)
    g = chain_goodput(paths, time.time())
    for seg in g["segments"]:
        assert abs(sum(seg["parts"].values()) - (seg["end"] - seg["start"])) < 1.0, seg
        assert all(v >= 0 for v in seg["parts"].values()), seg
    killed, finished = g["segments"]
    assert killed["last_checkpoint"] == SAVE_EVERY and killed["last_iteration"] >= SAVE_EVERY + 6
    # independently: the training time after the checkpoint, from the trainer's per-iteration metrics
    rows = [r for r in read_jsonl(paths.metrics) if r["job_id"] == killed["job_id"]]
    at_save = next(r["time"] for r in rows if r["iteration"] == SAVE_EVERY)
    save_s = next(e - b for i, b, e in killed["saves"] if i == SAVE_EVERY)
    after = rows[-1]["time"] - at_save - save_s
    assert after > 6 * 0.3 and abs(killed["parts"]["lost_work"] - after) < 1.0, (killed["parts"], after)
    assert killed["parts"]["failed"] > 0 and killed["parts"]["teardown"] == 0
    assert segments[1].start_iteration == SAVE_EVERY  # the lost iterations were redone
    assert finished["parts"]["lost_work"] == 0 and finished["parts"]["productive"] > 0
    assert 0 < g["goodput"] < 1
    status = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "status", str(run)], capture_output=True,
                            text=True, timeout=60)
    assert "goodput so far:" in status.stdout and "lost work" in status.stdout, status.stdout
