"""DPO under the chain (issue 51): preference pairs written by `megalaunch data sft`, a converted Hugging
Face model; the first segment scores the reference (RUN/scores/reference) with the starting model before
iteration 1, then DPO trains: at iteration 1 the policy IS the reference (every pair's log-ratio difference
is 0, the loss log 2: the stored rows line up with the policy's labels), the rewards' accuracy and margin
grow; a stop during the scoring phase resumes it from documents_done and the chain's losses equal an
uninterrupted run's at every iteration; a reference scored by another model, or tampered with, is refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from harness import FAST, Trainer, ledger, run_segment, wait_for
from tests.support.chat import make_chat_model, preference_rows, write_jsonl

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore
from megalaunch.launcher.chain.last_stage import export_hf
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.report.data import gather
from megalaunch.launcher.report.page import render_html
from megalaunch.launcher.status import run_status
from megalaunch.launcher.status_format import format_run_status
from megalaunch.rundir.files import read_jsonl
from megalaunch.runtime.scoring.store import read_meta
from megalaunch.tokenization.chat.build import build

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ITERS = 20


@pytest.fixture(scope="module")
def prep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two converted chat models (seeds 0 and 1) and 64 preference pairs written by `data sft`."""
    root = tmp_path_factory.mktemp("dpo")
    out = {}
    for seed in (0, 1):
        hf = make_chat_model(root / f"hf{seed}", seed=seed)
        hf_to_mcore(hf, root / f"converted{seed}", model=load_recipe("dpo-tiny").recipe.model, vocab_size=512,
                    progress=False)
        out[f"hf{seed}"], out[f"converted{seed}"] = hf, root / f"converted{seed}"
    write_jsonl(root / "pairs" / "train.jsonl", preference_rows(64))
    assert build([str(root / "pairs")], root / "data", tokenizer=out["hf0"], seq_length=64)[0].pairs == 64
    out["data"] = root / "data"
    return out


