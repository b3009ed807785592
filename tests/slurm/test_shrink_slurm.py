"""No spare left: shrink (`cluster.min_nodes`, issue 33), with the real CPU trainer (Megatron's loop, gloo)
on the scale cluster (`.ci/slurm-up scale`, tests/slurm/scale.py).

A 4-node chain (one rank per node, global batch 12, micro-batch 1: DP 4, 3 micro-batches per rank)
with `min_nodes: 2` and no spare loses a node hard, mid-step (its slurmd, slurmstepd and trainer SIGKILLed
at once). Asserted: the same job starts a new step on the 3 survivors (DP 3, 4 micro-batches per rank:
Megatron's own arguments table says so) from the newest checkpoint; the records say it (the `restart`
event's `exclude` and `shrink_to`, `step_started`'s `shrunk_from`, `status`); the next segment (after
Slurm's stop signal, sent early with `scancel --signal=USR2` as the time limit would) runs on 4 nodes
again, none of them the dead one; every iteration's loss equals an uninterrupted one-rank run's on the
local backend (relative difference <= 1e-5: fp32, only the order of the sums differs, DP 1 vs 4 vs 3)
and the consumed samples continue exactly (global batch x iteration at every resume).
The same DP change without Slurm, with the distributed optimizer: tests/megatron/test_reshard_resume.py."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import show_job, wait_for
from launch import job_megalaunch, ledger, megalaunch, run_dir_of, submitted_ids, trainer_python
from scale import kill_node, node_state, revive_node, wait_node_state

from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.hostlist import expand_hostlist
from megalaunch.runtime.rank.dist_env import free_port

NODES = 4
MIN_NODES = 2
GBS = 12  # DP 4, 3 and 2 all divide it (micro-batch 1)
ITERS = 40
pytestmark = [
    pytest.mark.slow, pytest.mark.megatron, pytest.mark.private_cluster("scale"),
    pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None,
                       reason="needs torch + megatron-core (the [train] extra)"),
]
DP_LINE = re.compile(r"^\s*data_parallel_size \.+ (\d+)$", re.M)  # Megatron's arguments table (rank 0)


def _recipe(root: Path, loss_log: Path, health: Path | None, **cluster: Any) -> Path:
    recipe: dict[str, Any] = {
        "include": ["tiny"], "name": "shrink", "run": {"root": str(root / "runs")},
        "cluster": {"backend": "slurm", "nodes": NODES, "min_nodes": MIN_NODES, "gpus_per_node": 0,
                    "tasks_per_node": 1, "cpus_per_task": 1, "time": "00:10:00", "python": trainer_python(),
                    "megalaunch": job_megalaunch(), "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.3", "MEGALAUNCH_LOSS_LOG": str(loss_log),
                            "OMP_NUM_THREADS": "1"}, **cluster},
        "training": {"train_iters": ITERS, "log_interval": 1, "micro_batch_size": 1, "global_batch_size": GBS},
        "checkpoint": {"save_interval": 4, "save_time_estimate_s": 5, "keep_last": 20},
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 24, "min_train_time_s": 20, "trigger_interval": 1,
                  "restarts_per_segment": 2, "hang_timeout_s": 300, "startup_timeout_s": 300},
    }
    if health is not None:
        recipe["cluster"]["node_health_dir"] = str(health)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "shrink.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def _events(run: Path, name: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in ledger(run) if e["event"] == name and all(str(e.get(k)) == str(v) for k, v in match.items())]


def _losses(path: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_jsonl(path)} if path.exists() else {}


def _step_log(run: Path, job: str, step: int) -> str:
    """The part of a segment's log that one step of it wrote (steps are separated by the restart marker)."""
    text = (run / "logs" / f"{run.name}-{job}.out").read_text(errors="replace")
    return text.split("megalaunch: in-job restart:")[step] if text.count("megalaunch: in-job restart:") >= step else ""


def _first_iteration_end(run: Path, job: str) -> float | None:
    try:
        value = (json.loads((run / "state" / "timeline" / f"{job}.json").read_text()).get("phases") or {}).get(
            "first_iteration_end")
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _reference(tmp: Path) -> dict[int, float]:
    """The same training, uninterrupted, on one rank of the local backend (DP 1: 12 micro-batches)."""
    loss_log = tmp / "reference.jsonl"
    recipe = _recipe(tmp / "reference", loss_log, None, backend="local", nodes=1, min_nodes=None)
    proc = megalaunch(None, "submit", str(recipe), cwd=tmp / "reference")
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(tmp / "reference")
    wait_for(lambda: _events(run, "chain_stopped"), 300, interval=0.5, what="the reference run")
    losses = _losses(loss_log)
    assert sorted(losses) == list(range(1, ITERS + 1)), (sorted(losses), _events(run, "chain_stopped"))
    return losses


