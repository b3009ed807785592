"""GRPO in one command on the local Slurm cluster (issue 51): `megalaunch submit grpo-tiny --from-hf MODEL --set
post_training.rollouts=ROUNDS` with the rounds in a directory. The first segment brings the rounds in as it
reaches them (tokenized by rank 0, recorded in RUN/rollouts/record.jsonl); a segment stopped by SIGUSR2 (sent by
Slurm to the job's step, as its time-limit warning is) saves, the next one maps the consumed samples back to
the same round and row, and the losses of the two segments equal an uninterrupted chain's at every iteration."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import queue_ids, wait_for
from launch import job_cli, ledger, megalaunch, trainer_python

from megalaunch.runtime.rank.dist_env import free_port

pytestmark = [
    pytest.mark.megatron, pytest.mark.slow, pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("torch", "megatron", "transformers",
                                                                          "tokenizers")),
                       reason="needs torch, megatron-core, transformers and tokenizers"),
]

ITERS = 12  # 6 rounds of 16 completions, 2 iterations each


def _recipe(tmp: Path, name: str, rounds: Path) -> Path:
    recipe: dict[str, Any] = {
        "include": ["grpo-tiny"], "name": name, "run": {"root": str(tmp / name)},
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": "00:10:00", "python": trainer_python(), "megalaunch": job_cli(), "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.5", "OMP_NUM_THREADS": "1",
                            "MEGALAUNCH_LOSS_LOG": str(tmp / f"{name}.losses.jsonl")}},
        "training": {"train_iters": ITERS, "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 1,
                     "precision": "fp32", "lr": 1e-3, "min_lr": 1e-3},
        "checkpoint": {"save_interval": 1000000, "save_time_estimate_s": 10, "keep_last": 20},
        "chain": {"step_time_estimate_s": 2, "signal_margin_s": 18, "min_train_time_s": 30, "hang_timeout_s": 300,
                  "restarts_per_segment": 0, "export_hf": False},
        "post_training": {"rollouts": str(rounds), "rollout_wait_s": 60},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def _submit(tmp: Path, name: str, model: Path, rounds: Path) -> Path:
    proc = megalaunch(None, "submit", str(_recipe(tmp, name, rounds)), "--from-hf", str(model), cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [run] = [p for p in (tmp / name).iterdir() if not p.name.startswith(".")]
    return run


def _done(run: Path) -> bool:
    return any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name)


def _losses(tmp: Path, name: str) -> dict[int, tuple[float, float]]:
    """Iteration -> (loss, advantage x logp): at a round's first iteration the ratio is 1 and the loss -mean(A)
    over the answer tokens whatever the weights, so the weights' trace is also the log-probability metric
    (runtime/flows/grpo.py); the old log-probabilities are the stage's (RUN/scores/old, rollout_old.py)."""
    lines = (tmp / f"{name}.losses.jsonl").read_text().splitlines()
    return {r["iteration"]: (r["loss"], r["metrics"]["advantage x logp"]) for r in map(json.loads, lines) if r}


