"""GRPO's policy update under the chain (runtime/flows/grpo.py, rollout_feed.py): the tiny converted chat
model trains on rollout rounds written in a directory, rewards favouring one kind of completion (the
reversed prompt) over another; the advantage-weighted log-probability rises. The hand-off: a round that is
not there yet is waited for (the test writes it once the job says it waits, by rename) and training goes
on; the stop signal cuts a wait short (outcome saved at that boundary); a round that never comes stops the
next segment cleanly after rollout_wait_s with the reason (outcome exited), and record.jsonl says which round
and sha256 each iteration used. With kl_coeff > 0 the rounds are scored with the starting model and the KL
starts at 0."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from harness import Trainer, last_iteration, ledger, losses, wait_for
from tests.support.chat import WORDS, make_chat_model

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import read_jsonl

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

GBS = 8
PROMPTS = 4  # a round's prompts by default: 4 prompts x 4 completions = 16 = 2 iterations
# Each round is tokenized by a process of its own (`megalaunch data rollouts`: a fresh interpreter importing
# torch through transformers, ~3.7 CPU-s): tests whose claim is not about many rounds use few, larger ones.


def write_round(directory: Path, k: int, *, seed: int, prompts: int = PROMPTS) -> Path:
    """Round k: per prompt two good completions (the words reversed, reward 1), two bad (reward 0)."""
    rng = random.Random(seed * 1000 + k)
    rows = []
    for p in range(prompts):
        words = rng.choices(WORDS, k=3)
        good = " ".join(reversed(words))
        rows.append({"prompt": " ".join(words), "completions": [good, "fish fish fish", good, "rock rock"],
                     "rewards": [1.0, 0.0, 1.0, 0.0], "index": p})
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".round-{k:06d}.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = directory / f"round-{k:06d}.jsonl"
    tmp.rename(final)  # atomic: a round counts once it has its name
    return final


@pytest.fixture(scope="module")
def prep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grpo")
    hf = make_chat_model(root / "hf")
    hf_to_mcore(hf, root / "converted", model=load_recipe("grpo-tiny").recipe.model, vocab_size=512, progress=False)
    return {"hf": hf, "converted": root / "converted"}


def _run(root: Path, prep: dict[str, Path], rounds: Path, iters: int, *more: str) -> Any:
    sets = [f"training.micro_batch_size={GBS // 2}", f"training.global_batch_size={GBS}", "training.log_interval=1",
            "chain.hang_timeout_s=120", f"training.train_iters={iters}", "training.lr=1e-3", "training.min_lr=1e-3",
            "checkpoint.save_interval=100", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={prep['hf']}", f"checkpoint.load={prep['converted']}",
            f"post_training.rollouts={rounds}", *more]
    return write_run(prepare_run(load_recipe("grpo-tiny", sets, name="grpo"), root=root))


def _log(t: Trainer) -> str:
    return t.logs[0].read_text() if t.logs[0].is_file() else ""


def _metrics(log: Path) -> dict[int, dict[str, float]]:
    return {r["iteration"]: r.get("metrics") or {} for r in read_jsonl(log)}


def test_grpo_trains_toward_the_rewarded_completions(prep: dict[str, Path], tmp_path: Path) -> None:
    rounds = tmp_path / "rounds"
    for k in range(1, 5):  # 4 rounds of 10 prompts x 4 completions: 5 iterations each
        write_round(rounds, k, seed=1, prompts=10)
    paths = _run(tmp_path / "run", prep, rounds, 20, "post_training.old_logprobs=current")
    log = tmp_path / "loss.jsonl"
    t = Trainer(paths, job_id="11", env={"MEGALAUNCH_LOSS_LOG": str(log)})
    assert t.wait(600) == [0], t.log()[-3000:]
    assert t.outcome()["status"] == "finished", t.outcome()
    m = _metrics(log)
    score = [m[i]["advantage x logp"] for i in sorted(m)]
    assert len(score) == 20 and all(abs(m[i]["reward"] - 0.5) < 1e-6 for i in m)
    assert all(abs(m[i]["ratio"] - 1.0) < 1e-5 for i in m)  # old_logprobs current: the old policy is the current
    assert not (paths.root / "scores" / "old").exists()  # nothing scored
    assert sum(score[-4:]) / 4 > sum(score[:4]) / 4 + 0.05, score  # good completions got likelier than bad ones
    record = read_jsonl(paths.root / "rollouts" / "record.jsonl")
    assert [(r["round"], r["first_iteration"], r["last_iteration"]) for r in record] == \
        [(k, 5 * k - 4, 5 * k) for k in range(1, 5)]
    assert all(len(r["sha256"]) == 64 for r in record)


def test_the_job_waits_for_a_round_and_stops_cleanly_when_none_comes(prep: dict[str, Path], tmp_path: Path) -> None:
    rounds = tmp_path / "rounds"
    write_round(rounds, 1, seed=2)
    paths = _run(tmp_path / "run", prep, rounds, 6, "post_training.rollout_wait_s=300")
    t = Trainer(paths, job_id="21")
    wait_for(lambda: "waiting up to 300 s for round 2" in _log(t), timeout=300, what="the wait for round 2", trainer=t)
    write_round(rounds, 2, seed=2)  # the generator delivers: training goes on
    wait_for(lambda: "waiting up to 300 s for round 3" in _log(t), timeout=300, what="the wait for round 3", trainer=t)
    t.signal()  # the time limit's warning cuts the wait short: the segment saves at this boundary
    assert t.wait(300) == [0], _log(t)[-3000:]
    assert (t.outcome()["status"], t.outcome()["iteration"]) == ("saved", 4), t.outcome()
    # the next segment resumes at 4 and waits for round 3 before its first iteration, a short while only
    paths = _run(tmp_path / "run", prep, rounds, 6, "post_training.rollout_wait_s=1")
    t = Trainer(paths, job_id="22")
    assert t.wait(600) == [0], t.log()[-3000:]
    out = t.outcome()
    assert out["status"] == "exited", out
    consumed = [r for r in ledger(paths, "decision") if r.get("decision") == "exit"]
    assert consumed and consumed[-1]["iteration"] == 4, consumed
    stops = ledger(paths, "rollouts_stop")
    assert stops and "did not come within post_training.rollout_wait_s=1 s" in stops[-1]["reason"], stops
    assert (paths.root / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    record = read_jsonl(paths.root / "rollouts" / "record.jsonl")
    assert [r["round"] for r in record] == [1, 2]


def test_the_kl_to_the_reference_starts_at_zero_and_grows(prep: dict[str, Path], tmp_path: Path) -> None:
    """kl_coeff > 0: rank 0 scores each round with the starting model's Hugging Face weights (transformers) as
    it brings it in; at iteration 1 the policy is that model, so the k3 KL is ~0 (Megatron's and transformers'
    float32 forward passes of the same weights), then it grows as the policy moves."""
    import shutil

    rounds = tmp_path / "rounds"
    for k in (1, 2):  # 6 prompts x 4 completions: 3 iterations each; round 2 comes in (and is scored) mid-run
        write_round(rounds, k, seed=4, prompts=6)
    sets = [f"training.micro_batch_size={GBS // 2}", f"training.global_batch_size={GBS}", "training.log_interval=1",
            "chain.hang_timeout_s=120", "training.train_iters=6", "training.lr=1e-3", "training.min_lr=1e-3",
            "checkpoint.save_interval=100", f"checkpoint.from_hf={prep['hf']}", f"post_training.rollouts={rounds}",
            "data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={prep['hf']}",
            "post_training.kl_coeff=0.1"]
    paths = write_run(prepare_run(load_recipe("grpo-tiny", sets, name="grpo-kl"), root=tmp_path / "run"))
    shutil.copytree(prep["converted"], paths.root / "pretrained")  # what `job begin` converts from checkpoint.from_hf
    log = tmp_path / "loss.jsonl"
    t = Trainer(paths, job_id="31", env={"MEGALAUNCH_LOSS_LOG": str(log)})
    assert t.wait(600) == [0], t.log()[-3000:]
    assert t.outcome()["status"] == "finished", t.outcome()
    kl = [m["kl"] for _i, m in sorted(_metrics(log).items())]
    assert len(kl) == 6 and abs(kl[0]) < 1e-5 and kl[-1] > 1e-3, kl
    for k in (1, 2):
        meta = json.loads((paths.root / "scores" / "reference" / f"round-{k:06d}" / "meta.json").read_text())
        assert meta["complete"] and meta["kind"] == "logprobs" and meta["model"]["source"] == str(prep["hf"])


def test_two_ranks_read_the_same_rounds_as_one(prep: dict[str, Path], tmp_path: Path) -> None:
    """Two ranks (data parallel 2, and tensor parallel 2): rank 0 brings the rounds in while the other waits on
    its state; the step's loss and advantage x logp equal one rank's at every iteration (one single-rank run
    is the reference of both layouts)."""
    rounds = tmp_path / "rounds"
    for k in range(1, 3):
        write_round(rounds, k, seed=5)
    out = {}
    for name, world, tp in (("one", 1, "1"), ("dp2", 2, "1"), ("tp2", 2, "2")):
        paths = _run(tmp_path / name, prep, rounds, 4, f"parallel.tensor_model_parallel_size={tp}",
                     f"cluster.tasks_per_node={world}", "training.micro_batch_size=2")
        log = tmp_path / f"{name}.jsonl"
        t = Trainer(paths, world=world, job_id=f"4{world}{tp}",
                    env={"MEGALAUNCH_LOSS_LOG": str(log), "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert t.wait(600) == [0] * world, (name, t.log()[-3000:])
        out[name] = {i: (r["loss"], r["metrics"]["advantage x logp"]) for i, r in
                     ((r["iteration"], r) for r in read_jsonl(log))}
    for layout in ("dp2", "tp2"):
        assert sorted(out["one"]) == sorted(out[layout]) == [1, 2, 3, 4], (layout, out)
        for i, (loss, score) in out["one"].items():
            assert out[layout][i] == pytest.approx((loss, score), rel=1e-4, abs=1e-5), (layout, i, out)


def test_old_logprobs_given_by_the_generator_line_up_with_the_policy(prep: dict[str, Path], tmp_path: Path) -> None:
    """Rollouts with the generator's token ids and log-probabilities (here: transformers' on the starting weights,
    as a sampler running that model reports them): at iteration 1 the policy is that model, so every answer
    token's ratio is 1 (a row off by one token would not be) and nothing is clipped; at iteration 2 the policy
    has moved and the ratio is no longer 1 (they are used, not replaced by the current policy's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megalaunch.tokenization.chat.render import ChatRenderer

    renderer = ChatRenderer(prep["hf"])
    model = AutoModelForCausalLM.from_pretrained(str(prep["hf"]), torch_dtype=torch.float32).eval()
    rounds = tmp_path / "rounds"
    write_round(rounds, 1, seed=6)
    rows = []
    for line in (rounds / "round-000001.jsonl").read_text().splitlines():
        row = json.loads(line)
        ids_all, logps_all = [], []
        for answer in row["completions"]:
            enc = renderer.encode([{"role": "user", "content": row["prompt"]},
                                   {"role": "assistant", "content": answer}], 1)
            start, n = enc.mask.index(1), sum(enc.mask)
            with torch.no_grad():
                logits = model(torch.tensor([enc.tokens])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            ids_all.append(enc.tokens[start:start + n])
            logps_all.append([float(logp[j - 1, enc.tokens[j]]) for j in range(start, start + n)])
        rows.append({**row, "completion_ids": ids_all, "old_logprobs": logps_all})
    (rounds / "round-000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = _run(tmp_path / "run", prep, rounds, 2)
    log = tmp_path / "loss.jsonl"
    t = Trainer(paths, job_id="51", env={"MEGALAUNCH_LOSS_LOG": str(log)})
    assert t.wait(600) == [0], t.log()[-3000:]
    first, second = _metrics(log)[1], _metrics(log)[2]
    assert abs(first["ratio"] - 1.0) < 1e-4 and first["clip fraction"] == 0.0, first
    assert abs(second["ratio"] - 1.0) > 1e-4, second  # one step later the policy is not the generator's: used
    record = read_jsonl(paths.root / "rollouts" / "record.jsonl")
    assert record[0]["old_logprobs"] is True


def _old_run(root: Path, prep: dict[str, Path], rounds: Path) -> Any:
    """4 iterations per round (16 completions, global batch 4), 2 rounds; a small clip range."""
    return _run(root, prep, rounds, 8, "training.global_batch_size=4", "training.micro_batch_size=2",
                "post_training.clip_eps=0.05", "post_training.clip_eps_high=0.05")


def test_old_logprobs_are_the_policys_at_each_rounds_start(prep: dict[str, Path], tmp_path: Path) -> None:
    """The stage scores each round with the policy at the boundary before its first iteration: round 1's rows are
    the starting model's log-probabilities (transformers' forward of its weights, here), the ratio is 1 at
    iterations 1 and 5 (a round's first) and not at the others, where the small clip range clips."""
    import numpy
    import torch
    from transformers import AutoModelForCausalLM

    from megalaunch.runtime.scoring.store import Documents, ScoreReader

    rounds = tmp_path / "rounds"
    for k in (1, 2):
        write_round(rounds, k, seed=7)
    paths = _old_run(tmp_path / "run", prep, rounds)
    log = tmp_path / "loss.jsonl"
    t = Trainer(paths, job_id="61", env={"MEGALAUNCH_LOSS_LOG": str(log)})
    assert t.wait(600) == [0], t.log()[-3000:]
    m = _metrics(log)
    assert sorted(m) == list(range(1, 9))
    for i in (1, 5):
        assert abs(m[i]["ratio"] - 1.0) < 1e-6 and m[i]["clip fraction"] == 0.0, (i, m[i])
    for i in (2, 3, 4, 6, 7, 8):
        assert abs(m[i]["ratio"] - 1.0) > 1e-4, (i, m[i])
    assert max(m[i]["clip fraction"] for i in m) > 0.0, m
    prefix = paths.root / "rollouts" / "round-000001"
    store = paths.root / "scores" / "old"
    metas = [json.loads((store / f"round-00000{k}" / "meta.json").read_text()) for k in (1, 2)]
    assert [(x["complete"], x["kind"], x["model"]["fingerprint"]) for x in metas] == \
        [(True, "logprobs", "policy:iteration=0"), (True, "logprobs", "policy:iteration=4")]
    reader, docs = ScoreReader(store / "round-000001", prefixes=[str(prefix)]), Documents(prefix)
    model = AutoModelForCausalLM.from_pretrained(str(prep["hf"]), torch_dtype=torch.float32).eval()
    for d in range(len(docs)):
        ids = torch.tensor(numpy.asarray(docs.get(d)[0][:65], dtype=numpy.int64))
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        mine = logp[torch.arange(len(ids) - 1), ids[1:]].numpy()  # log p(token j | < j), j >= 1
        numpy.testing.assert_allclose(numpy.asarray(reader.get("round-000001", d))[1:], mine, atol=1e-4)
    scored = ledger(paths, "old_logprobs_scored")
    assert [(r["round"], r["iteration"], r["documents"]) for r in scored] == [(1, 0, 16), (2, 4, 16)], scored
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in scored)


def test_a_chain_stopped_during_the_scoring_and_mid_round_resumes_exactly(prep: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """Segment 1 is stopped while round 2 is scored (the boundary after iteration 4): it saves there with the
    round partly scored; segment 2 (loaded from that checkpoint: the model that began the scoring) continues
    the scoring and is stopped mid-round; segment 3 reads the round's stored scores: every iteration's loss and
    ratio equal an uninterrupted run's."""
    rounds = tmp_path / "rounds"
    for k in (1, 2):
        write_round(rounds, k, seed=8)
    straight, ref_log = _old_run(tmp_path / "straight", prep, rounds), tmp_path / "straight.jsonl"
    assert Trainer(straight, job_id="70", env={"MEGALAUNCH_LOSS_LOG": str(ref_log)}).wait(600) == [0]
    chain, log = _old_run(tmp_path / "chain", prep, rounds), tmp_path / "chain.jsonl"
    t = Trainer(chain, job_id="71", env={"MEGALAUNCH_LOSS_LOG": str(log), "MEGALAUNCH_TEST_SCORE_ROUND_S": "0.3"})
    wait_for(lambda: "with the policy at iteration 4" in _log(t), timeout=300, what="round 2's scoring", trainer=t)
    t.signal()
    assert t.wait(300) == [0], _log(t)[-3000:]
    assert (t.outcome()["status"], t.outcome()["iteration"]) == ("saved", 4), t.outcome()
    meta = json.loads((chain.root / "scores" / "old" / "round-000002" / "meta.json").read_text())
    done = meta["documents_done"]["round-000002"]
    assert not meta["complete"] and 0 < done < 16, meta
    t = Trainer(chain, job_id="72", env={"MEGALAUNCH_LOSS_LOG": str(log), "MEGALAUNCH_TEST_STEP_SLEEP_S": "0.3"})
    wait_for(lambda: last_iteration(log) >= 5, timeout=300, what="iteration 5", trainer=t)
    t.signal()
    assert t.wait(300) == [0], _log(t)[-3000:]
    assert f"documents {done}..16" in _log(t)  # continued where segment 1 stopped
    stopped = t.outcome()
    assert stopped["status"] == "saved" and 5 <= stopped["iteration"] < 8, stopped  # mid-round 2
    t = Trainer(chain, job_id="73", env={"MEGALAUNCH_LOSS_LOG": str(log)})
    assert t.wait(600) == [0], _log(t)[-3000:]
    assert t.outcome()["status"] == "finished", t.outcome()
    ref, got = losses(ref_log), losses(log)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    assert got == ref, {i: (ref[i], got[i]) for i in ref}
    ratios = {i: r["ratio"] for i, r in _metrics(log).items()}
    assert ratios == {i: r["ratio"] for i, r in _metrics(ref_log).items()}, ratios
