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
from flow_chains import cancel_unfinished, done, flow_recipe, progress, records, submit
from launch import ledger, megalaunch

pytestmark = [
    pytest.mark.megatron, pytest.mark.slow, pytest.mark.usefixtures("node_names_resolve"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("torch", "megatron", "transformers",
                                                                          "tokenizers")),
                       reason="needs torch, megatron-core, transformers and tokenizers"),
]

ITERS = 12  # 3 rounds of 32 completions (8 prompts x 4), 4 iterations each
PROMPTS = 8  # few, larger rounds: each is tokenized by a fresh interpreter (~3.7 CPU-s), in every chain


def _recipe(tmp: Path, name: str, rounds: Path, **training: Any) -> Path:
    return flow_recipe(tmp, name, "grpo-tiny", {"train_iters": ITERS, "global_batch_size": 8, "micro_batch_size": 4,
                                                "lr": 1e-3, "min_lr": 1e-3, **training},
                       post_training={"rollouts": str(rounds), "rollout_wait_s": 60})


def _losses(tmp: Path, name: str) -> dict[int, tuple[float, float]]:
    """Iteration -> (loss, advantage x logp): at a round's first iteration the ratio is 1 and the loss -mean(A)
    over the answer tokens whatever the weights, so the weights' trace is also the log-probability metric
    (runtime/flows/grpo.py); the old log-probabilities are the stage's (RUN/scores/old, rollout_old.py)."""
    return {i: (r["loss"], r["metrics"]["advantage x logp"]) for i, r in records(tmp, name).items()}


@pytest.mark.timeout(1500)
def test_grpo_chain_resumes_exactly_after_sigusr2_with_rounds_in_a_directory(slurm_tmp: Path) -> None:
    from tests.support.chat import make_chat_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
    from test_grpo_flow import write_round

    model = make_chat_model(slurm_tmp / "model", seed=0)
    rounds = slurm_tmp / "rounds"
    for k in range(1, ITERS // 4 + 1):
        write_round(rounds, k, seed=3, prompts=PROMPTS)
    straight, stopped = (submit(slurm_tmp, name, _recipe(slurm_tmp, name, rounds), "--from-hf", str(model))[0]
                         for name in ("straight", "stopped"))
    try:
        wait_for(lambda: progress(stopped) >= 5, 600, interval=1, what="the stopped chain's 5th iteration")
        first = next(e for e in ledger(stopped) if e["event"] == "started")["job_id"]
        subprocess.run(["scancel", "--signal=USR2", first], check=True, timeout=30)  # the step's tasks, not the script
        wait_for(lambda: done(straight) and done(stopped), 900, interval=2, what="both chains to finish")
    finally:
        cancel_unfinished(straight, stopped)
    ended = [e for e in ledger(stopped) if e["event"] == "ended"]
    assert [e["outcome"] for e in ended] == ["saved", "finished"], ended
    assert [e["outcome"] for e in ledger(straight) if e["event"] == "ended"] == ["finished"]
    for run in (straight, stopped):
        record = [json.loads(line) for line in (run / "rollouts" / "record.jsonl").read_text().splitlines()]
        assert [(r["round"], r["first_iteration"]) for r in record] == [(k, 4 * k - 3) for k in range(1, 4)]
        metas = [json.loads((run / "scores" / "old" / f"round-{k:06d}" / "meta.json").read_text()) for k in range(1, 4)]
        assert [(m["complete"], m["model"]["fingerprint"]) for m in metas] == \
            [(True, f"policy:iteration={4 * k - 4}") for k in range(1, 4)]  # each round's, scored at its start
    ref, got = _losses(slurm_tmp, "straight"), _losses(slurm_tmp, "stopped")
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1)), (ref, got)
    assert all(math.isclose(g, r, rel_tol=1e-6, abs_tol=1e-7) for i in ref for g, r in zip(got[i], ref[i], strict=True)), \
        {i: (ref[i], got[i]) for i in ref}
    assert ref[ITERS][1] > ref[1][1]  # good completions got likelier


@pytest.mark.timeout(1500)
def test_a_chain_that_runs_out_of_rounds_stops_cleanly_and_resume_continues(slurm_tmp: Path) -> None:
    """The hand-off on Slurm: round 1 (4 iterations) of 8; the chain waits rollout_wait_s for round 2, saves and
    stops with the reason `status` shows (not a failure); the generator writes round 2 and `megalaunch resume`
    trains on to the end, record.jsonl naming every round."""
    from tests.support.chat import make_chat_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
    from test_grpo_flow import write_round

    model = make_chat_model(slurm_tmp / "model", seed=0)
    rounds = slurm_tmp / "rounds"
    write_round(rounds, 1, seed=8, prompts=PROMPTS)
    recipe = _recipe(slurm_tmp, "handoff", rounds, train_iters=8)
    tree = yaml.safe_load(recipe.read_text())
    tree["post_training"]["rollout_wait_s"] = 5
    recipe.write_text(yaml.safe_dump(tree))
    run, _ = submit(slurm_tmp, "handoff", recipe, "--from-hf", str(model))
    try:
        wait_for(lambda: done(run), 600, interval=1, what="the chain to stop for want of round 2")
        ended = [e for e in ledger(run) if e["event"] == "ended"]
        assert [(e["outcome"], e["checkpoint_iteration"]) for e in ended] == [("exited", 4)], ended
        [stopped] = [e for e in ledger(run) if e["event"] == "chain_stopped"]
        assert "rollouts: rollout round 2" in stopped["reason"], stopped
        assert "did not come within post_training.rollout_wait_s=5 s" in stopped["reason"], stopped
        status = megalaunch(None, "status", str(run), cwd=slurm_tmp)
        assert "did not come within post_training.rollout_wait_s=5 s" in status.stdout, status.stdout
        write_round(rounds, 2, seed=8, prompts=PROMPTS)
        resumed = megalaunch(None, "resume", str(run), cwd=slurm_tmp)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        wait_for(lambda: sum(e["event"] == "chain_stopped" for e in ledger(run)) >= 2 and not queue_ids(name=run.name),
                 600, interval=1, what="the resumed chain to finish")
    finally:
        cancel_unfinished(run)
    ended = [e for e in ledger(run) if e["event"] == "ended"]
    assert [e["outcome"] for e in ended] == ["exited", "finished"], ended
    record = [json.loads(line) for line in (run / "rollouts" / "record.jsonl").read_text().splitlines()]
    assert [(r["round"], r["first_iteration"], r["last_iteration"]) for r in record] == [(1, 1, 4), (2, 5, 8)]
    assert sorted(_losses(slurm_tmp, "handoff")) == list(range(1, 9))
