"""DPO in one command on the local Slurm cluster (issue 51): `megalaunch submit dpo-tiny --from-hf MODEL --data
PAIRS`. The first stage tokenizes the pairs and converts the model; the first segment scores the reference with
the starting model before iteration 1. One chain runs uninterrupted; the other is stopped by SIGUSR2 (sent by
Slurm to the job's step, as its time-limit warning is) twice: DURING the reference scoring (the next segment
continues from documents_done) and mid-training (the next resumes from the checkpoint). Both score once, their
stored references are the same bytes, and the losses and the rewards' metrics equal at every iteration."""

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
PAIRS = 48


def _submit(tmp: Path, name: str, made: dict[str, Path], env: dict[str, str]) -> Path:
    recipe = flow_recipe(tmp, name, "dpo-tiny", {"train_iters": ITERS, "global_batch_size": 16, "micro_batch_size": 4,
                                                 "lr": 2e-3, "min_lr": 2e-3}, env=env)
    run, printed = submit(tmp, name, recipe, "--from-hf", str(made["model"]), "--data", str(made["pairs"]))
    assert "reference: stage (auto:" in printed, printed
    return run


def _job(run: Path, n: int) -> str | None:
    started = [e["job_id"] for e in ledger(run) if e["event"] == "started"]
    return started[n] if len(started) > n else None


def _scoring(run: Path) -> bool:
    """The first segment is inside the reference scoring: it has said its choice and its store holds rows."""
    try:
        meta = json.loads((run / "scores" / "reference" / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return any(e["event"] == "reference" for e in ledger(run)) and not meta["complete"]


@pytest.mark.timeout(1500)
def test_dpo_chain_stopped_during_scoring_and_training_resumes_exactly(slurm_tmp: Path) -> None:
    from tests.support.chat import make_chat_model, preference_rows, write_jsonl

    made = {"model": make_chat_model(slurm_tmp / "model", seed=0),
            "pairs": write_jsonl(slurm_tmp / "pairs" / "train.jsonl", preference_rows(PAIRS)).parent}
    straight = _submit(slurm_tmp, "straight", made, {})
    stopped = _submit(slurm_tmp, "stopped", made, {"MEGALAUNCH_TEST_SCORE_ROUND_S": "0.4"})
    try:
        wait_for(lambda: _scoring(stopped), 600, interval=0.5, what="the stopped chain's reference scoring")
        subprocess.run(["scancel", "--signal=USR2", _job(stopped, 0)], check=True, timeout=30)
        wait_for(lambda: _job(stopped, 1) is not None and progress(stopped) >= 4, 600, interval=1,
                 what="the second segment's 4th iteration")
        subprocess.run(["scancel", "--signal=USR2", _job(stopped, 1)], check=True, timeout=30)
        wait_for(lambda: done(straight) and done(stopped), 900, interval=2, what="both chains to finish")
    finally:
        cancel_unfinished(straight, stopped)
    ended = [e for e in ledger(stopped) if e["event"] == "ended"]
    assert [e["outcome"] for e in ended] == ["saved", "saved", "finished"], ended
    assert [e["outcome"] for e in ledger(straight) if e["event"] == "ended"] == ["finished"]
    first_log = (stopped / "logs" / f"{stopped.name}-{_job(stopped, 0)}.out").read_text(errors="replace")
    second_log = (stopped / "logs" / f"{stopped.name}-{_job(stopped, 1)}.out").read_text(errors="replace")
    assert "reference scoring: train, documents 0.." in first_log
    resumed_at = int(second_log.split("reference scoring: train, documents ")[1].split("..")[0])
    assert 0 < resumed_at < 2 * PAIRS, resumed_at  # the scoring continued where the stop left it
    stores = []
    for run in (straight, stopped):
        [scored] = [e for e in ledger(run) if e["event"] == "reference_scored"]
        assert scored["documents"] == {"train": 2 * PAIRS} and scored["tokens_per_s"] > 0, scored
        stores.append((run / "scores" / "reference" / "train.logp").read_bytes())
    assert stores[0] == stores[1]
    ref, got = records(slurm_tmp, "straight"), records(slurm_tmp, "stopped")
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1)), (ref, got)
    assert all(math.isclose(got[i]["loss"], ref[i]["loss"], rel_tol=1e-6) for i in ref), (ref, got)
    assert all(got[i]["metrics"] == pytest.approx(ref[i]["metrics"], rel=1e-5, abs=1e-6) for i in ref)
    assert math.isclose(ref[1]["loss"], math.log(2), rel_tol=1e-5)  # the policy starts as the reference
    assert ref[ITERS]["metrics"]["rewards/margin"] > 0