def _progress(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@pytest.mark.timeout(1500)
def test_grpo_chain_resumes_exactly_after_sigusr2_with_rounds_in_a_directory(slurm_tmp: Path) -> None:
    from tests.support.chat import make_chat_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
    from test_grpo_flow import write_round

    model = make_chat_model(slurm_tmp / "model", seed=0)
    rounds = slurm_tmp / "rounds"
    for k in range(1, ITERS // 2 + 1):
        write_round(rounds, k, seed=3)
    straight, stopped = _submit(slurm_tmp, "straight", model, rounds), _submit(slurm_tmp, "stopped", model, rounds)
    try:
        wait_for(lambda: _progress(stopped) >= 5, 600, interval=1, what="the stopped chain's 5th iteration")
        first = next(e for e in ledger(stopped) if e["event"] == "started")["job_id"]
        subprocess.run(["scancel", "--signal=USR2", first], check=True, timeout=30)  # the step's tasks, not the script
        wait_for(lambda: _done(straight) and _done(stopped), 900, interval=2, what="both chains to finish")
    finally:
        for run in (straight, stopped):
            if not _done(run):
                megalaunch(None, "cancel", str(run))
    ended = [e for e in ledger(stopped) if e["event"] == "ended"]
    assert [e["outcome"] for e in ended] == ["saved", "finished"], ended
    assert [e["outcome"] for e in ledger(straight) if e["event"] == "ended"] == ["finished"]
    for run in (straight, stopped):
        record = [json.loads(line) for line in (run / "rollouts" / "record.jsonl").read_text().splitlines()]
        assert [(r["round"], r["first_iteration"]) for r in record] == [(k, 2 * k - 1) for k in range(1, 7)]
        metas = [json.loads((run / "scores" / "old" / f"round-{k:06d}" / "meta.json").read_text()) for k in range(1, 7)]
        assert [(m["complete"], m["model"]["fingerprint"]) for m in metas] == \
            [(True, f"policy:iteration={2 * k - 2}") for k in range(1, 7)]  # each round's, scored at its start
    ref, got = _losses(slurm_tmp, "straight"), _losses(slurm_tmp, "stopped")
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1)), (ref, got)
    assert all(math.isclose(g, r, rel_tol=1e-6, abs_tol=1e-7) for i in ref for g, r in zip(got[i], ref[i], strict=True)), \
        {i: (ref[i], got[i]) for i in ref}
    assert ref[ITERS][1] > ref[1][1]  # good completions got likelier


@pytest.mark.timeout(1500)
def test_a_chain_that_runs_out_of_rounds_stops_cleanly_and_resume_continues(slurm_tmp: Path) -> None:
    """The hand-off on Slurm: rounds 1-2 (4 iterations) of 8; the chain waits rollout_wait_s for round 3, saves and
    stops with the reason `status` shows (not a failure); the generator writes rounds 3-4 and `megalaunch resume`
    trains on to the end, record.jsonl naming every round."""
    from tests.support.chat import make_chat_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
    from test_grpo_flow import write_round

    model = make_chat_model(slurm_tmp / "model", seed=0)
    rounds = slurm_tmp / "rounds"
    for k in (1, 2):
        write_round(rounds, k, seed=8)
    recipe = _recipe(slurm_tmp, "handoff", rounds)
    tree = yaml.safe_load(recipe.read_text())
    tree["training"]["train_iters"] = 8
    tree["post_training"]["rollout_wait_s"] = 5
    recipe.write_text(yaml.safe_dump(tree))
    proc = megalaunch(None, "submit", str(recipe), "--from-hf", str(model), cwd=slurm_tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [run] = [p for p in (slurm_tmp / "handoff").iterdir() if not p.name.startswith(".")]
    try:
        wait_for(lambda: _done(run), 600, interval=1, what="the chain to stop for want of round 3")
        ended = [e for e in ledger(run) if e["event"] == "ended"]
        assert [(e["outcome"], e["checkpoint_iteration"]) for e in ended] == [("exited", 4)], ended
        [stopped] = [e for e in ledger(run) if e["event"] == "chain_stopped"]
        assert "rollouts: rollout round 3" in stopped["reason"], stopped
        assert "did not come within post_training.rollout_wait_s=5 s" in stopped["reason"], stopped
        status = megalaunch(None, "status", str(run), cwd=slurm_tmp)
        assert "did not come within post_training.rollout_wait_s=5 s" in status.stdout, status.stdout
        for k in (3, 4):
            write_round(rounds, k, seed=8)
        resumed = megalaunch(None, "resume", str(run), cwd=slurm_tmp)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        wait_for(lambda: sum(e["event"] == "chain_stopped" for e in ledger(run)) >= 2 and not queue_ids(name=run.name),
                 600, interval=1, what="the resumed chain to finish")
    finally:
        if not _done(run):
            megalaunch(None, "cancel", str(run))
    ended = [e for e in ledger(run) if e["event"] == "ended"]
    assert [e["outcome"] for e in ended] == ["exited", "finished"], ended
    record = [json.loads(line) for line in (run / "rollouts" / "record.jsonl").read_text().splitlines()]
    assert [(r["round"], r["first_iteration"], r["last_iteration"]) for r in record] == \
        [(1, 1, 2), (2, 3, 4), (3, 5, 6), (4, 7, 8)]
    assert sorted(_losses(slurm_tmp, "handoff")) == list(range(1, 9))
