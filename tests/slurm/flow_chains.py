"""What the post-training chains' Slurm tests share (test_dpo_slurm.py, test_grpo_slurm.py, test_distill_slurm.py):
a tiny flow recipe on the Slurm backend with periodic saves, as real runs have, each iteration's loss and metrics
logged by the trainer (MEGALAUNCH_LOSS_LOG: Megatron's printed line averages a segment's first two iterations),
one-command submission, and the chain's progress and end read from its run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from cluster import queue_ids
from launch import job_cli, ledger, megalaunch, trainer_python

from megalaunch.runtime.rank.dist_env import free_port

SAVE_INTERVAL = 5  # periodic saves between the signals, as a real chain has them


def flow_recipe(tmp: Path, name: str, include: str, training: dict[str, Any], *,
                post_training: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Path:
    """RECIPE.yaml for a one-node, one-task CPU chain of `include` on the Slurm cluster."""
    recipe: dict[str, Any] = {
        "include": [include], "name": name, "run": {"root": str(tmp / name)},
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": "00:10:00", "python": trainer_python(), "megalaunch": job_cli(), "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.5", "OMP_NUM_THREADS": "1",
                            "MEGALAUNCH_LOSS_LOG": str(tmp / f"{name}.losses.jsonl"), **(env or {})}},
        "training": {"log_interval": 1, "precision": "fp32", **training},
        "checkpoint": {"save_interval": SAVE_INTERVAL, "save_time_estimate_s": 10, "keep_last": 20},
        "chain": {"step_time_estimate_s": 2, "signal_margin_s": 18, "min_train_time_s": 30, "hang_timeout_s": 300,
                  "restarts_per_segment": 0, "export_hf": False},
        **({"post_training": post_training} if post_training else {}),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def submit(tmp: Path, name: str, recipe: Path, *args: str) -> tuple[Path, str]:
    """`megalaunch submit RECIPE ARGS...`: (the run directory, what submit printed)."""
    proc = megalaunch(None, "submit", str(recipe), *args, cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [run] = [p for p in (tmp / name).iterdir() if not p.name.startswith(".")]
    return run, proc.stdout


def done(run: Path) -> bool:
    return any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name)


def cancel_unfinished(*runs: Path) -> None:
    for run in runs:
        if not done(run):
            megalaunch(None, "cancel", str(run))


def progress(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def records(tmp: Path, name: str) -> dict[int, dict[str, Any]]:
    """Iteration -> the trainer's record (loss, metrics), every segment's."""
    lines = (tmp / f"{name}.losses.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, lines) if r}
