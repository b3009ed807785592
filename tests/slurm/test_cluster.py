"""Honest checks of the local Slurm cluster itself (what megalaunch's Slurm tests rely on)."""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from cluster import job_state, queue_ids, run_as, sbatch, wait_for, wait_job_done

NODES = {"node1", "node2"}


def _node_info() -> dict[str, tuple[str, str]]:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %T %G"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    info = {}
    for line in out.splitlines():
        node, state, gres = line.split()
        info[node] = (state, gres)
    return info


def test_two_responding_nodes_with_four_gpus() -> None:
    # Jobs of an earlier test may still be running: a node counts when it responds (no "*" flag).
    info = wait_for(
        lambda: (i := _node_info()) and all(s in ("idle", "mixed", "allocated", "completing") for s, _ in i.values()) and i,
        timeout=60,
        what="both nodes responding",
    )
    assert set(info) == NODES
    assert all(gres.startswith("gpu:4") for _, gres in info.values()), info


def test_two_node_job_runs_four_tasks(slurm_tmp: Path) -> None:
    script = slurm_tmp / "tasks.sh"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/bash
            srun bash -c 'echo "task $SLURM_PROCID $SLURMD_NODENAME"'
            """
        )
    )
    job = sbatch(
        ["--nodes=2", "--ntasks-per-node=2", "--job-name=ml-tasks", "--output=%x-%j.out", str(script)],
        user="mlalice",
        cwd=slurm_tmp,
    )
    assert wait_job_done(job, timeout=60) == "COMPLETED"
    lines = [ln.split() for ln in (slurm_tmp / f"ml-tasks-{job}.out").read_text().splitlines()]
    tasks = [ln for ln in lines if ln and ln[0] == "task"]
    assert sorted(int(t[1]) for t in tasks) == [0, 1, 2, 3], lines
    assert {t[2] for t in tasks} == NODES, lines


def test_gpus_per_node_sets_cuda_visible_devices(slurm_tmp: Path) -> None:
    job = sbatch(
        ["--gpus-per-node=4", "--output=gpu-%j.out", "--wrap", 'echo "CVD=$CUDA_VISIBLE_DEVICES"'],
        user="mlbob",
        cwd=slurm_tmp,
    )
    assert wait_job_done(job, timeout=60) == "COMPLETED"
    out = (slurm_tmp / f"gpu-{job}.out").read_text()
    cvd = next(ln for ln in out.splitlines() if ln.startswith("CVD="))[4:]
    devices = cvd.split(",")
    assert len(devices) == 4 and len(set(devices)) == 4, out

    # More GPUs than a node has is refused at submission.
    res = run_as("mlbob", ["sbatch", "--gpus-per-node=5", "--wrap", "true"], cwd=slurm_tmp)
    assert res.returncode != 0, res.stdout


def test_other_user_cannot_cancel(slurm_tmp: Path) -> None:
    job = sbatch(
        ["--job-name=ml-alice-sleep", "--output=/dev/null", "--wrap", "sleep 300"],
        user="mlalice",
        cwd=slurm_tmp,
    )
    try:
        assert job in queue_ids(name="ml-alice-sleep")
        wait_for(lambda: job_state(job) == "RUNNING", timeout=30, what=f"job {job} running")
        res = run_as("mlbob", ["scancel", job], cwd=slurm_tmp)
        assert "Access/permission denied" in res.stderr, (res.returncode, res.stderr)
        time.sleep(1)
        assert job_state(job) == "RUNNING"
        # ... but the owner can.
        res = run_as("mlalice", ["scancel", job], cwd=slurm_tmp)
        assert res.returncode == 0, res.stderr
        assert wait_job_done(job, timeout=30) == "CANCELLED"
    finally:
        subprocess.run(["scancel", job], check=False)


SIG_TASK = """\
import signal, sys, time
out = sys.argv[1]
start = time.time()
open(out + ".started", "w").write(f"{start}\\n")

def on_usr2(signum, frame):
    open(out, "w").write(f"{time.time() - start:.1f}\\n")
    sys.exit(0)

signal.signal(signal.SIGUSR2, on_usr2)
while True:
    time.sleep(0.2)
"""


@pytest.mark.slow
def test_signal_warning_reaches_srun_task_before_limit(slurm_tmp: Path) -> None:
    (slurm_tmp / "sig.py").write_text(SIG_TASK)
    (slurm_tmp / "sig.sh").write_text(
        f"#!/bin/bash\nsrun /usr/bin/python3 -u {slurm_tmp}/sig.py {slurm_tmp}/usr2.txt\n"
    )
    job = sbatch(
        ["--time=2", "--signal=USR2@60", "--output=sig-%j.out", str(slurm_tmp / "sig.sh")],
        user="mlalice",
        cwd=slurm_tmp,
    )
    try:
        got = slurm_tmp / "usr2.txt"
        # Expected 60-90 s before the 120 s limit, i.e. 30-60 s after start (ctld checks every 30 s).
        text = wait_for(
            lambda: got.exists() and got.read_text().strip(),
            timeout=150,
            interval=1,
            what="USR2 in the srun task",
        )
        elapsed = float(text)
        assert elapsed < 100, f"USR2 came {elapsed} s after start, too close to the 120 s limit"
        assert wait_job_done(job, timeout=30) == "COMPLETED"
    finally:
        subprocess.run(["scancel", job], check=False)
