"""Evaluation at milestones on the local backend, the way a user runs it (`megalaunch submit`, the
real trainer on the CPU): the tiny model on a corpus it learns in a few dozen steps, a milestone every
50 iterations; each milestone is queued by rank 0 and evaluated once by the background worker
(converted to Hugging Face, held-out perplexity on the validation split, a local task), results in
RUN/evals/<iteration>/results.json, perplexity decreasing; `eval RUN` by hand is idempotent. A broken
task fails every eval with its reason in `eval status`, and the chain still trains to its target."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support import forkserver
from tests.support.eval_data import EvalData, make_eval_data

from megalaunch.rundir.evals import EvalPaths, eval_records
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.paths import RunPaths

# find_spec, not importorskip: importing transformers in every pytest-xdist worker's collection costs ~1 CPU-s
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "tokenizers")),
                                 reason="needs transformers and tokenizers")]


def _recipe(tmp: Path, data: EvalData, *, train_iters: int, tasks: list[dict[str, str]],
            **eval_: Any) -> Path:
    recipe = {
        "include": ["tiny"], "name": "evaltiny", "run": {"root": str(tmp / "runs")},
        "cluster": {"python": forkserver.python(), "time": "00:10:00", "env": {"OMP_NUM_THREADS": "1"}},
        "data": {"mock": False, "blend": [{"path": str(data.prefix)}], "split": "90,10,0",
                 "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(data.tokenizer)},
        # 8 x 64 tokens per step; Megatron validates once (eval_iters 1) because the split has a valid share
        "training": {"train_iters": train_iters, "micro_batch_size": 8, "global_batch_size": 8, "log_interval": 10,
                     "eval_iters": 1},
        "checkpoint": {"save_interval": 50, "milestone_interval": 50, "keep_last": 1},
        "eval": {"enabled": True, "heldout_sequences": 16, "local_tasks": tasks, **eval_},
    }
    path = tmp / "evaltiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`megalaunch ARGS` forked from the fork server (torch and Megatron imported once: `eval` converts with
    Megatron, and its completeness check unpickles torch's checkpoint metadata), or a fresh interpreter with
    MEGALAUNCH_TEST_FORK=0. Nothing here is about start-up (test_convert_quiet.py checks the CLI's imports)."""
    p = subprocess.run([forkserver.python(), "-m", "megalaunch.cli.main", *args], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=300)
    assert not check or p.returncode == 0, p.stdout + p.stderr
    return p


def _submit(recipe: Path, tmp: Path) -> RunPaths:
    _cli("submit", str(recipe))
    (run,) = [p for p in (tmp / "runs").iterdir() if not p.name.startswith(".")]
    return RunPaths(run)


def _wait_settled(paths: RunPaths, iterations: list[int], timeout: float = 180) -> list[dict[str, Any]]:
    """Until every one of `iterations` is done or failed (the background worker's verdicts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = eval_records(paths)
        if [r["iteration"] for r in records] == iterations and all(r["state"] in ("done", "failed") for r in records):
            return records
        time.sleep(0.5)
    log = paths.evals / "local-worker.log"
    raise AssertionError(f"evals not settled: {eval_records(paths)}\n{log.read_text()[-3000:] if log.exists() else ''}")


@pytest.mark.timeout(300)
def test_each_milestone_is_evaluated_once_and_perplexity_falls(tmp_path: Path) -> None:
    data = make_eval_data(tmp_path / "data")
    paths = _submit(_recipe(tmp_path, data, train_iters=200,
                            tasks=[{"name": "next_word", "path": str(data.task)}]), tmp_path)
    assert read_json(paths.outcome)["status"] == "finished"
    records = _wait_settled(paths, [50, 100, 150, 200])
    assert [r["state"] for r in records] == ["done"] * 4, records
    ppl = [r["heldout_ppl"] for r in records]
    assert all(a > b for a, b in itertools.pairwise(ppl)), ppl  # learning shows on held-out data
    assert ppl[0] > 2 * ppl[-1], ppl
    results = json.loads(EvalPaths(paths, 200).results.read_text())
    assert results["iteration"] == 200 and results["tokens"] == 200 * 8 * 64
    assert results["heldout"]["sequences"] == 16 and results["heldout"]["tokens"] == 16 * 64
    assert "validation split 90,10,0" in results["heldout"]["source"]
    assert results["tasks"]["next_word"]["n"] == 24 and results["tasks"]["next_word"]["runner"] == "megalaunch"
    assert results["tasks"]["next_word"]["acc"] > 0.9  # the cycle is learnt: the next word is right
    # one eval per milestone: queued once each by rank 0, run once each
    events = read_jsonl(paths.ledger)
    assert sorted(e["iteration"] for e in events if e["event"] == "eval_queued") == [50, 100, 150, 200]
    assert sorted(e["iteration"] for e in events if e["event"] == "eval_done") == [50, 100, 150, 200]
    assert not any(EvalPaths(paths, it).hf.exists() for it in (50, 100, 150, 200))  # converted dirs cleaned up
    status = _cli("eval", "status", str(paths.root)).stdout
    assert "iteration 50: done" in status and "held-out ppl" in status and "next_word acc" in status
    assert "evals:" in _cli("status", str(paths.root), "--evals").stdout
    _cli("report", str(paths.root), "--out", str(tmp_path / "report"))  # and in the report
    html = next((tmp_path / "report").glob("*.html")).read_text()
    assert 'id="evals"' in html and html.count('class="eval-row"') == 4 and f"{ppl[-1]:.4g}" in html
    # by hand, again: idempotent (nothing re-run), unless --force
    before = EvalPaths(paths, 100).results.stat().st_mtime_ns
    again = _cli("eval", str(paths.root), "--iteration", "100")
    assert "already evaluated" in again.stdout
    assert EvalPaths(paths, 100).results.stat().st_mtime_ns == before


@pytest.mark.timeout(300)
def test_a_broken_task_fails_its_evals_not_training(tmp_path: Path) -> None:
    data = make_eval_data(tmp_path / "data")
    tasks = [{"name": "next_word", "path": str(data.task)}, {"name": "broken", "path": str(data.broken_task)}]
    paths = _submit(_recipe(tmp_path, data, train_iters=100, tasks=tasks, task_paths=[str(data.lm_eval_tasks)]),
                    tmp_path)
    outcome = read_json(paths.outcome)
    assert outcome["status"] == "finished" and outcome["iteration"] == 100
    records = _wait_settled(paths, [50, 100])
    assert [r["state"] for r in records] == ["failed", "failed"]
    assert "task broken" in records[0]["reason"] and "line 2: answer 7" in records[0]["reason"]
    status = _cli("eval", "status", str(paths.root)).stdout
    assert "iteration 50: failed" in status and "answer 7 is not an index" in status
    assert not EvalPaths(paths, 50).hf.exists()
    # by hand, the good task and the same questions as an lm-eval task (a YAML of eval.task_paths over the
    # local JSON file): the same iteration evaluates now, here in the foreground, offline
    by_hand = _cli("eval", str(paths.root), "--iteration", "50", "--tasks", "next_word,cycle_mc")
    assert "evaluated iteration 50" in by_hand.stdout
    assert EvalPaths(paths, 50).read_state()["state"] == "done"
    tasks_run = json.loads(EvalPaths(paths, 50).results.read_text())["tasks"]
    assert set(tasks_run) == {"next_word", "cycle_mc"} and tasks_run["cycle_mc"]["runner"] == "lm-eval"
    assert tasks_run["cycle_mc"]["acc"] == pytest.approx(tasks_run["next_word"]["acc"])  # two runners, one answer
