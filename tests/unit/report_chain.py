"""A real chain run directory for the report's tests, in seconds and without Megatron: the counter
workload (tests/workloads/counter.py, which keeps a timeline and the metrics as the trainer does) on
the local backend, three segments that end three ways:

  1  failed  crashes at CRASH_AT (COUNTER_CRASH_ONCE), after saves at 0 (a `trigger save`), 20 and 40:
             the iterations after 40 are lost work
  2  saved   resumes at 40, trains until the local timer's stop signal, saves
  3  finished  resumes there and reaches TRAIN_ITERS

On a loaded machine the counter steps slower than the timer assumes and a third `saved` segment comes before
the finished one (seen in CI): the tests accept failed, saved..., finished."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.unit.helpers import REPO, counter_recipe

from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import TriggerBox

#: the tests that read the chain (the `report_chain` fixture, tests/unit/conftest.py) run on one worker, which builds it once
REPORT_CHAIN_GROUP = pytest.mark.xdist_group("report-chain")
TRAIN_ITERS = 260
CRASH_AT = 50
TRIGGER_REASON = "eval <b>checkpoint</b> & more"  # markup on purpose: the report must escape it


def build_chain(tmp: Path) -> RunPaths:
    recipe = counter_recipe(tmp, name="rep", training=f"{{train_iters: {TRAIN_ITERS}}}")
    env = {**os.environ, "COUNTER_STEP_S": "0.04", "COUNTER_SAVE_S": "0.2", "COUNTER_CRASH_ONCE": str(CRASH_AT)}
    proc = subprocess.Popen([sys.executable, "-m", "megalaunch.cli.main", "submit", str(recipe)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:  # a save trigger as soon as the run directory exists: the job acts on it at once
            runs = [p for p in (tmp / "runs").glob("rep-*") if (p / "triggers").is_dir()]
            if runs:
                break
            assert time.monotonic() < deadline and proc.poll() is None, "no run directory"
            time.sleep(0.05)
        paths = RunPaths(runs[0])
        TriggerBox(paths).write("save", TRIGGER_REASON)
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    return paths
