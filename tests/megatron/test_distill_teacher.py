"""Distillation's teacher stage (runtime/scoring/teacher.py) run by the chain's first stage: the stored top-k
rows equal transformers' own log-softmax of the teacher, a stage stopped midway continues from documents_done
to the same store, a complete store is not scored again, and a teacher of another vocabulary is refused
(one line naming post_training.teacher) before anything is scored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests.support.chat import chat_rows, make_chat_model, write_jsonl

from megalaunch.config.loader import load_recipe
from megalaunch.data.index import read_documents
from megalaunch.launcher.chain.first_stage import score_teacher
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.scoring.store import ScoreReader, read_meta
from megalaunch.runtime.scoring.teacher import TeacherRefused, run_teacher_stage
from megalaunch.tokenization.chat.build import build

pytestmark = [pytest.mark.megatron]

K = 8


@pytest.fixture(scope="module")
def prep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teacher")
    student = make_chat_model(root / "student", seed=0)
    teacher = make_chat_model(root / "teacher", seed=1)
    other = make_chat_model(root / "other", vocab_size=384, seed=2)
    write_jsonl(root / "chats" / "train.jsonl", chat_rows(24))
    build([str(root / "chats")], root / "data", tokenizer=student, seq_length=64)
    return {"student": student, "teacher": teacher, "other": other, "data": root / "data"}


def _run(root: Path, prep: dict[str, Path], teacher: Path) -> RunPaths:
    sets = ["data.mock=false", f"data.blend=[{{path: {prep['data']}}}]", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={prep['student']}", f"post_training.teacher={teacher}",
            f"post_training.teacher_top_k={K}"]
    return write_run(prepare_run(load_recipe("distill-tiny", sets, name="distill"), root=root))


def _store_arrays(paths: RunPaths) -> dict[str, np.ndarray]:
    store = paths.root / "scores" / "teacher"
    return {p.name: np.fromfile(p, dtype=np.int32 if p.name.endswith("ids") else np.float32)
            for p in sorted(store.iterdir()) if p.name.endswith(("topk_ids", "topk_logp"))}


def test_teacher_rows_are_transformers_log_softmax_and_a_stopped_stage_continues(prep, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    paths = _run(tmp_path / "a", prep, prep["teacher"])
    lines: list[str] = []
    failed = score_teacher(paths, RuntimeSettings.load(paths).post_training, "11", lines.append)
    assert failed is None, failed
    meta = read_meta(paths.root / "scores" / "teacher")
    assert meta and meta["complete"] and meta["top_k"] == K and meta["tokens_per_s"] > 0
    [event] = [e for e in read_jsonl(paths.ledger) if e.get("event") == "teacher_scored"]
    assert event["ok"] and event["tokens_per_s"] > 0 and event["top_k"] == K
    assert score_teacher(paths, RuntimeSettings.load(paths).post_training, "12", lines.append) is None
    assert sum(e.get("event") == "teacher_scored" for e in read_jsonl(paths.ledger)) == 1  # complete: not again

    prefix = sorted({str(p)[:-4] for p in prep["data"].rglob("*.idx")})[0]
    reader = ScoreReader(paths.root / "scores" / "teacher", prefixes=[prefix])
    model = AutoModelForCausalLM.from_pretrained(str(prep["teacher"]), dtype=torch.float32).eval()
    docs = read_documents(prefix)
    for d in (0, 7, len(docs) - 1):
        tokens = torch.tensor(np.asarray(docs[d][:65], dtype=np.int64))[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=tokens).logits[0].double(), -1)
        ids, values = reader.get(Path(prefix).name, d)
        assert (ids[0] == 0).all() and (values[0] == 0).all()  # row 0 predicts nothing
        for j in range(1, tokens.shape[1]):
            want = logp[j - 1]
            assert np.allclose(values[j], want[np.array(ids[j], dtype=np.int64)].numpy(), atol=1e-5)  # the log-probabilities of those ids
            assert np.allclose(values[j], torch.topk(want, K).values.numpy(), atol=1e-5)  # and they are the top k

    # a stage stopped after its first flush continues from documents_done to the same rows
    again = _run(tmp_path / "b", prep, prep["teacher"])
    seen: list[str] = []

    def stop_after_first_flush(line: str) -> None:
        seen.append(line)
        if "documents," in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_teacher_stage(again.root, batch_tokens=130, flush_s=0.0, device="cpu", log=stop_after_first_flush)
    stopped = read_meta(again.root / "scores" / "teacher")
    assert stopped and not stopped["complete"] and 0 < next(iter(stopped["documents_done"].values())) < len(docs)
    resumed: list[str] = []
    run_teacher_stage(again.root, batch_tokens=130, flush_s=0.0, device="cpu", log=resumed.append)
    assert not any("afresh" in line for line in resumed), resumed
    done = read_meta(again.root / "scores" / "teacher")
    assert done and done["complete"] and done["tokens_scored"] == sum(min(len(d), 65) for d in docs)  # none twice
    a, b = _store_arrays(paths), _store_arrays(again)
    assert a.keys() == b.keys() and all(np.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_a_teacher_with_another_vocabulary_is_refused(prep, tmp_path: Path) -> None:
    paths = _run(tmp_path, prep, prep["other"])
    with pytest.raises(TeacherRefused) as e:
        run_teacher_stage(paths.root, device="cpu", log=lambda _: None)
    assert "post_training.teacher" in str(e.value) and "differs" in str(e.value) and "\n" not in str(e.value)
    failed = score_teacher(paths, RuntimeSettings.load(paths).post_training, "21", lambda _: None)
    assert failed is not None and "post_training.teacher" in failed.reason and "differs" in failed.reason
    assert not (paths.root / "scores" / "teacher" / "meta.json").exists()  # nothing scored


def test_a_megatron_teacher_is_converted_first_and_scores_as_its_hugging_face_original(prep, tmp_path: Path) -> None:
    """A teacher given as a megatron checkpoint (here the HF teacher converted with hf_to_mcore) is converted back
    with `convert mcore-to-hf` into RUN/scores/teacher_hf, checked, scored, and the conversion removed: its rows
    equal the Hugging Face original's."""
    from megalaunch.conversion import hf_to_mcore

    hf_to_mcore(prep["teacher"], tmp_path / "mcore", model=load_recipe("distill-tiny").recipe.model, vocab_size=512,
                progress=False)
    runs = {name: _run(tmp_path / name, prep, teacher) for name, teacher in
            (("hf", prep["teacher"]), ("mcore", tmp_path / "mcore"))}
    lines: list[str] = []
    for paths in runs.values():
        run_teacher_stage(paths.root, device="cpu", log=lines.append)
    assert any("converting the megatron checkpoint" in line for line in lines), lines
    assert not (runs["mcore"].root / "scores" / "teacher_hf").exists()
    a, b = _store_arrays(runs["hf"]), _store_arrays(runs["mcore"])
    assert a.keys() == b.keys() and all(np.allclose(a[k], b[k], atol=1e-4) for k in a)
    assert read_meta(runs["mcore"].root / "scores" / "teacher")["model"]["source"] == str(tmp_path / "mcore")
