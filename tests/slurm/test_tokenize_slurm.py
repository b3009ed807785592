"""Acceptance on the real local Slurm cluster: a tokenization job array over a generated
multi-file corpus; one dump scancel'ed halfway, resubmitted, finishes without duplicated or missing
documents — the tokens in the .bin files equal tokenizing the inputs directly, document by document."""

from __future__ import annotations

import json
import os
import sys

import pytest
from cluster import job_state, wait_for, wait_job_done

pytest.importorskip("datatrove")
pytest.importorskip("tokenizers")

from tests.support.corpus import documents, train_bpe_tokenizer, write_jsonl_corpus

from megalaunch.config.typed import build
from megalaunch.data.blend import resolve_blend
from megalaunch.data.check import check_paths
from megalaunch.data.index import read_documents
from megalaunch.launcher.backends.slurm import SlurmClient
from megalaunch.tokenization.encoder import load_encoder
from megalaunch.tokenization.recipe import TokenizeRecipe
from megalaunch.tokenization.status import dump_statuses
from megalaunch.tokenization.submit import create_run, submit

TASKS = 4


def _expected(plan, enc):
    out = {}
    for dump in plan.dumps:
        for t, files in enumerate(dump.tasks):
            docs = []
            for f in files:
                with open(f.path) as fh:
                    docs += [enc.encode_one(json.loads(line)["text"]) for line in fh]
            out[dump.output_name(t)] = docs
    return out


def test_job_array_resumes_a_dump_cancelled_halfway(slurm_tmp, monkeypatch):
    write_jsonl_corpus(slurm_tmp / "raw", n_files=2 * TASKS, docs_per_file=30, seed=7, mean_words=40)
    tok = train_bpe_tokenizer(slurm_tmp / "tokenizer.json", list(documents(200, seed=8, mean_words=40)),
                              vocab_size=500)
    recipe = build(TokenizeRecipe, {
        "name": "acc", "inputs": {"roots": [str(slurm_tmp / "raw")]},
        "tokenizer": {"path": str(tok), "eos": "<|endoftext|>", "batch_size": 5},
        "n_dumps": 2, "tasks": TASKS, "workers": 1,
        "slurm": {"time": "00:05:00", "max_concurrent": 2, "python": sys.executable}})
    run, plan = create_run(recipe, slurm_tmp / "run")
    # 6 batches of 0.4 s per task: ~2.5 s per task, 4 tasks one after another per dump
    monkeypatch.setenv("MEGALAUNCH_TOKENIZE_BATCH_DELAY_S", "0.4")
    monkeypatch.setenv("MEGALAUNCH_TOKENIZE_PROGRESS_S", "0.5")
    first = submit(run)
    assert first is not None and first.backend == "slurm" and first.dumps == (0, 1)
    script = run.job_script.read_text()
    assert "#SBATCH --no-requeue" in script and "--gpus" not in script

    def completed(dump):
        return sum(run.completion(dump, t).exists() for t in range(TASKS))

    wait_for(lambda: completed(0) >= 2, timeout=120, interval=0.1, what="two tasks of dump 0 to complete")
    assert completed(0) < TASKS, "dump 0 finished before it could be cancelled: raise the delay"
    SlurmClient().scancel([f"{first.job_id}_0"])
    assert wait_job_done(f"{first.job_id}_0", timeout=60) == "CANCELLED"
    assert wait_job_done(f"{first.job_id}_1", timeout=120) == "COMPLETED"
    done_before = {t for t in range(TASKS) if run.completion(0, t).exists()}
    assert 2 <= len(done_before) < TASKS
    mtimes = {t: os.stat(run.root / "output" / f"{plan.dumps[0].output_name(t)}.bin").st_mtime_ns
              for t in done_before}
    states = {s.index: s.state for s in dump_statuses(run)}
    assert states == {0: "cancelled", 1: "done"}

    second = submit(run)  # resubmits only what is not done
    assert second is not None and second.dumps == (0,) and second.job_id != first.job_id
    assert wait_job_done(f"{second.job_id}_0", timeout=120) == "COMPLETED", \
        (run.logs / f"tok-acc-{second.job_id}_0.out").read_text()
    assert [s.state for s in dump_statuses(run)] == ["done", "done"]
    for t in done_before:  # completed tasks were skipped, not redone
        assert os.stat(run.root / "output" / f"{plan.dumps[0].output_name(t)}.bin").st_mtime_ns == mtimes[t]
    assert job_state(f"{second.job_id}_0") == "COMPLETED"

    # exact tokens, document by document, no duplicates, nothing missing, no leftovers
    enc = load_encoder(str(tok), bos=None, eos="<|endoftext|>")
    actual = {d.output_name(t): [list(map(int, x)) for x in read_documents(run.root / "output" / d.output_name(t))]
              for d in plan.dumps for t in range(len(d.tasks))}
    assert actual == _expected(plan, enc)
    assert sum(len(v) for v in actual.values()) == 2 * TASKS * 30
    assert sorted(p.name for p in (run.root / "output").iterdir()) == sorted(
        f"{d.output_name(t)}.{s}" for d in plan.dumps for t in range(len(d.tasks)) for s in ("bin", "idx"))
    assert all(r.ok for r in check_paths([str(run.root / "output")], vocab_size=500))
    assert len(resolve_blend([(str(run.root / "output"), None)]).prefixes) == 2 * TASKS
