"""A node that freezes (issue 50), on the scale cluster with Slurm's default node timeouts.

A machine that loses power or its network closes no socket: its peers block in their collective and never
exit, and Slurm declares the node DOWN only after `SlurmdTimeout` (300 s by default) and its pings (477 s
measured). scale.freeze_node SIGSTOPs every process of a node (slurmd, its slurmstepd's, its tasks) and leaves
them so. Asserted, with SlurmdTimeout=300 / MessageTimeout=10 (scale.slurm_default_timeouts):
- a frozen node that is not the batch host: the hang watcher sees its beat stop while the others beat
  (runtime/health/node_beat.py), records it, cancels the step; the spare takes its place and the new step
  trains within 60 s of the freeze, while Slurm still counts the node in the job;
- then the batch host freezes (the job script, srun and the watcher with it): the keeper on the last node sees
  its beat stop, records the segment ended with its batch host lost and cancels the job; the successor
  trains within 120 s of the freeze, without either frozen node.
The training step is the stand-in trainer (runtime/standin.py: the real entry, task supervisor, decisions,
checkpoints and heartbeat over a TCP group, which blocks on a frozen peer as gloo and NCCL do). Printed: the
times (docs/scale.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import job_state, show_job, wait_for
from launch import MEGALAUNCH, PYTHON, ledger, megalaunch, run_dir_of, submitted_ids
from scale import (
    KilledNode,
    freeze_node,
    node_state,
    settle,
    slurm_default_timeouts,
    slurm_timeouts,
    thaw_node,
)

from megalaunch.rundir.hostlist import expand_hostlist
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.dist_env import free_port

NODES = 8
SPARES = 2
pytestmark = [pytest.mark.slow, pytest.mark.private_cluster("scale")]


def _recipe(tmp: Path, health: Path) -> Path:
    recipe: dict[str, Any] = {
        "include": ["tiny"], "name": "frozen8", "run": {"root": str(tmp / "runs")},
        "cluster": {"backend": "slurm", "nodes": NODES, "spare_nodes": SPARES, "gpus_per_node": 0,
                    "tasks_per_node": 1, "cpus_per_task": 1, "time": "00:15:00", "python": PYTHON,
                    "megalaunch": MEGALAUNCH, "master_port": free_port(), "node_health_dir": str(health),
                    "env": {"MEGALAUNCH_TEST_STAND_IN": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": "0.5",
                            "PYTHONDONTWRITEBYTECODE": "", "OMP_NUM_THREADS": "1"}},
        "training": {"train_iters": 100000, "log_interval": 10, "micro_batch_size": 1, "global_batch_size": NODES},
        "checkpoint": {"save_interval": 20, "save_time_estimate_s": 1, "keep_last": 3},
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 29, "min_train_time_s": 20, "trigger_interval": 1,
                  "restarts_per_segment": 3, "hang_timeout_s": 300, "startup_timeout_s": 300},
    }
    path = tmp / "frozen8.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def _events(run: Path, name: str, job: str | None = None) -> list[dict[str, Any]]:
    return [e for e in ledger(run) if e["event"] == name and (job is None or str(e.get("job_id")) == job)]


def _progress(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text()).get("iteration") or 0)
    except (OSError, ValueError):
        return 0


def _trained_after(run: Path, job: str, t: float) -> float | None:
    """When job's newest step ended its first iteration, if after `t` (its timeline, time.time())."""
    try:
        phases = json.loads((run / "state" / "timeline" / f"{job}.json").read_text()).get("phases") or {}
    except (OSError, ValueError):
        return None
    value = phases.get("first_iteration_end")
    return float(value) if isinstance(value, (int, float)) and value > t else None


