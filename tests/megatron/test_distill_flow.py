"""Distillation under the chain (post_training.method distill, runtime/flows/distill.py): a tiny student converted
from Hugging Face learns a different tiny teacher's stored top-k on chat data: its KL to the teacher falls over
20 iterations, the flow's metrics are reported, two segments stopped by SIGUSR2 give the losses of an
uninterrupted run at every iteration, tensor parallelism 2 (the vocabulary-parallel log-softmax and gathers)
gives TP 1's losses, and the teacher online (in the rank's process) gives the stored teacher's."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from harness import FAST, Trainer, ledger, losses, run_segment
from tests.support.chat import chat_rows, make_chat_model, write_jsonl

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.scoring.teacher import run_teacher_stage
from megalaunch.tokenization.chat.build import build

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

ITERS = 20


@pytest.fixture(scope="module")
def prep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A converted student, a different teacher of the same tokenizer, chat data, and the teacher's scores."""
    root = tmp_path_factory.mktemp("distill")
    student = make_chat_model(root / "student", seed=0)
    teacher = make_chat_model(root / "teacher", seed=7)
    write_jsonl(root / "chats" / "train.jsonl", chat_rows(64))
    build([str(root / "chats")], root / "data", tokenizer=student, seq_length=64)
    hf_to_mcore(student, root / "converted", model=load_recipe("distill-tiny").recipe.model, vocab_size=512,
                progress=False)
    prep = {"student": student, "teacher": teacher, "data": root / "data", "converted": root / "converted"}
    scored = _run(root / "scored", prep, "scored")
    run_teacher_stage(scored.root, device="cpu", log=lambda _: None)
    return {**prep, "scores": scored.root / "scores" / "teacher"}


def _run(root: Path, prep: dict[str, Path], name: str, *more: str) -> RunPaths:
    sets = [*FAST, "training.global_batch_size=4", "training.micro_batch_size=2", f"training.train_iters={ITERS}",
            "checkpoint.save_interval=4", "checkpoint.keep_last=20", "data.mock=false",
            f"data.blend=[{{path: {prep['data']}}}]", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={prep['student']}", f"checkpoint.load={prep['converted']}",
            f"post_training.teacher={prep['teacher']}", "post_training.teacher_top_k=16", *more]
    paths = write_run(prepare_run(load_recipe("distill-tiny", sets, name=name), root=root))
    if "scores" in prep and "post_training.teacher_mode=online" not in more:  # as the first stage would write them
        shutil.copytree(prep["scores"], paths.root / "scores" / "teacher")
    return paths


def test_the_students_kl_falls_and_resumes_exactly_under_the_chain(prep: dict[str, Path], tmp_path: Path) -> None:
    straight = _run(tmp_path / "a", prep, "straight")
    ref_log = tmp_path / "straight.jsonl"
    t = run_segment(straight, "100", ref_log, None)
    assert t.outcome()["status"] == "finished"
    assert all(name in t.log() for name in ("distill kl", "hard-label ce", "top-1 agreement"))
    ref = losses(ref_log)
    assert sorted(ref) == list(range(1, ITERS + 1))
    first, last = sum(ref[i] for i in range(1, 5)) / 4, sum(ref[i] for i in range(ITERS - 3, ITERS + 1)) / 4
    assert last < 0.8 * first, ref  # the KL to the teacher (the loss, hard_label_weight 0) falls

    chain = _run(tmp_path / "b", prep, "chain")
    log = tmp_path / "chain.jsonl"
    stopped = run_segment(chain, "201", log, 7).outcome()
    assert stopped["status"] == "saved", stopped
    assert run_segment(chain, "202", log, None).outcome()["status"] == "finished"
    assert [r["consumed_samples"] for r in ledger(chain, "resumed")] == [4 * stopped["iteration"]]
    got = losses(log)
    assert sorted(got) == sorted(ref)
    assert all(math.isclose(got[i], ref[i], rel_tol=1e-6) for i in ref), {i: (ref[i], got[i]) for i in ref}


def test_tensor_parallel_distillation_equals_tp1(prep: dict[str, Path], tmp_path: Path) -> None:
    """TP 2: each rank holds half the vocabulary's logits; the log-softmax, the teacher's ids and the labels are
    reduced across the two, so the losses are TP 1's (to the rounding of the split matmuls), reverse KL with
    a temperature and the hard-label mix included."""
    got = {}
    for tp in (1, 2):
        paths = _run(tmp_path / f"tp{tp}", prep, f"tp{tp}", "training.train_iters=4",
                     "post_training.kl_direction=reverse", "post_training.temperature=2.0",
                     "post_training.hard_label_weight=0.25",
                     f"parallel.tensor_model_parallel_size={tp}", f"cluster.tasks_per_node={tp}")
        log = tmp_path / f"tp{tp}.jsonl"
        t = Trainer(paths, world=tp, env={"MEGALAUNCH_LOSS_LOG": str(log), "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        assert t.wait() == [0] * tp, t.log()[-3000:]
        got[tp] = losses(log)
    assert sorted(got[1]) == sorted(got[2]) == [1, 2, 3, 4]
    assert all(math.isclose(got[1][i], got[2][i], rel_tol=1e-5) for i in got[1]), got


def test_an_online_teacher_trains_the_student_as_the_stored_one(prep: dict[str, Path], tmp_path: Path) -> None:
    """teacher_mode online: no store, the teacher (transformers, in the rank's process) scores each micro-batch;
    the losses equal those from the first stage's store (both float32 on the CPU)."""
    got = {}
    for mode in ("stage", "online"):
        paths = _run(tmp_path / mode, prep, mode, "training.train_iters=4", f"post_training.teacher_mode={mode}")
        log = tmp_path / f"{mode}.jsonl"
        t = Trainer(paths, env={"MEGALAUNCH_LOSS_LOG": str(log)})
        assert t.wait() == [0], t.log()[-3000:]
        got[mode] = losses(log)
        assert (paths.root / "scores" / "teacher").exists() == (mode == "stage")
    assert "runs online" in t.log()
    assert sorted(got["stage"]) == sorted(got["online"]) == [1, 2, 3, 4]
    assert all(math.isclose(got["stage"][i], got["online"][i], rel_tol=1e-5) for i in got["stage"]), got