def _run(root: Path, prep: dict[str, Path], name: str, *more: str, start: str = "converted0"):
    sets = [*FAST, "training.global_batch_size=32", "training.micro_batch_size=4", f"training.train_iters={ITERS}",
            "training.lr=2e-3", "training.min_lr=2e-3", "checkpoint.save_interval=4", "checkpoint.keep_last=20",
            "data.mock=false", f"data.blend=[{{path: {prep['data']}}}]", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={prep['hf0']}", f"checkpoint.load={prep[start]}", "chain.export_hf=false", *more]
    return write_run(prepare_run(load_recipe("dpo-tiny", sets, name=name), root=root))


def _records(log: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in read_jsonl(log)}


def test_dpo_scores_its_reference_trains_and_resumes_exactly(prep: dict[str, Path], tmp_path: Path) -> None:
    straight = _run(tmp_path / "a", prep, "straight")
    ref_log = tmp_path / "straight.jsonl"
    t = run_segment(straight, "100", ref_log, None)
    assert t.outcome()["status"] == "finished", t.log()[-3000:]
    meta = read_meta(straight.root / "scores" / "reference")
    assert meta["complete"] and meta["documents_done"] == {"train": 128} and meta["tokens_per_s"] > 0
    [scored] = ledger(straight, "reference_scored")
    assert scored["documents"] == {"train": 128} and scored["seconds"] > 0
    assert ledger(straight, "reference")[0]["choice"] == "stage"
    ref = _records(ref_log)
    assert sorted(ref) == list(range(1, ITERS + 1))
    # iteration 1: the policy is the reference, h = 0 for every pair: -log sigmoid(0) = log 2 exactly
    assert math.isclose(ref[1]["loss"], math.log(2), rel_tol=1e-5), ref[1]
    m1 = ref[1]["metrics"]
    assert abs(m1["rewards/margin"]) < 1e-5 and m1["rewards/accuracy"] == 0.0, m1
    late = [ref[i]["metrics"] for i in range(ITERS - 3, ITERS + 1)]
    early = [ref[i]["metrics"] for i in range(3, 7)]
    assert min(m["rewards/accuracy"] for m in late) > max(0.9, max(m["rewards/accuracy"] for m in early) - 0.1), late
    assert min(m["rewards/margin"] for m in late) > 2 * max(m["rewards/margin"] for m in early), (early, late)
    assert max(ref[i]["loss"] for i in range(ITERS - 3, ITERS + 1)) < 0.5 * math.log(2)
    text = format_run_status(run_status(straight))  # the flow's metrics and the stored reference, in status
    assert "rewards/accuracy: 1" in text and "reference: 128 documents scored" in text, text
    assert "stored scores: " in text, text
    page = render_html(gather(straight), {})  # and in the report
    assert '<h2 id="flow">Flow metrics</h2>' in page and "rewards/margin" in page

    # the same run stopped twice: during the reference scoring (slowed by the test hook), then mid-training
    chain = _run(tmp_path / "b", prep, "chain")
    log = tmp_path / "chain.jsonl"
    t = Trainer(chain, job_id="201", env={"MEGALAUNCH_LOSS_LOG": str(log), "MEGALAUNCH_TEST_SCORE_ROUND_S": "0.15"})
    wait_for(lambda: t.logs[0].exists() and "reference scoring: train" in t.log(), what="the scoring phase", trainer=t)
    t.signal()
    assert t.wait() == [0], t.log()[-3000:]
    assert t.outcome()["status"] == "saved", t.outcome()
    done = read_meta(chain.root / "scores" / "reference")["documents_done"]["train"]
    assert 0 < done < 128 and not log.exists(), done  # part scored, durable; no iteration ran
    assert run_segment(chain, "202", log, 5).outcome()["status"] == "saved"
    assert "reference scoring: train, documents " + str(done) in (chain.logs / "test-202-rank0.log").read_text()
    assert run_segment(chain, "203", log, None).outcome()["status"] == "finished"
    assert len(ledger(chain, "reference_scored")) == 1
    got = _records(log)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert all(got[i]["loss"] == pytest.approx(ref[i]["loss"], rel=1e-6) for i in ref), (ref, got)
    assert all(got[i]["metrics"] == pytest.approx(ref[i]["metrics"], rel=1e-5, abs=1e-6) for i in ref)
    stored = np.fromfile(chain.root / "scores" / "reference" / "train.logp", dtype=np.float32)
    assert np.array_equal(stored, np.fromfile(straight.root / "scores" / "reference" / "train.logp", dtype=np.float32))


def test_a_reference_of_another_model_or_tampered_is_refused(prep: dict[str, Path], tmp_path: Path) -> None:
    first = _run(tmp_path / "a", prep, "first", "training.train_iters=1", "training.lr_warmup_iters=0")
    assert run_segment(first, "300", tmp_path / "first.jsonl", None).outcome()["status"] == "finished"
    store = first.root / "scores" / "reference"
    assert export_hf(first, "300", print)  # chain.export_hf's last stage works on a DPO checkpoint
    assert json.loads((first.root / "hf" / "config.json").read_text())["num_hidden_layers"] == 2

    # a run from another model given the first one's reference: refused at start, before any iteration
    other = _run(tmp_path / "b", prep, "other", start="converted1")
    shutil.copytree(store, other.root / "scores" / "reference")
    t = Trainer(other, job_id="301")
    assert t.wait() == [1]
    out = t.outcome()
    assert out["status"] == "config_error" and "does not match this run" in out["reason"], out
    assert "computed by model" in out["reason"] and str(prep["converted0"]) in out["reason"], out

    # the same model, its stored rows altered (meta.json untouched): the first micro-batch's check refuses
    tampered = _run(tmp_path / "c", prep, "tampered")
    shutil.copytree(store, tampered.root / "scores" / "reference")
    rows = np.memmap(tampered.root / "scores" / "reference" / "train.logp", dtype=np.float32, mode="r+")
    rows[:] = rows * 0.5
    rows.flush()
    t = Trainer(tampered, job_id="302", env={"MEGALAUNCH_LOSS_LOG": str(tmp_path / "tampered.jsonl")})
    assert t.wait() == [1]
    out = t.outcome()
    assert out["status"] == "config_error" and "does not match the starting model" in out["reason"], out
    assert not (tmp_path / "tampered.jsonl").exists()  # no iteration was reported


def test_online_reference_equals_the_stored_one_and_resumes_exactly(prep: dict[str, Path], tmp_path: Path) -> None:
    """reference online: a frozen copy loaded from the starting checkpoint in every segment (not a copy of the
    policy, which a resumed segment no longer starts from); its losses and metrics equal the stage's."""
    stage = _run(tmp_path / "a", prep, "stage", "post_training.reference=stage", "training.train_iters=8")
    stage_log = tmp_path / "stage.jsonl"
    assert run_segment(stage, "500", stage_log, None).outcome()["status"] == "finished"
    online = _run(tmp_path / "b", prep, "online", "post_training.reference=online", "training.train_iters=8")
    log = tmp_path / "online.jsonl"
    assert run_segment(online, "501", log, 3).outcome()["status"] == "saved"
    assert run_segment(online, "502", log, None).outcome()["status"] == "finished"
    assert not (online.root / "scores").exists() and ledger(online, "reference")[0]["choice"] == "online"
    ref, got = _records(stage_log), _records(log)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    assert math.isclose(got[1]["loss"], math.log(2), rel_tol=1e-6)
    assert all(got[i]["loss"] == pytest.approx(ref[i]["loss"], rel=1e-5) for i in ref), (ref, got)
    assert all(got[i]["metrics"] == pytest.approx(ref[i]["metrics"], rel=1e-4, abs=1e-5) for i in ref), (ref, got)


@pytest.mark.parametrize("layout", [("dp2", "cluster.tasks_per_node=2"),
                                    ("tp2", "cluster.tasks_per_node=2", "parallel.tensor_model_parallel_size=2")])
def test_reference_scoring_shards_over_data_parallel_ranks(prep: dict[str, Path], tmp_path: Path,
                                                           layout: tuple[str, ...]) -> None:
    """DP 2: each rank scores its share of every round, rank 0 writes them in order: the same store bytes as
    DP 1; TP 2: both ranks score the same documents together (the same rows, to float rounding of the split
    matmuls). The losses equal one rank's (float rounding aside)."""
    got = {}
    for name, *sets in (("one",), layout):
        paths = _run(tmp_path / name, prep, name, "training.train_iters=3", *sets)
        log = tmp_path / f"{name}.jsonl"
        world = 2 if sets else 1
        t = Trainer(paths, world=world, env={"MEGALAUNCH_LOSS_LOG": str(log), "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert t.wait() == [0] * world, t.log()[-3000:]
        got[name] = (_records(log), np.fromfile(paths.root / "scores" / "reference" / "train.logp", dtype=np.float32))
    one, other = got["one"], got[layout[0]]
    if layout[0] == "dp2":
        assert np.array_equal(one[1], other[1])
    np.testing.assert_allclose(other[1], one[1], rtol=1e-5, atol=1e-5)
    assert all(other[0][i]["loss"] == pytest.approx(one[0][i]["loss"], rel=1e-5) for i in (1, 2, 3)), got
