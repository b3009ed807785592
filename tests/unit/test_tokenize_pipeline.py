"""The tokenization stage end to end on the local backend: plan -> dumps -> .bin/.idx equal to
tokenizing every input document directly; a relaunch resumes from datatrove's completion markers."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("datatrove")
pytest.importorskip("tokenizers")

from tests.support.corpus import documents, train_bpe_tokenizer, write_jsonl_corpus

from megalaunch.config.typed import build
from megalaunch.data.index import read_documents
from megalaunch.tokenization.encoder import load_encoder
from megalaunch.tokenization.recipe import TokenizeRecipe
from megalaunch.tokenization.status import dump_statuses, totals
from megalaunch.tokenization.submit import create_run, submit


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl_corpus(root / "raw" / "a", n_files=3, docs_per_file=40, seed=1, mean_words=40)
    write_jsonl_corpus(root / "raw" / "b", n_files=2, docs_per_file=30, seed=2, mean_words=40, compress=True)
    (root / "raw" / "notes.txt").write_text("not an input\n")
    tok = train_bpe_tokenizer(root / "tok" / "tokenizer.json", list(documents(200, seed=3, mean_words=40)),
                              vocab_size=500)
    return root, tok


def _recipe(corpus_root, tok, **over):
    data = {"name": "t", "inputs": {"roots": [str(corpus_root / "raw")]},
            "tokenizer": {"path": str(tok), "bos": "<|begin_of_text|>", "batch_size": 7},
            "n_dumps": 2, "tasks": 2, "workers": 1, "backend": "local"}
    data.update(over)
    return build(TokenizeRecipe, data)


def _expected(run, plan, recipe):
    enc = load_encoder(recipe.tokenizer.path, bos=recipe.tokenizer.bos, eos=recipe.tokenizer.eos)
    out = {}
    for dump in plan.dumps:
        for t, files in enumerate(dump.tasks):
            docs = []
            for f in files:
                import gzip

                opener = gzip.open if f.path.endswith(".gz") else open
                with opener(f.path, "rt") as fh:
                    docs += [enc.encode_one(json.loads(line)["text"]) for line in fh]
            out[dump.output_name(t)] = docs
    return out


def _actual(run, plan):
    return {d.output_name(t): [list(map(int, x)) for x in read_documents(run.root / "output" / d.output_name(t))]
            for d in plan.dumps for t in range(len(d.tasks))}


def test_local_backend_tokenizes_every_document_exactly(corpus, tmp_path):
    root, tok = corpus
    recipe = _recipe(root, tok)
    run, plan = create_run(recipe, tmp_path / "run")
    assert plan.n_files == 5 and len(plan.dumps) == 2
    sub = submit(run)
    assert sub is not None and sub.backend == "local" and sub.dumps == (0, 1)
    assert _actual(run, plan) == _expected(run, plan, recipe)
    statuses = dump_statuses(run)
    assert [s.state for s in statuses] == ["done", "done"]
    assert totals(statuses)["documents"] == 180
    assert submit(run) is None  # nothing left to do


def test_relaunch_reruns_only_incomplete_tasks(corpus, tmp_path):
    root, tok = corpus
    recipe = _recipe(root, tok, n_dumps=1, tasks=3, tokenizer={"path": str(tok), "eos": "<|endoftext|>"})
    run, plan = create_run(recipe, tmp_path / "run")
    submit(run)
    out = run.root / "output"
    kept = os.stat(out / "dump0000_task00000.bin").st_mtime_ns
    # a job killed while task 1 ran: no completion marker, no summary, a half-written temporary file
    os.unlink(run.completion(0, 1))
    os.unlink(run.summary(0))
    os.unlink(out / "dump0000_task00001.bin")
    os.unlink(out / "dump0000_task00001.idx")
    (out / "dump0000_task00001.bin.tmp").write_bytes(b"\x01\x02half")
    assert [s.state for s in dump_statuses(run)] == ["stopped"]
    submit(run)
    assert os.stat(out / "dump0000_task00000.bin").st_mtime_ns == kept  # completed task skipped
    assert not (out / "dump0000_task00001.bin.tmp").exists()
    assert _actual(run, plan) == _expected(run, plan, recipe)
    assert sorted(p.name for p in out.iterdir()) == [f"dump0000_task0000{i}.{s}" for i in range(3)
                                                     for s in ("bin", "idx")]


def test_parallel_workers_and_datatrove_compatibility(corpus, tmp_path):
    """workers=2 runs tasks in datatrove's process pool; the tokens equal those written by datatrove's
    own MegatronDocumentTokenizer for the same files."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

    root, tok = corpus
    recipe = _recipe(root, tok, n_dumps=1, tasks=2, workers=2,
                     tokenizer={"path": str(tok), "eos": "<|endoftext|>"},
                     inputs={"roots": [str(root / "raw" / "a")]})
    run, plan = create_run(recipe, tmp_path / "run")
    submit(run)
    ours = [list(map(int, d)) for t in range(2) for d in read_documents(run.root / "output" / plan.dumps[0].output_name(t))]
    theirs_dir = tmp_path / "datatrove"
    LocalPipelineExecutor([JsonlReader(str(root / "raw" / "a")),
                           MegatronDocumentTokenizer(str(theirs_dir), tokenizer_name_or_path=str(tok))],
                          tasks=1, workers=1, logging_dir=str(tmp_path / "dtlogs")).run()
    theirs = [list(map(int, d)) for d in read_documents(theirs_dir / "00000_tokens")]
    assert sorted(ours) == sorted(theirs) and len(ours) == 120


@pytest.mark.megatron
def test_megatron_reads_the_pipeline_output(corpus, tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    root, tok = corpus
    recipe = _recipe(root, tok, n_dumps=1, tasks=1, inputs={"roots": [str(root / "raw" / "b")]})
    run, plan = create_run(recipe, tmp_path / "run")
    submit(run)
    prefix = str(run.root / "output" / plan.dumps[0].output_name(0))
    ds = indexed.IndexedDataset(prefix)
    assert [list(map(int, ds[i])) for i in range(len(ds))] == _expected(run, plan, recipe)[plan.dumps[0].output_name(0)]