@pytest.mark.timeout(900)
def test_a_chain_with_min_nodes_loses_a_node_goes_on_smaller_and_grows_back(slurm_tmp: Path) -> None:
    reference = _reference(slurm_tmp)
    health = slurm_tmp / "node-health"
    health.mkdir(mode=0o2777)
    loss_log = slurm_tmp / "chain.jsonl"
    proc = megalaunch(None, "submit", str(_recipe(slurm_tmp / "chain", loss_log, health)), cwd=slurm_tmp / "chain")
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp / "chain")
    script = (run / "job.sbatch").read_text()
    assert f"#SBATCH --nodes={NODES}\n" in script and "#SBATCH --no-kill\n" in script
    victim = None
    try:
        first = wait_for(lambda: _events(run, "step_started"), 180, interval=0.5, what="the first step")[0]
        job = str(first["job_id"])
        nodes = expand_hostlist(first["nodes"])
        assert len(nodes) == NODES and first["node_count"] == NODES and "shrunk_from" not in first, first
        # a checkpoint to resume from, then the node dies (not the batch host: its death ends the job)
        wait_for(lambda: max(_losses(loss_log), default=0) >= 6, 180, interval=0.5, what="6 iterations")
        victim = nodes[-1]
        killed = kill_node(victim)
        restart = wait_for(lambda: _events(run, "restart", job_id=job), 240, interval=0.5,
                           what=f"the restart after {victim} died")[0]
        assert restart["exclude"] == [victim] and restart["shrink_to"] == NODES - 1, restart
        assert restart["first_failure"]["node"] == victim, restart
        started = wait_for(lambda: _events(run, "step_started", job_id=job, step=1), 60, interval=0.5,
                           what="the smaller step")[0]
        smaller = expand_hostlist(started["nodes"])
        assert len(smaller) == NODES - 1 and victim not in smaller and started["shrunk_from"] == NODES, started
        resumed_at = restart["checkpoint_iteration"]
        first = wait_for(lambda: _first_iteration_end(run, job), 240, interval=0.5, what="the smaller step's first iteration")
        took = {"decided": restart["time"] - killed.time, "first_iteration": first - killed.time}
        wait_for(lambda: max(_losses(loss_log), default=0) >= resumed_at + 4, 240, interval=0.5,
                 what="the smaller step to train")
        dp = DP_LINE.findall(_step_log(run, job, 1))
        assert dp == [str(NODES - 1)], dp
        st = megalaunch(None, "status", str(run))
        assert st.returncode == 0 and f"kept off {victim}" in st.stdout and f"went on with {NODES - 1} nodes" in st.stdout, st.stdout
        # Slurm's time-limit warning, early: the segment saves and ends; its successor runs on 4 nodes again
        assert subprocess.run(["scancel", "--signal=USR2", job], timeout=30).returncode == 0
        wait_for(lambda: _events(run, "chain_stopped"), 420, interval=1, what="the chain to finish")
        # logging.rank_output: failing (the default): the clean, stopped step logged the lines of rank 0 and of
        # the last rank (2: Megatron's iteration lines), and rank 1's only under the header of a rank that
        # reported itself slow (2 cores: 3 trainers may well be)
        step1 = _step_log(run, job, 1)
        said = set(re.findall(r"\[megalaunch rank (\d+)\]", step1))
        slow = set(re.findall(r"\[megalaunch task\] rank (\d+)'s output \(it reported itself slow", step1))
        assert {"0", "2"} <= said and said - slow == {"0", "2"}, (said, slow)
        # the step that lost the node: the first survivor to fail wrote its held output under a header
        assert re.search(r"\[megalaunch task\] rank [1-3]'s output \(", _step_log(run, job, 0))
        ends = _events(run, "ended")
        assert ends[0]["outcome"] == "saved" and ends[-1]["outcome"] == "finished", ends
        later = [e for e in _events(run, "step_started") if str(e["job_id"]) != job]
        assert later and all(e["node_count"] == NODES and victim not in expand_hostlist(e["nodes"]) for e in later), later
        successor = str(later[0]["job_id"])
        assert victim in expand_hostlist(show_job(successor).get("ExcNodeList") or victim), show_job(successor)
        assert DP_LINE.findall(_step_log(run, successor, 0)) == [str(NODES)]
    finally:
        megalaunch(None, "cancel", str(run))
        if victim is not None:  # the next test finds every node up
            if node_state(victim).startswith(("down", "drain")) or node_state(victim).endswith("*"):
                revive_node(victim)
            wait_node_state(victim, lambda s: not s.endswith("*") and not s.startswith(("down", "drain")), 60,
                            what=f"{victim} back")
    # exact: every iteration's loss as the uninterrupted run's; consumed samples continue at every resume
    got = _losses(loss_log)
    assert sorted(got) == list(range(1, ITERS + 1)), sorted(got)
    worst = max(abs(got[i] - reference[i]) / abs(reference[i]) for i in reference)
    assert worst <= 1e-5, {i: (reference[i], got[i]) for i in reference
                           if not math.isclose(reference[i], got[i], rel_tol=1e-5)}
    resumed = _events(run, "resumed")
    assert len(resumed) >= 2 and all(r["consumed_samples"] == GBS * r["iteration"] for r in resumed), resumed
    print(f"shrink: {victim} lost; restart decided {took['decided']:.1f} s after the kill, step 1 on {NODES - 1} nodes "
          f"from checkpoint {resumed_at}, its first iteration {took['first_iteration']:.1f} s after the kill; "
          f"next segment on {NODES}; worst loss difference {worst:.1e} over {ITERS} iterations; "
          f"jobs {json.dumps(submitted_ids(run))}")
