"""The many-node scale cluster (``.ci/slurm-up scale``) and a node that dies as a machine would.

Measured figures are printed (``pytest -s``): kill -> node DOWN, kill -> the old step's srun exits,
kill -> a new step on the survivors prints, with the cluster's SlurmdTimeout and MessageTimeout.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from cluster import TERMINAL_STATES, job_state, run_as, sbatch, show_job, wait_for, wait_job_done
from scale import (
    SCALE_CONF,
    conf_values,
    expand_hostlist,
    kill_node,
    node_processes,
    node_states,
    revive_node,
    scale_nodes,
    wait_node_state,
)

pytestmark = pytest.mark.private_cluster("scale")

USER = "mlalice"


def _wait_all_idle(nodes: list[str], timeout: float = 60) -> None:
    last: dict[str, str] = {}

    def all_idle() -> bool:
        last.clear()
        last.update(node_states(nodes))
        return len(last) == len(nodes) and all(st == "idle" for st in last.values())

    try:
        wait_for(all_idle, timeout, interval=0.3, what=f"all {len(nodes)} nodes idle")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {sorted(f'{n} {st}' for n, st in last.items() if st != 'idle')}") from None


def _steps(job: str) -> dict[str, str]:
    out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-O", "StepId:24,StepState:16"], capture_output=True,
                         text=True, timeout=15, check=False).stdout
    return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)


def _stamp(out: Path, tag: str) -> list[list[str]]:
    """Lines of the job's output starting with *tag* (split)."""
    text = out.read_text() if out.exists() else ""
    return [ln.split() for ln in text.splitlines() if ln.startswith(tag + " ")]


def _settings() -> str:
    conf = conf_values(SCALE_CONF)
    return ", ".join(f"{k}={conf.get(k, 'default')}" for k in ("SlurmdTimeout", "MessageTimeout", "TreeWidth"))


def test_every_node_is_idle_and_runs_a_task(slurm_tmp: Path) -> None:
    nodes = scale_nodes()
    assert len(nodes) >= 2, nodes
    _wait_all_idle(nodes)
    started = time.monotonic()
    res = run_as(USER, ["srun", f"-N{len(nodes)}", "--ntasks-per-node=1", "--job-name=ml-scale-all",
                        "printenv", "SLURMD_NODENAME"], cwd=slurm_tmp, timeout=120)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    names = res.stdout.split()
    assert len(names) == len(nodes) and set(names) == set(nodes), (names, nodes)
    print(f"\nscale: {len(nodes)} idle nodes; srun -N{len(nodes)} (allocation + one task per node) {took:.2f} s")


def _submit_four_node_job(slurm_tmp: Path, step_command: str, after_step: str) -> tuple[str, Path]:
    script = slurm_tmp / "four.sh"
    script.write_text("\n".join([
        "#!/bin/bash",
        f"srun --ntasks-per-node=1 {step_command}",
        'echo "old-step-exit $? $(date +%s.%N)"',
        after_step,
        "",
    ]))
    out = slurm_tmp / "four.out"
    job = sbatch(["--nodes=4", "--ntasks-per-node=1", "--no-kill", "--job-name=ml-scale-kill", f"--output={out}",
                  str(script)], user=USER, cwd=slurm_tmp)
    wait_for(lambda: _steps(job).get(f"{job}.0") == "RUNNING", 60, interval=0.2, what=f"step {job}.0 running")
    # RUNNING to slurmctld is not yet a task on every node: each node's slurmstepd forks its own (CI run: a
    # node killed in between had a slurmstepd and no task)
    nodes = expand_hostlist(show_job(job)["NodeList"])
    wait_for(lambda: all(node_processes(n)[2] for n in nodes), 60, interval=0.2, what=f"step {job}.0's task on each node")
    return job, out


def _revive_and_clean(victim: str, job: str, nodes: list[str]) -> float:
    """Cancel the job when still there, start the victim's slurmd, wait until every node is IDLE again;
    return how long the victim took from its new slurmd to IDLE."""
    if job_state(job) not in TERMINAL_STATES:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        wait_job_done(job, 60)
    started = time.time()
    revive_node(victim)
    _, idle_at = wait_node_state(victim, lambda s: s == "idle", 60, what="idle after revive_node (ReturnToService=2)")
    _wait_all_idle(nodes)
    return idle_at - started


