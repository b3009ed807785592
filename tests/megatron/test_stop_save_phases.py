"""Honest phases of a real chain (`megalaunch submit`, local backend, the tiny model on one CPU rank):
an `exit` trigger's stop save, asynchronous as on a GPU (MEGALAUNCH_TEST_CPU_ASYNC_SAVE) and with its
writer slowed (MEGALAUNCH_TEST_SAVE_DELAY_S), is `checkpoint_save` in the segment's goodput from the
decision to the complete checkpoint, and `exit` holds only what follows (docs/goodput.md). The wait
for it once happened after the loop, under `exit`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import wait_for
from tests.support import forkserver

from megalaunch.launcher.accounting.goodput import chain_goodput
from megalaunch.rundir.files import read_json
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

DELAY_S = 6.0
CLI = [sys.executable, "-m", "megalaunch.cli.main"]


@pytest.mark.timeout(300)
def test_a_slow_stop_save_is_checkpoint_save_not_exit(tmp_path: Path) -> None:
    recipe = {"include": ["tiny"], "name": "phases", "run": {"root": str(tmp_path / "runs")},
              "cluster": {"tasks_per_node": 1, "time": "00:10:00", "python": forkserver.python(),
                          "env": {"MEGALAUNCH_TEST_SAVE_DELAY_S": f"{DELAY_S:g}:stop", "OMP_NUM_THREADS": "1",
                                  "MEGALAUNCH_TEST_CPU_ASYNC_SAVE": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": "0.05"}},
              "training": {"train_iters": 100000, "log_interval": 1, "micro_batch_size": 2, "global_batch_size": 2},
              "checkpoint": {"save_interval": 100000, "save_time_estimate_s": 30},
              "megatron_args": {"async_save": True, "use_persistent_ckpt_worker": True, "async_strategy": "mcore"}}
    path = tmp_path / "phases.yaml"
    path.write_text(yaml.safe_dump(recipe))
    chain = subprocess.Popen([*CLI, "submit", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, stdin=subprocess.DEVNULL)
    try:
        run = wait_for(lambda: next((p for p in (tmp_path / "runs").glob("phases-*")
                                     if (p / "state" / "ledger.jsonl").exists()), None)
                       if (tmp_path / "runs").exists() else None, 120, "the run directory")
        paths = RunPaths(run)
        wait_for(lambda: (read_json(paths.progress) or {}).get("iteration", 0) >= 2, 240, "two iterations")
        trigger = subprocess.run([*CLI, "trigger", "exit", str(run), "--reason", "test"], capture_output=True,
                                 text=True, timeout=60)
        assert trigger.returncode == 0, trigger.stdout + trigger.stderr
        out, _ = chain.communicate(timeout=240)
    finally:
        if chain.poll() is None:
            chain.kill()
    assert chain.returncode == 0, out[-3000:]
    (segment,) = Ledger(paths).segments()
    assert segment.outcome == "exited", segment.ended
    (seg,) = chain_goodput(paths, time.time())["segments"]
    parts = seg["parts"]
    shown = " ".join(f"{k}={v:.2f}" for k, v in parts.items() if v)
    assert abs(sum(parts.values()) - (seg["end"] - seg["start"])) < 1.0, shown
    # the slowed stop save is save time, from the decision to the complete checkpoint; exit is what follows
    assert parts["checkpoint_save"] >= DELAY_S and parts["exit"] < DELAY_S, shown
    ((iteration, begin, end),) = seg["saves"]
    timeline = read_json(paths.timeline(seg["job_id"]))
    assert isinstance(timeline, dict)
    assert end - begin >= DELAY_S and end >= timeline["writes"][-1][2] - 1e-6, (seg["saves"], timeline["writes"])
