"""The controller goes away for a minute in the middle of a chain (issue 12): no segment is cancelled
or counted as failed because of it, and the chain finishes exactly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cluster import queue_ids, start_slurmctld, stop_slurmctld, wait_for
from launch import counter_recipe, ledger, megalaunch, run_dir_of, submitted_ids

OUTAGE_S = 60
# stops the controller: on a cluster of its own, one test at a time (tests/slurm/conftest.py)
pytestmark = pytest.mark.private_cluster("ctld")


def _iteration(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_a_minute_without_slurmctld_costs_the_chain_nothing(slurm_tmp: Path) -> None:
    # 3-min segments get USR2 61-91 s before the limit: ~90-120 s x 20 it/s; 2600 needs 2 segments
    recipe = counter_recipe(slurm_tmp, "outage", training={"train_iters": 2600})
    assert megalaunch(None, "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: len(submitted_ids(run)) >= 2 and _iteration(run) >= 20, 90, what="the first segment to train")
    stop_slurmctld()
    down_at = time.monotonic()
    try:
        before = _iteration(run)
        wait_for(lambda: time.monotonic() - down_at >= OUTAGE_S, OUTAGE_S + 5, interval=1,
                 what=f"{OUTAGE_S} s without the controller")
        assert _iteration(run) > before  # the running step trains on without it
    finally:
        start_slurmctld()
    wait_for(lambda: any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name),
             480, interval=2, what="the chain to finish")
    events = ledger(run)
    ended = [e for e in events if e["event"] == "ended"]
    assert [e["outcome"] for e in ended] == ["saved"] * (len(ended) - 1) + ["finished"], ended
    assert not [e for e in events if e["event"] in ("cancelled", "guard", "successor_not_queued")]
    stopped = [e for e in events if e["event"] == "chain_stopped"]
    assert len(stopped) == 1 and "reached its target" in stopped[0]["reason"]
    state = json.loads((run / "checkpoints" / "iter_0002600" / "state.json").read_text())
    assert state["total"] == sum(range(1, 2601))  # no step lost or repeated
