"""Evaluation at milestones on the local Slurm cluster, with the real trainer (tiny model, CPU): rank 0
submits one eval job per milestone (every 50 iterations) while training goes on; each job converts
its checkpoint, computes held-out perplexity and a local task, and writes results.json (perplexity
falling over milestones); the jobs' scripts are files of the run directory, submitted through the
one Slurm client (ledger events). A broken task (an lm-eval task that does not exist) submitted by
hand: the eval job fails and `eval status` says why; training's outcome is untouched."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import run_as, wait_for
from launch import cli_argv, job_megalaunch, ledger, run_dir_of, trainer_python

from megalaunch.rundir.evals import EvalPaths, eval_records
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.dist_env import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("torch", "megatron", "transformers",
                                                                         "tokenizers")),
                       reason="needs the [train] and [convert] extras"),
]
MILESTONES = [50, 100, 150]  # three: enough to see perplexity fall, each an eval job (~10 CPU-s)
LAST = MILESTONES[-1]


def megalaunch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """As root, with this checkout's code when PYTHONPATH points at it (a worktree), as the jobs get it."""
    env = {"XDG_STATE_HOME": str(cwd / ".state-root")}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return run_as(None, [*cli_argv(), *args], env, cwd=cwd, timeout=120)


def _recipe(tmp: Path) -> Path:
    from tests.support.eval_data import make_eval_data

    data = make_eval_data(tmp / "data")
    recipe: dict[str, Any] = {
        "include": ["tiny"], "name": "evalslurm", "run": {"root": str(tmp / "runs")},
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": "00:05:00", "python": trainer_python(), "megalaunch": job_megalaunch(),
                    "master_port": free_port(),
                    "env": {"OMP_NUM_THREADS": "1"}},
        "data": {"mock": False, "blend": [{"path": str(data.prefix)}], "split": "90,10,0",
                 "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(data.tokenizer)},
        "training": {"train_iters": LAST, "micro_batch_size": 8, "global_batch_size": 8, "log_interval": 10,
                     "eval_iters": 1},
        "checkpoint": {"save_interval": 50, "milestone_interval": 50, "keep_last": 1, "save_time_estimate_s": 10},
        # lead = save 10 + step 1 + Slurm's 30 s + margin 19 = 60 s; one segment trains all of them
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 19, "min_train_time_s": 30, "hang_timeout_s": 300},
        "eval": {"enabled": True, "heldout_sequences": 16, "time": "00:05:00",
                 "local_tasks": [{"name": "next_word", "path": str(data.task)}]},
    }
    path = tmp / "evalslurm.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _settled(paths: RunPaths, iterations: list[int]) -> list[dict[str, Any]] | None:
    records = [r for r in eval_records(paths) if r["iteration"] in iterations]
    ok = [r["iteration"] for r in records] == iterations and all(r["state"] in ("done", "failed") for r in records)
    return records if ok else None


@pytest.mark.timeout(400)
def test_milestones_are_evaluated_by_slurm_jobs_of_their_own(slurm_tmp: Path) -> None:
    proc = megalaunch("submit", str(_recipe(slurm_tmp)), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    paths = RunPaths(run_dir_of(slurm_tmp))
    records = wait_for(lambda: _settled(paths, MILESTONES), timeout=300, interval=1, what="three evals")
    assert [r["state"] for r in records] == ["done"] * len(MILESTONES), [(r["iteration"], r["reason"]) for r in records]
    ppl = [r["heldout_ppl"] for r in records]
    assert all(a > b for a, b in itertools.pairwise(ppl)), ppl
    events = ledger(paths.root)
    submitted = [e for e in events if e["event"] == "eval_submitted"]
    assert sorted(e["iteration"] for e in submitted) == MILESTONES  # one job per milestone
    assert len({e["eval_job"] for e in submitted}) == len(MILESTONES)
    for it in MILESTONES:
        ep = EvalPaths(paths, it)
        assert ep.job_script.is_file() and "eval job" in ep.job_script.read_text()
        result = json.loads(ep.results.read_text())
        assert result["job_id"] == str(ep.read_state()["job_id"]) and result["tasks"]["next_word"]["n"] == 24
        assert not ep.hf.exists()
    # evals ran next to training: the first one started before training ended
    started = {e["iteration"]: e["time"] for e in events if e["event"] == "eval_started"}
    assert wait_for(lambda: any(e["event"] == "chain_stopped" for e in ledger(paths.root)), 120, what="chain end")
    outcome = json.loads(paths.outcome.read_text())
    assert outcome["status"] == "finished" and outcome["iteration"] == LAST
    assert started[50] < outcome["time"]

    # a broken task, by hand: the job fails, `eval status` says why, training's verdict stays
    by_hand = megalaunch("eval", str(paths.root), "--iteration", str(LAST), "--tasks", "no_such_task", "--force",
                         cwd=slurm_tmp)
    assert by_hand.returncode == 0 and f"submitted eval of iteration {LAST}" in by_hand.stdout, by_hand.stderr
    failed = wait_for(lambda: _settled(paths, [LAST]) if (EvalPaths(paths, LAST).read_state() or {}).get("state")
                      == "failed" else None, timeout=180, interval=1, what="the broken eval to fail")
    assert "unknown lm-eval task(s): no_such_task" in failed[0]["reason"]
    status = megalaunch("eval", "status", str(paths.root), cwd=slurm_tmp)
    assert f"iteration {LAST}: failed" in status.stdout and "no_such_task" in status.stdout
    assert "iteration 50: done" in status.stdout
    assert json.loads(paths.outcome.read_text())["status"] == "finished"
