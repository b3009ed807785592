"""Survivors blocked in a real gloo collective are released when a peer's node freezes (issue 50, item 2).

The real trainer (Megatron on CPU, gloo) on two nodes of a private cluster (one test at a time: a frozen node
would stall every other test's jobs). node2 freezes whole (tests/slurm/scale.freeze_node: its slurmd, slurmstepd
and tasks SIGSTOPped, nothing closed): node1's rank blocks in its next gloo collective and would wait for
Megatron's distributed timeout (10 min) and Slurm's node timeout (SlurmdTimeout=60 here, 300 by default).
Asserted: the hang watcher on node1 sees node2's beat stop while node1's goes on (runtime/health/node_beat.py),
names node2 in the segment log and the ledger and cancels the step, and node1's rank (blocked in gloo) has
ended within 45 s of the freeze, long before either timeout. Printed: the times."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest
from cluster import PRIVATE_CONFS, wait_for
from launch import ledger, megalaunch, run_dir_of
from scale import KilledNode, freeze_node, thaw_node
from test_train_slurm import _trainer_pid, train_recipe

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


def _events(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in ledger(run) if e["event"] == name]


def _progress(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@pytest.mark.slow
@pytest.mark.megatron
@needs_megatron
@pytest.mark.private_cluster("nodes")
@pytest.mark.usefixtures("node_names_resolve")
@pytest.mark.timeout(600)
def test_a_frozen_peer_node_releases_the_rank_blocked_in_gloo_within_seconds(slurm_tmp: Path) -> None:
    # fresh interpreters, not the tests' fork server: its forked ranks are no task's descendants, and freezing node2
    # must not stop node1's (scale.node_processes finds a node's processes by their tree and environment)
    recipe = train_recipe(slurm_tmp, "frozen-gloo", step_sleep_s=0.2,
                          training={"train_iters": 100000}, cluster={"nodes": 2, "time": "00:10:00"},
                          checkpoint={"save_interval": 5}, chain={"restarts_per_segment": 0})
    proc = megalaunch(None, "submit", str(recipe), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    frozen: KilledNode | None = None
    try:
        wait_for(lambda: _progress(run) >= 6, 240, what="iteration 6 on both nodes")
        job = str(_events(run, "step_started")[0]["job_id"])
        survivor = _trainer_pid(job, 0)  # rank 0: on node1, the batch host
        assert survivor is not None and b"SLURMD_NODENAME=node1" in Path(f"/proc/{survivor}/environ").read_bytes()
        frozen = freeze_node("node2", PRIVATE_CONFS["nodes"])
        (lost,) = wait_for(lambda: _events(run, "step_nodes_lost"), 90, interval=0.5, what="the watcher's verdict")
        assert lost["nodes"] == ["node2"] and lost["why"][0].startswith("silent for"), lost
        wait_for(lambda: not Path(f"/proc/{survivor}").exists(), 60, interval=0.2, what="rank 0 (node1) to end")
        released = time.time() - frozen.time
        print(f"node2 frozen: the watcher ended the step after {lost['time'] - frozen.time:.1f} s; rank 0 on node1, "
              f"blocked in gloo, gone {released:.1f} s after the freeze")
        assert released <= 45, released
        log = (run / "logs" / f"{run.name}-{job}.out").read_text(errors="replace")
        assert "node lost: node2 (silent for" in log, log[-3000:]
    finally:
        if frozen is not None:
            thaw_node(frozen)
        megalaunch(None, "cancel", str(run))
