"""Bad nodes on the real cluster (issue 12): a segment whose ranks die on node2 makes node2 suspect in
the team's node-health ledger; the queued successor excludes it and the chain goes on on node1; once
the suspicion expires, the next successor may use node2 again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cluster import run_as, sbatch, show_job, wait_for
from launch import MEGALAUNCH, counter_recipe, ledger, run_dir_of

REPO = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(REPO / "src")}  # this checkout's code, for the CLI and the jobs it submits
TTL_S = 45
# blocker jobs take whole nodes: on a cluster of their own, one test at a time (tests/slurm/conftest.py)
pytestmark = pytest.mark.private_cluster("nodes")


def cli(tmp: Path, *args: str):  # type: ignore[no-untyped-def]
    return run_as(None, [MEGALAUNCH, *args], {**ENV, "XDG_STATE_HOME": str(tmp / ".state-root")}, cwd=tmp,
                  timeout=120)


def events(run: Path, name: str) -> list[dict]:
    return [e for e in ledger(run) if e["event"] == name]


@pytest.mark.slow
def test_a_bad_node_is_excluded_from_the_successor_and_forgiven_after_expiry(slurm_tmp: Path) -> None:
    health = slurm_tmp / "node-health"
    recipe = counter_recipe(slurm_tmp, "badnode", training={"train_iters": 100000},
                            cluster={"env": {"COUNTER_STEP_S": "0.05", "COUNTER_FAIL_ON_NODE": "node2", **ENV},
                                     "node_health_dir": str(health), "suspect_ttl_h": TTL_S / 3600})
    blocker = sbatch(["-w", "node1", "--exclusive", "-J", "blocker", "-t", "5", "--wrap", "sleep 300"], cwd=slurm_tmp)
    try:
        wait_for(lambda: show_job(blocker).get("JobState") == "RUNNING", 60, what="node1 to be taken")
        proc = cli(slurm_tmp, "submit", str(recipe))
        assert proc.returncode == 0, proc.stderr
        run = run_dir_of(slurm_tmp)
        # the first segment can only run on node2, where every rank dies at start
        wait_for(lambda: events(run, "node_suspected"), 120, interval=1, what="node2 to be suspected")
        (sus,) = events(run, "node_suspected")
        first = sus["job_id"]
        assert sus["node"] == "node2" and "rank 0 on node2 was killed by SIGBUS" in sus["reason"], sus
        wait_for(lambda: events(run, "exclusion"), 60, interval=1, what="the successor's exclusion")
        (exc,) = events(run, "exclusion")
        successor = exc["job_id"]
        assert exc["excluded"] == ["node2"] and successor != first
        assert show_job(successor).get("ExcNodeList") == "node2"  # Slurm holds it, not just the ledger
        st = cli(slurm_tmp, "status", str(run))
        assert f"nodes: suspect node2 after job {first}" in st.stdout and f"job {successor} excludes node2" in st.stdout
        listed = cli(slurm_tmp, "nodes", "--run", str(run))
        assert "node2: first to fail: rank 0 on node2 was killed by SIGBUS" in listed.stdout, listed.stdout
        # the ledger is the team's: a colleague's new chain on this cluster stays off node2 from its first job
        other_root = slurm_tmp / "other"
        other = counter_recipe(slurm_tmp, "other", run={"root": str(other_root)},
                               cluster={"env": {**ENV}, "node_health_dir": str(health)})
        proc = cli(slurm_tmp, "submit", str(other))
        assert proc.returncode == 0 and "node-health ledger: this job excludes node2" in proc.stdout, proc
        (other_run,) = [p for p in other_root.iterdir() if (p / "run.yaml").exists()]
        (first_exc,) = events(other_run, "exclusion")
        assert first_exc["excluded"] == ["node2"] and show_job(first_exc["job_id"]).get("ExcNodeList") == "node2"
        assert cli(slurm_tmp, "cancel", str(other_run)).returncode == 0
        # let the suspicion expire while the successor still waits for node1
        wait_for(lambda: time.time() > sus["expires"] + 1, TTL_S + 30, interval=1, what="the suspicion to expire")
        assert "no suspect nodes" in cli(slurm_tmp, "nodes", "--run", str(run)).stdout
    finally:
        run_as(None, ["scancel", blocker])
    # the successor runs on node1 and trains; the successor it queues excludes nothing any more
    wait_for(lambda: show_job(successor).get("JobState") == "RUNNING", 90, what="the successor to start")
    assert show_job(successor).get("NodeList") == "node1"
    wait_for(lambda: len([e for e in ledger(run) if e["event"] == "submitted"]) >= 3, 60, what="its successor")
    third = [e for e in ledger(run) if e["event"] == "submitted"][-1]["job_id"]
    assert show_job(third).get("ExcNodeList") in ("(null)", "", None)  # node2 is usable again
    assert [e["job_id"] for e in events(run, "exclusion")] == [successor]
    wait_for(lambda: (json.loads((run / "state" / "progress.json").read_text()).get("iteration") or 0) > 0
             if (run / "state" / "progress.json").exists() else False, 90, what="training on node1")
    assert cli(slurm_tmp, "cancel", str(run)).returncode == 0


@pytest.mark.slow
def test_exclusion_never_makes_a_two_node_job_unschedulable(slurm_tmp: Path) -> None:
    health = slurm_tmp / "node-health"
    recipe = counter_recipe(slurm_tmp, "bad2", training={"train_iters": 100000},
                            cluster={"nodes": 2, "env": {"COUNTER_STEP_S": "0.05", "COUNTER_FAIL_ON_NODE": "node2",
                                                         **ENV},
                                     "node_health_dir": str(health)},
                            chain={"max_segments_without_progress": 2})
    proc = cli(slurm_tmp, "submit", str(recipe))
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: any(e["event"] == "chain_stopped" for e in ledger(run)), 240, interval=1,
             what="the crash-loop guard to stop the chain")
    suspects = events(run, "node_suspected")
    assert suspects and {s["node"] for s in suspects} == {"node2"}
    (exc, *_) = events(run, "exclusion")
    assert exc["excluded"] == [] and "fewer than the job's 2 node(s) of the 2 Slurm lists" in exc["kept"]["node2"]
    assert show_job(exc["job_id"]).get("ExcNodeList") in ("(null)", "", None)
    st = cli(slurm_tmp, "status", str(run)).stdout
    assert f"job {exc['job_id']} keeps node2 (excluding it would leave fewer than the job's 2 node(s)" in st
    # every segment still ran (on both nodes): none was left pending for want of nodes
    ended = [e for e in ledger(run) if e["event"] == "ended"]
    assert len(ended) == 2 and all(e["outcome"] == "failed" for e in ended)
