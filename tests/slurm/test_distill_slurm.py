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

import pytest
from cluster import wait_for
from flow_chains import cancel_unfinished, done, flow_recipe, progress, records, submit
from launch import ledger

pytestmark = [
    pytest.mark.megatron, pytest.mark.slow, pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("torch", "megatron", "transformers",
                                                                          "tokenizers")),
                       reason="needs torch, megatron-core, transformers and tokenizers"),
]

ITERS = 12


def _submit(tmp: Path, name: str, made: dict[str, Path]) -> Path:
    recipe = flow_recipe(tmp, name, "distill-tiny", {"train_iters": ITERS, "global_batch_size": 4, "micro_batch_size": 2},
                         post_training={"teacher": str(made["teacher"]), "teacher_top_k": 16})
    return submit(tmp, name, recipe, "--from-hf", str(made["student"]), "--data", str(made["chats"]))[0]


def _losses(tmp: Path, name: str) -> dict[int, float]:
    return {i: r["loss"] for i, r in records(tmp, name).items()}


@pytest.mark.timeout(1500)
def test_distillation_chain_scores_once_and_resumes_exactly_after_sigusr2(slurm_tmp: Path) -> None:
    from tests.support.chat import chat_rows, make_chat_model, write_jsonl

    made = {"student": make_chat_model(slurm_tmp / "student", seed=0),
            "teacher": make_chat_model(slurm_tmp / "teacher", seed=7),
            "chats": write_jsonl(slurm_tmp / "chats" / "train.jsonl", chat_rows(48)).parent}
    straight, stopped = _submit(slurm_tmp, "straight", made), _submit(slurm_tmp, "stopped", made)
    try:
        wait_for(lambda: progress(stopped) >= 4, 600, interval=1, what="the stopped chain's 4th iteration")
        first = next(e for e in ledger(stopped) if e["event"] == "started")["job_id"]
        subprocess.run(["scancel", "--signal=USR2", first], check=True, timeout=30)  # the step's tasks, not the script
        wait_for(lambda: done(straight) and done(stopped), 900, interval=2, what="both chains to finish")
    finally:
        cancel_unfinished(straight, stopped)
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