def test_a_dead_node_leaves_the_job_on_the_survivors_and_comes_back(slurm_tmp: Path) -> None:
    """A node of a running 4-node --no-kill job dies (slurmd, slurmstepd's, tasks SIGKILLed): slurmctld
    sets it DOWN, drops it from the job and ends the step; the job runs on and a new step on the three
    survivors starts (run by the job script right after the old srun returned, as megalaunch's in-job
    restart loop does). The node comes back IDLE once its slurmd runs again."""
    nodes = scale_nodes()
    _wait_all_idle(nodes)
    done = slurm_tmp / "checked"
    # After the old step: a new one on the job's nodes now (the survivors), as the restart loop would;
    # then the job lives on until the test has looked at it.
    job, out = _submit_four_node_job(slurm_tmp, "sleep 600", "\n".join([
        'srun -N3 -n3 --ntasks-per-node=1 --nodelist="$(squeue -h -j "$SLURM_JOB_ID" -o %N)" \\',
        """  bash -c 'echo "new-step $(date +%s.%N) $SLURMD_NODENAME"'""",
        'echo "new-step-exit $?"',
        f"until [ -e {done} ]; do sleep 0.2; done",
    ]))
    allocated = expand_hostlist(show_job(job)["NodeList"])
    victim = allocated[-1]  # not the batch host (the first): the job script must live on
    survivors = [n for n in allocated if n != victim]
    try:
        killed = kill_node(victim)
        assert killed.slurmd and killed.stepds and killed.tasks, killed  # its slurmd, step, the task `sleep`
        t0 = killed.killed_at

        _, down_at = wait_node_state(victim, lambda s: s == "down*", 120, what="DOWN (not responding)")
        info = show_job(job)
        assert info["JobState"] == "RUNNING", info
        assert sorted(expand_hostlist(info["NodeList"])) == sorted(survivors), info

        wait_for(lambda: _stamp(out, "new-step-exit"), 120, interval=0.2, what="the new step to end")
        (old_exit,) = _stamp(out, "old-step-exit")
        new_lines = _stamp(out, "new-step")
        assert sorted(ln[2] for ln in new_lines) == sorted(survivors), out.read_text()
        assert _stamp(out, "new-step-exit")[0][1] == "0", out.read_text()
        assert old_exit[1] != "0", out.read_text()  # srun reports the step's failure
        old_exit_at, new_first_at = float(old_exit[2]), min(float(ln[1]) for ln in new_lines)
        assert job_state(job) == "RUNNING"
        done.touch()
        assert wait_job_done(job, 60) == "COMPLETED"
    finally:
        back = _revive_and_clean(victim, job, nodes)
    print(f"\nscale: {_settings()}: {victim} killed ({len(killed.pids)} processes); "
          f"kill -> DOWN {down_at - t0:.1f} s (polled every 0.2 s), "
          f"kill -> old step's srun exits {old_exit_at - t0:.1f} s, "
          f"kill -> new step's first output {new_first_at - t0:.1f} s; "
          f"revived: slurmd start -> idle {back:.2f} s")


def test_a_step_that_ended_on_the_survivors_before_the_node_was_down_blocks_new_steps(slurm_tmp: Path) -> None:
    """Slurm 22.05 behaviour the in-job restart must live with: when the step's tasks on the surviving
    nodes end before slurmctld sets the dead node DOWN (they fail on the lost peer, srun
    --kill-on-bad-exit or `scancel JOB.STEP` kill them), the step stays RUNNING on the dead node for the
    rest of the job, and a new step on the survivors waits for its CPUs/GPUs forever; `--overlap` starts
    it."""
    nodes = scale_nodes()
    _wait_all_idle(nodes)
    flag = slurm_tmp / "peer-lost"
    # Each task fails once the flag exists, as a rank whose collective lost a peer would.
    job, out = _submit_four_node_job(
        slurm_tmp, f"--kill-on-bad-exit=1 bash -c 'until [ -e {flag} ]; do sleep 0.1; done; exit 1'",
        "sleep 600")
    allocated = expand_hostlist(show_job(job)["NodeList"])
    victim = allocated[-1]
    survivors = ",".join(n for n in allocated if n != victim)
    try:
        killed = kill_node(victim)
        flag.touch()
        wait_node_state(victim, lambda s: s == "down*", 120, what="DOWN (not responding)")
        wait_for(lambda: _stamp(out, "old-step-exit"), 60, interval=0.2, what="the old step's srun to exit")
        step = ["srun", f"--jobid={job}", "-N3", "--ntasks-per-node=1", f"--nodelist={survivors}"]
        blocked = run_as(USER, [*step, "-I10", "true"], cwd=slurm_tmp, timeout=60)
        assert blocked.returncode != 0, blocked.stdout
        assert _steps(job).get(f"{job}.0") == "RUNNING", _steps(job)  # still, the survivors long done
        overlap = run_as(USER, [*step, "--overlap", "printenv", "SLURMD_NODENAME"], cwd=slurm_tmp, timeout=60)
        assert overlap.returncode == 0, overlap.stderr
        assert sorted(overlap.stdout.split()) == sorted(survivors.split(",")), overlap.stdout
        print(f"\nscale: step {job}.0 still RUNNING {time.time() - killed.killed_at:.1f} s after the kill; "
              f"without --overlap: {blocked.stderr.strip().splitlines()[-1]!r}; with --overlap it ran")
    finally:
        _revive_and_clean(victim, job, nodes)
