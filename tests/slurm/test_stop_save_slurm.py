"""One save per stop on the real cluster (docs/training.md, "The signal lead"): the stop signal reaches
the job step (`scancel --signal=USR2 JOB`, what `--signal` does without `B:`) while the counter
workload's periodic save is writing (MEGALAUNCH_TEST_SAVE_DELAY_S makes it 20 s). The segment keeps that
one checkpoint, writes no second one, and exits right after it, within the lead; the successor queued
at `job begin` resumes there and finishes."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from cluster import queue_ids, wait_for, wait_job_done
from launch import counter_recipe, ledger, megalaunch, run_dir_of, submitted_ids

SAVE_AT = 100


def _log(run: Path, job: str) -> str:
    logs = list((run / "logs").glob(f"*-{job}.out"))
    return logs[0].read_text(errors="replace") if logs else ""


@pytest.mark.slow
def test_a_signal_during_a_slow_save_costs_one_save(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "stopsave", training={"train_iters": 150},
                            checkpoint={"save_interval": SAVE_AT, "save_time_estimate_s": 25},
                            cluster={"time": "00:10:00", "env": {"COUNTER_STEP_S": "0.05",
                                                                 "MEGALAUNCH_TEST_SAVE_DELAY_S": "20:periodic"}})
    proc = megalaunch(None, "submit", str(recipe), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    first = submitted_ids(run)[0]
    wait_for(lambda: f"saving checkpoint at iteration {SAVE_AT} (periodic)" in _log(run, first), 90,
             interval=0.2, what="the slow periodic save")
    sent = time.time()
    signalled = subprocess.run(["scancel", "--signal=USR2", first], capture_output=True, text=True, timeout=30)
    assert signalled.returncode == 0, signalled.stderr
    assert wait_job_done(first, 90) == "COMPLETED"  # it left by itself, long before its limit
    wait_for(lambda: any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name),
             120, interval=1, what="the chain to finish")
    log = _log(run, first)
    assert re.findall(r"saved checkpoint at iteration (\d+)", log) == [str(SAVE_AT)], log[-2000:]
    assert "stop signal: saved and exiting at iteration 100" in log
    ended = [e for e in ledger(run) if e["event"] == "ended"]
    assert [(e["outcome"], e["checkpoint_iteration"]) for e in ended] == [("saved", SAVE_AT), ("finished", 150)]
    started = [e for e in ledger(run) if e["event"] == "started"]
    assert started[1]["checkpoint_iteration"] == SAVE_AT  # the successor resumed there
    timeline = json.loads((run / "state" / "timeline" / f"{first}.json").read_text())
    assert [s[0] for s in timeline["saves"]] == [SAVE_AT]
    exit_at, save_end = timeline["phases"]["exit"], timeline["saves"][0][2]
    lead = 25 + 0.5 + 30 + 29  # the rendered lead: save + step + Slurm's check period + margin
    assert exit_at - sent < lead and exit_at - save_end < 2.0, (exit_at - sent, exit_at - save_end)
    state = json.loads((run / "checkpoints" / "iter_0000150" / "state.json").read_text())
    assert state["total"] == sum(range(1, 151))  # no step lost or repeated
