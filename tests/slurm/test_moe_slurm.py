"""The tiny MoE (recipe tiny-moe: 8 experts, top-2, alltoall dispatcher) with expert parallelism 2 on two CPU
ranks of the real local Slurm cluster: `megalaunch submit`, Slurm's own time-limit warning (SIGUSR2) stops
segment 1 with a save, the chain's next segment resumes from it, and every iteration's loss (rank 0's, full
precision, through the trainer's MEGALAUNCH_LOSS_LOG hook) equals the loss of an uninterrupted run of the
same recipe on the local backend (relative difference <= 1e-6: the same layout, so the same arithmetic).

Timing: limit 150 s, signal lead 60 s (save 10 + step 1 + Slurm's 30 s check period + margin 19), so the
warning comes 60..90 s after segment 1 starts (measured: ~90 s); less start-up (3..25 s) that leaves 35..87 s
of training at ~2.0 s an iteration (MEGALAUNCH_TEST_STEP_SLEEP_S paces it, so the count is Slurm's, not the
machine's): 17..44 iterations (44 measured on an idle machine), fewer than TRAIN_ITERS, so segment 1 never
finishes; segment 2 trains the rest. Measured wall 160 s at TRAIN_ITERS 45 (~3 min at 60), mostly waiting
for Slurm's clock; ~15 CPU-s. The reference run trains meanwhile."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import queue_ids, wait_for
from launch import REPO, cli_argv, job_cli, ledger, megalaunch, run_dir_of, trainer_python

from megalaunch.runtime.rank.dist_env import free_port

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None,
                       reason="needs torch + megatron-core (the [train] extra)"),
]

TRAIN_ITERS = 60
STEP_SLEEP_S = 2.0
CHAIN_TIMEOUT_S = 420


def _recipe(tmp: Path, name: str, backend: str, loss_log: Path, step_sleep_s: float) -> Path:
    recipe: dict[str, Any] = {
        "include": ["tiny-moe"], "name": name, "run": {"root": str(tmp / ("runs" if backend == "slurm" else "runs-local"))},
        "cluster": {"backend": backend, "gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 1,
                    "time": "00:02:30", "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": str(step_sleep_s), "OMP_NUM_THREADS": "1",
                            "MEGALAUNCH_LOSS_LOG": str(loss_log)}},
        "parallel": {"expert_model_parallel_size": 2},
        "training": {"train_iters": TRAIN_ITERS, "global_batch_size": 4, "micro_batch_size": 1, "log_interval": 1,
                     "lr_warmup_iters": 2},
        "checkpoint": {"save_interval": 1000000, "save_time_estimate_s": 10},  # only the stop save
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 19, "min_train_time_s": 30, "hang_timeout_s": 300,
                  "restarts_per_segment": 0},
    }
    if backend == "slurm":
        recipe["cluster"].update(python=trainer_python(), megalaunch=job_cli())
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def _losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    return {r["iteration"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if r}


def _chain_done(run: Path) -> bool:
    return any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name)


@pytest.mark.slow
@pytest.mark.timeout(CHAIN_TIMEOUT_S + 180)
def test_tiny_moe_ep2_stops_on_slurm_signal_and_resumes_exactly(slurm_tmp: Path) -> None:
    chain_log, ref_log = slurm_tmp / "chain.jsonl", slurm_tmp / "reference.jsonl"
    proc = megalaunch(None, "submit", str(_recipe(slurm_tmp, "moechain", "slurm", chain_log, STEP_SLEEP_S)),
                      cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    # the uninterrupted reference: the same recipe on the local backend, unpaced, while Slurm's clock runs
    ref_recipe = _recipe(slurm_tmp, "moeref", "local", ref_log, 0.0)
    reference = subprocess.Popen([*cli_argv(None), "submit", str(ref_recipe)], cwd=slurm_tmp, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO / "src"),
                                      "XDG_STATE_HOME": str(slurm_tmp / ".state-ref")},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _chain_done(run), CHAIN_TIMEOUT_S, interval=2, what="the MoE chain to finish")
        out, _ = reference.communicate(timeout=300)
    finally:
        if not _chain_done(run):
            megalaunch(None, "cancel", str(run))
        reference.kill()
    assert reference.returncode == 0, out[-3000:]

    events = ledger(run)
    ended = [(e["outcome"], e["checkpoint_iteration"]) for e in events if e["event"] == "ended"]
    assert len(ended) >= 2 and [o for o, _ in ended] == ["saved"] * (len(ended) - 1) + ["finished"], ended
    stops = [d["iteration"] for d in events if d["event"] == "decision" and d["decision"] == "signal"]
    resumed = [e["iteration"] for e in events if e["event"] == "resumed"]
    assert resumed == [it for _, it in ended[:-1]] and stops[:len(resumed)] == resumed, (ended, stops, resumed)
    assert 0 < resumed[0] < TRAIN_ITERS

    ref, got = _losses(ref_log), _losses(chain_log)
    assert sorted(ref) == sorted(got) == list(range(1, TRAIN_ITERS + 1)), (sorted(ref), sorted(got))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= 1e-6, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=1e-6)}
    after = resumed[0] + 1
    print(f"resumed at {resumed[0]}; loss at {after}: {got[after]!r} (uninterrupted: {ref[after]!r})")
