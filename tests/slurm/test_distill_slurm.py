"""Distillation in one command on the local Slurm cluster (issue 51): `megalaunch submit distill-tiny --from-hf
STUDENT --data CHATS --set post_training.teacher=TEACHER`. The chain's first stage tokenizes the chats, converts
the student and scores the chats with the teacher (recorded in the ledger, with its tokens/s) before training;
a segment stopped by SIGUSR2 (sent by Slurm to the job's step, as its time-limit warning is) saves, the next
segment scores nothing again and resumes, and the losses of the two segments equal an uninterrupted chain's at
every iteration."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
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

ITERS = 12


def _recipe(tmp: Path, name: str, teacher: Path) -> Path:
    recipe: dict[str, Any] = {
        "include": ["distill-tiny"], "name": name, "run": {"root": str(tmp / name)},
        "cluster": {"backend": "slurm", "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": "00:10:00", "python": trainer_python(), "megalaunch": job_cli(), "master_port": free_port(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.5", "OMP_NUM_THREADS": "1",
                            "MEGALAUNCH_LOSS_LOG": str(tmp / f"{name}.losses.jsonl")}},
        "training": {"train_iters": ITERS, "global_batch_size": 4, "micro_batch_size": 2, "log_interval": 1,
                     "precision": "fp32"},
        "checkpoint": {"save_interval": 1000000, "save_time_estimate_s": 10, "keep_last": 20},
        "chain": {"step_time_estimate_s": 2, "signal_margin_s": 18, "min_train_time_s": 30, "hang_timeout_s": 300,
                  "restarts_per_segment": 0, "export_hf": False},
        "post_training": {"teacher": str(teacher), "teacher_top_k": 16},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    path.chmod(0o644)
    return path


def _submit(tmp: Path, name: str, made: dict[str, Path]) -> Path:
    proc = megalaunch(None, "submit", str(_recipe(tmp, name, made["teacher"])), "--from-hf", str(made["student"]),
                      "--data", str(made["chats"]), cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [run] = [p for p in (tmp / name).iterdir() if not p.name.startswith(".")]
    return run


def _done(run: Path) -> bool:
    return any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name)


def _losses(tmp: Path, name: str) -> dict[int, float]:
    """Iteration -> loss, every segment's, from the trainer's loss log (MEGALAUNCH_LOSS_LOG; Megatron's printed
    line averages a segment's first two iterations)."""
    lines = (tmp / f"{name}.losses.jsonl").read_text().splitlines()
    return {r["iteration"]: r["loss"] for r in map(json.loads, lines) if r}


def _progress(run: Path) -> int:
    try:
        return int(json.loads((run / "state" / "progress.json").read_text())["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@pytest.mark.timeout(1500)
def test_distillation_chain_scores_once_and_resumes_exactly_after_sigusr2(slurm_tmp: Path) -> None:
    from tests.support.chat import chat_rows, make_chat_model, write_jsonl

    made = {"student": make_chat_model(slurm_tmp / "student", seed=0),
            "teacher": make_chat_model(slurm_tmp / "teacher", seed=7),
            "chats": write_jsonl(slurm_tmp / "chats" / "train.jsonl", chat_rows(48)).parent}
    straight, stopped = _submit(slurm_tmp, "straight", made), _submit(slurm_tmp, "stopped", made)
    try:
        wait_for(lambda: _progress(stopped) >= 4, 600, interval=1, what="the stopped chain's 4th iteration")
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
        [scored] = [e for e in ledger(run) if e["event"] == "teacher_scored"]  # once: the second segment skips it
        assert scored["ok"] and scored["tokens_per_s"] > 0 and scored["top_k"] == 16, scored
        meta = json.loads((run / "scores" / "teacher" / "meta.json").read_text())
        assert meta["complete"] and meta["model"]["source"] == str(made["teacher"])
    ref, got = _losses(slurm_tmp, "straight"), _losses(slurm_tmp, "stopped")
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1)), (ref, got)
    assert all(math.isclose(got[i], ref[i], rel_tol=1e-6) for i in ref), {i: (ref[i], got[i]) for i in ref}
    assert ref[ITERS] < ref[1]  # the KL to the teacher falls
    assert "distill kl" in (stopped / "logs" / f"{stopped.name}-{first}.out").read_text(errors="replace")
