"""The health check on the real cluster (issue 12 item 3), with the real trainer (Megatron on the CPU):
a 1-node run whose first segment, on node1, passes the check and records the team's figure for the
device; its successor runs on node2, which the test hook makes 50x slower in the check's matmul: that
segment ends `unhealthy_node` before building the model, node2 goes to the node-health ledger with
the figures, and the next successor excludes it and passes the check on node1.

A 1-node job has no peer to compare with: node2 is judged against the figure healthy checks recorded
(runtime/health/health.py, `Baselines`), which is also how a whole node of slow GPUs is caught."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster import run_as, sbatch, show_job, wait_for
from launch import cli_argv, ledger, run_dir_of, submitted_ids
from test_train_slurm import train_recipe

# a blocker job takes node2: on a cluster of its own, one test at a time (tests/slurm/conftest.py)
pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("node_names_resolve"), pytest.mark.private_cluster("nodes")]
REPO = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(REPO / "src")}  # this checkout's code, for the CLI and the jobs it submits


def megalaunch(*args: str, cwd: Path | None = None):  # type: ignore[no-untyped-def]
    return run_as(None, [*cli_argv(), *args], ENV, cwd=cwd, timeout=120)


def _events(run: Path, name: str, job: str | None = None) -> list[dict]:
    return [e for e in ledger(run) if e["event"] == name and (job is None or e.get("job_id") == job)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_slow_in_the_health_check_is_unhealthy_and_the_successor_excludes_it(slurm_tmp: Path) -> None:
    health = slurm_tmp / "node-health"
    recipe = train_recipe(slurm_tmp, "slownode", training={"train_iters": 1000000}, cluster={
        "time": "00:10:00", "health_check": True, "health_check_margin": 0.9, "node_health_dir": str(health),
        "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.2", "OMP_NUM_THREADS": "1",
                "MEGALAUNCH_TEST_SLOW_NODE": "node2:50", **ENV}})
    # Margin 0.9 with a 50x slower node2: a CPU check on this loaded 2-core machine varies ~4x between
    # segments (CI: node1's own third check was 4.2x below the figure its first recorded, and failed the
    # margin 0.75 that a 20x node2 needed); either side now has that much room
    blocker = sbatch(["-w", "node2", "--exclusive", "-J", "blocker", "-t", "5", "--wrap", "sleep 300"], cwd=slurm_tmp)
    run = None
    try:
        wait_for(lambda: show_job(blocker).get("JobState") == "RUNNING", 60, what="node2 to be taken")
        proc = megalaunch("submit", str(recipe), cwd=slurm_tmp)
        assert proc.returncode == 0, proc.stderr
        run = run_dir_of(slurm_tmp)
        # 1. the first segment (node1) passes the check, records the device's figure and trains
        wait_for(lambda: _events(run, "health_check"), 120, interval=1, what="the first health check")
        (first_check,) = _events(run, "health_check")
        first = first_check["job_id"]
        assert first_check["healthy"] and first_check["ranks"][0]["node"] == "node1", first_check
        assert (health / "health_baselines.jsonl").exists()
        wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor")
        second = submitted_ids(run)[1]
        # 2. its successor is to run on node2 (standing in for the scheduler's choice), then it stops
        run_as(None, ["scancel", blocker])
        assert run_as(None, ["scontrol", "update", f"JobId={second}", "ExcNodeList=node1"]).returncode == 0
        assert run_as(None, ["scancel", "--signal=USR2", first]).returncode == 0
        # 3. node2's check: 50x slower than the recorded figure -> unhealthy_node, suspect, excluded
        wait_for(lambda: _events(run, "ended", second), 150, interval=1, what="the segment on node2 to end")
        (end,) = _events(run, "ended", second)
        assert end["outcome"] == "unhealthy_node" and "node2: rank 0" in end["reason"], end
        assert "below the recorded figure for the device" in end["reason"], end
        (check,) = _events(run, "health_check", second)
        assert check["unhealthy_nodes"] == ["node2"] and check["seconds"] < 30, check
        (sus,) = _events(run, "node_suspected")
        assert sus["node"] == "node2" and sus["reason"].startswith("health check: rank 0 matmul"), sus
        wait_for(lambda: _events(run, "exclusion"), 60, interval=1, what="the successor's exclusion")
        exc = _events(run, "exclusion")[0]  # (the third segment's own successor excludes node2 too)
        third = exc["job_id"]
        assert third == submitted_ids(run)[2], (exc, submitted_ids(run))
        assert exc["excluded"] == ["node2"] and show_job(third).get("ExcNodeList") == "node2", exc
        listed = megalaunch("nodes", "--run", str(run)).stdout
        assert "node2: health check: rank 0 matmul" in listed, listed
        st = megalaunch("status", str(run)).stdout
        assert "UNHEALTHY_NODE" in st and f"health check: job {second}: UNHEALTHY node2" in st, st
        # 4. the next segment runs on node1 and passes the check
        wait_for(lambda: _events(run, "health_check", third), 150, interval=1, what="the third segment's check")
        (last,) = _events(run, "health_check", third)
        assert last["healthy"] and last["ranks"][0]["node"] == "node1", last
        assert show_job(third).get("NodeList") == "node1"
        print(f"health check: node1 {first_check['ranks'][0]['tflops']} TFLOP/s in {first_check['seconds']} s, "
              f"node2 {check['ranks'][0]['tflops']} (reference {check['reference_tflops']}) in {check['seconds']} s")
    finally:
        run_as(None, ["scancel", blocker])
        if run is not None:
            megalaunch("cancel", str(run))
