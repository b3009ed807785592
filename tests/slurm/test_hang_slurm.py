"""The hang killer outside Python (runtime/hangwatch.py) on the real cluster with the real trainer
(Megatron on the CPU over gloo): rank 1 on node2 never joins the rendezvous in the first segment, so
rank 0 waits in it forever. The job script's watcher sees rank 0's heartbeat stay silent for
chain.startup_timeout_s, gathers every rank's Python stacks, writes outcome `hung` and kills the step;
the allocation is released long before the 10-minute time limit and the next segment trains to the end."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
from cluster import show_job, wait_for, wait_job_done
from launch import ledger, megalaunch, run_dir_of, submitted_ids
from test_train_slurm import _chain_done, _events, _tail, train_recipe

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None,
                       reason="needs torch + megatron-core (the [train] extra)"),
]

STARTUP_TIMEOUT_S = 20
STEP_SLEEP_S = 1.0  # the finishing segment's 3 iterations
# the watcher looks every 2 s (startup limit / 10), then waits 5 s for the stacks: it acts within
# ~7 s of the limit (a busy 2-core machine: allow 25 s)
SLACK_S = 25
# from the kill to `job end`'s record: srun's exit after the step is killed, then the job script's
# `job step-end` and `job end` (a CI run of 2026-11-29 on a busy machine: > 13 s)
TEARDOWN_S = 45
TIME_LIMIT_S = 600


def _runtime_s(text: str) -> int:
    """Slurm's RunTime ([D-]HH:MM:SS) in seconds."""
    days, _, hms = text.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


@pytest.mark.timeout(300)
def test_rendezvous_that_never_completes_is_killed_and_the_chain_continues(slurm_tmp: Path) -> None:
    recipe = train_recipe(
        slurm_tmp, "hang", step_sleep_s=0, training={"train_iters": 3, "lr_warmup_iters": 1},
        cluster={"nodes": 2, "time": "00:10:00",
                 "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": str(STEP_SLEEP_S), "OMP_NUM_THREADS": "1",
                         "MEGALAUNCH_TEST_RENDEZVOUS_HANG": "1"}},
        chain={"startup_timeout_s": STARTUP_TIMEOUT_S})
    t0 = time.monotonic()
    proc = megalaunch(None, "submit", str(recipe), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    try:
        wait_for(lambda: _chain_done(run), 240, interval=1, what="the chain to finish")
    finally:
        if not _chain_done(run):
            megalaunch(None, "cancel", str(run), cwd=slurm_tmp)
    took = time.monotonic() - t0
    first = submitted_ids(run)[0]
    ended = _events(run, "ended")
    assert [e["outcome"] for e in ended] == ["hung", "finished"], [(e["job_id"], e["outcome"]) for e in ended] \
        + [_tail(run, first)]
    hung = ended[0]
    assert hung["job_id"] == first
    assert "startup_timeout_s limit 20 s" in hung["reason"] and "rendezvous" in hung["reason"], hung
    assert hung["new_checkpoint"] is False  # counts against the crash-loop budget

    # killed within the limit + slack of rank 0's last sign of life (it entered the rendezvous)
    timeline = json.loads((run / "state" / "timeline" / f"{first}.json").read_text())
    last_beat = timeline["phases"]["setup_done"]
    (killed,) = [e for e in ledger(run) if e["event"] == "hang_killed"]
    assert STARTUP_TIMEOUT_S <= killed["time"] - last_beat <= STARTUP_TIMEOUT_S + SLACK_S, (killed, last_beat)
    assert 0 <= hung["time"] - killed["time"] <= TEARDOWN_S, (hung, killed)

    # the allocation was released long before the time limit: the job script ran `job end` and exited
    assert wait_job_done(first, 30) == "COMPLETED"
    runtime = _runtime_s(show_job(first)["RunTime"])
    assert runtime < TIME_LIMIT_S / 4, runtime

    # every rank's Python stacks: rank 0 waiting in the rendezvous, rank 1 in the test hook
    stacks = {r: run / "debug" / f"stacks-step-job{first}-rank{r}.txt" for r in (0, 1)}
    text = {r: p.read_text() if p.exists() else "" for r, p in stacks.items()}
    assert "maybe_skip_rendezvous" in text[1], text[1] or "no stacks from rank 1"  # runtime/rank/fault_hooks.py
    assert re.search(r"init_process_group|initialize_megatron|_initialize_distributed", text[0]), text[0]
    assert set(killed["stacks"]) >= {str(p) for p in stacks.values()}, killed
    assert "stacks:" in hung["reason"]
    second = ended[1]["job_id"]  # a healthy segment leaves no (empty) stacks file behind
    assert not list((run / "debug").glob(f"stacks-step-job{second}-*")), sorted((run / "debug").iterdir())

    # status names the hang and its reason; the second segment trained to the target
    proc = megalaunch(None, "status", str(run), cwd=slurm_tmp)
    assert proc.returncode == 0 and "HUNG" in proc.stdout and "rendezvous" in proc.stdout, proc.stdout
    assert ended[1]["checkpoint_iteration"] == 3
    print(f"hung segment: {runtime} s of a {TIME_LIMIT_S} s limit, killed "
          f"{killed['time'] - last_beat:.1f} s after the last beat; whole test {took:.0f} s")