def _freeze_a_node(run: Path, job: str, victim: str, frozen: list[KilledNode]) -> float:
    before = _progress(run)
    wait_for(lambda: _progress(run) >= before + 5, 120, interval=0.5, what="step 0 to train")
    frozen.append(node := freeze_node(victim))
    (lost,) = wait_for(lambda: _events(run, "step_nodes_lost", job), 120, interval=0.5, what="the watcher's verdict")
    assert lost["nodes"] == [victim] and lost["why"][0].startswith("silent for"), lost
    first = wait_for(lambda: _trained_after(run, job, node.time), 120, interval=0.5, what="the new step to train")
    (started,) = [e for e in _events(run, "step_started", job) if e["step"] == 1]
    assert victim not in expand_hostlist(started["nodes"]) and len(expand_hostlist(started["nodes"])) == NODES
    assert not node_state(victim).startswith(("down", "drain")), node_state(victim)  # Slurm has not noticed
    print(f"{victim} frozen: the watcher ended the step after {lost['time'] - node.time:.1f} s, the new step on "
          f"{started['nodes']} trained {first - node.time:.1f} s after the freeze (Slurm: {node_state(victim)})")
    return first - node.time


def _freeze_the_batch_host(run: Path, job: str, host: str, frozen: list[KilledNode]) -> float:
    wait_for(lambda: RunPaths(run).read_tracker(), 120, interval=0.5, what="a checkpoint of the segment")
    successor = [j for j in submitted_ids(run) if j != job][-1]
    frozen.append(node := freeze_node(host))
    state = wait_for(lambda: (s := job_state(job)) not in ("RUNNING",) and s, 120, interval=0.5,
                     what=f"job {job} to end after its batch host froze")
    (ended,) = _events(run, "ended", job)
    assert ended["lost_nodes"] == [host] and "silent for" in ended["reason"], ended
    print(f"batch host {host} frozen: job {job} {state} after {ended['time'] - node.time:.1f} s (keeper)")
    first = wait_for(lambda: _trained_after(run, successor, node.time), 150, interval=0.5,
                     what=f"the successor {successor} to train")
    (step,) = [e for e in _events(run, "step_started", successor) if e["step"] == 0]
    assert not {n.name for n in frozen} & set(expand_hostlist(step["nodes"])), step
    print(f"successor {successor} trained {first - node.time:.1f} s after the batch host froze, on {step['nodes']}")
    return first - node.time


@pytest.mark.timeout(900)
def test_a_frozen_node_and_a_frozen_batch_host_are_replaced_without_waiting_for_slurm(slurm_tmp: Path) -> None:
    health = slurm_tmp / "node-health"
    health.mkdir(mode=0o2777)
    frozen: list[KilledNode] = []
    run: Path | None = None
    try:
        with slurm_default_timeouts():
            assert slurm_timeouts() == {"SlurmdTimeout": "300", "MessageTimeout": "10"}, slurm_timeouts()
            proc = megalaunch(None, "submit", str(_recipe(slurm_tmp, health)), cwd=slurm_tmp)
            assert proc.returncode == 0, proc.stderr
            run = run_dir_of(slurm_tmp)
            first_step = wait_for(lambda: _events(run, "step_started"), 180, interval=0.5, what="the first step")[0]
            job = str(first_step["job_id"])
            allocated = expand_hostlist(show_job(job)["NodeList"])
            node_s = _freeze_a_node(run, job, expand_hostlist(first_step["nodes"])[-1], frozen)
            host_s = _freeze_the_batch_host(run, job, allocated[0], frozen)
    finally:
        if run is not None:
            megalaunch(None, "cancel", str(run))
        for node in frozen:  # the next test finds every node up
            thaw_node(node)
        # thawed, a node answers again (ReturnToService=2 brings it back from DOWN); the drains Slurm adds a
        # minute after the batch host's job was cancelled ("Kill task failed", docs/scale.md) are resumed
        resumed = settle()
        if resumed:
            print(f"resumed Slurm's 'Kill task failed' drains: {', '.join(sorted(set(resumed)))}")
    assert node_s <= 60, node_s
    assert host_s <= 120, host_s
