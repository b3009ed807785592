"""The eval stage's parts without a model: the recipe section and its preflight (one-line errors that
name the field, nothing written), the validation split as Megatron cuts it, local task files, the
eval job script (quoted, valid bash), rank 0's queue (idempotent, retention keeps pending evals),
the records `eval status` shows, and the W&B keys. Runs in ~3 s."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.errors import ConfigError, PreflightError
from megalaunch.rundir.evals import EvalPaths, eval_records, format_eval_records, pending_iterations
from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.paths import RunPaths


def _data(tmp: Path) -> list[str]:
    from megalaunch.data.writer import write_dataset

    prefix = tmp / "data" / "d"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_dataset(prefix, [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 20)
    return [f"data.blend=[{{path: {prefix}}}]", "data.mock=false"]


def _preflight(*sets: str) -> None:
    from megalaunch.config.preflight import preflight

    preflight(load_recipe("tiny", list(sets)).recipe)


@pytest.mark.parametrize(("sets", "field", "says"), [
    (["eval.enabled=true"], "eval.interval", "no iteration is evaluated"),
    (["eval.enabled=true", "eval.interval=30"], "eval.interval", "not a multiple of checkpoint.save_interval 50"),
    (["eval.enabled=true", "checkpoint.milestone_interval=50"], "eval.heldout_sequences", "mock data"),
    (["eval.enabled=true", "checkpoint.milestone_interval=50", "DATA"], "data.split", "no validation split"),
    (["eval.enabled=true", "checkpoint.milestone_interval=50", "DATA", "data.split=90,10,0", "training.eval_iters=1",
      "eval.local_tasks=[{name: t, path: /nonexistent.jsonl}]"], "eval.local_tasks", "NullTokenizer"),
    (["DATA", "data.split=90,10,0"], "training.eval_iters", "validation split but training.eval_iters is 0"),
    (["eval.partition=a b"], "eval.partition", "#SBATCH"),
])
def test_preflight_names_the_field(sets: list[str], field: str, says: str, tmp_path: Path) -> None:
    data = _data(tmp_path)
    sets = [s for x in sets for s in (data if x == "DATA" else [x])]
    with pytest.raises(PreflightError) as e:
        _preflight(*sets)
    assert e.value.field == field and says in str(e.value) and e.value.fix and "\n" not in str(e.value)


def test_schema_refuses_bad_values() -> None:
    for sets, says in ((["eval.batch_size=0"], "eval.batch_size"), (["eval.time=soon"], "time"),
                       (["eval.local_tasks=[{name: 'a b', path: x}]"], "eval.local_tasks"),
                       (["eval.tasks=[a]", "eval.local_tasks=[{name: a, path: x}]"], "repeat"),
                       (["eval.intervl=5"], "interval")):
        with pytest.raises(ConfigError, match=says):
            load_recipe("tiny", sets)


def test_a_good_eval_section_passes_and_reaches_the_runtime(tmp_path: Path) -> None:
    from megalaunch.launcher.prepare.prepare import prepare_run

    loaded = load_recipe("tiny", [*_data(tmp_path), "data.split=90,10,0", "training.eval_iters=1",
                                  "eval.enabled=true", "checkpoint.milestone_interval=100", "cluster.backend=slurm",
                                  "cluster.gpus_per_node=0"])
    prepared = prepare_run(loaded, root=tmp_path / "runs")
    runtime = json.loads(prepared.files["runtime.json"])
    assert runtime["eval_interval"] == 100
    assert runtime["eval_submit"][-4:] == ["eval", "submit-queued", str(prepared.paths.root), "--iteration"]


def test_validation_split_is_megatrons() -> None:
    from megalaunch.evaluation.heldout import split_bounds

    assert split_bounds("90,10,0", 300) == [0, 270, 300, 300]
    assert split_bounds("98,2,0", 1000) == [0, 980, 1000, 1000]
    assert split_bounds("969,30,1", 1001) == [0, 970, 1000, 1001]
    assert split_bounds("1,1,1", 10) == [0, 3, 7, 10]  # round(3.33), round(6.67)


def test_heldout_sequences_come_from_validation_documents_only(tmp_path: Path) -> None:
    from megalaunch.data.writer import write_dataset
    from megalaunch.evaluation.heldout import heldout_sequences

    prefix = tmp_path / "d"
    write_dataset(prefix, [[i] * 10 for i in range(10)])  # document i is ten tokens i
    seqs = heldout_sequences([str(prefix)], split="80,20,0", count=3, seq_length=5)
    assert {t for s in seqs for t in s} == {8, 9}  # the last 20 % of the documents
    with pytest.raises(PreflightError, match="validation split"):
        heldout_sequences([str(prefix)], split="80,20,0", count=4, seq_length=5)


@pytest.mark.parametrize(("line", "says"), [
    ("not json", "line 2 is not JSON"),
    ('{"context": "a", "choices": ["b"], "answer": 0}', "lacks context, choices"),
    ('{"context": "a", "choices": ["b", "c"], "answer": 2}', "line 2: answer 2 is not an index"),
    ('{"context": "a", "choices": ["b", "c"], "answer": true}', "answer True"),
])
def test_local_task_errors_name_the_line(line: str, says: str, tmp_path: Path) -> None:
    from megalaunch.evaluation.tasks import EvalTaskError, read_local_task

    path = tmp_path / "t.jsonl"
    path.write_text('{"context": "a", "choices": [" b", " c"], "answer": 1}\n' + line + "\n")
    with pytest.raises(EvalTaskError, match=says) as e:
        read_local_task("t", path)
    assert "\n" not in str(e.value) and "fix:" in str(e.value)
    path.write_text('{"context": "a", "choices": [" b", " c"], "answer": 1}\n')
    assert read_local_task("t", path)[0]["answer"] == 1


def test_eval_script_is_quoted_and_valid_bash(tmp_path: Path) -> None:
    from megalaunch.evaluation.submit import render_script

    root = tmp_path / "runs"
    recipe = load_recipe("tiny", ["cluster.backend=slurm", "cluster.gpus_per_node=4", "eval.gpus=1",
                                  "eval.time=00:20:00", "eval.partition=eval", "cluster.env={A: \"x y; $(z)\"}"]).recipe
    paths = RunPaths(root / "run-1")
    text = render_script(recipe, paths, 150, ["next_word", "hellaswag"])
    assert "#SBATCH --gpus-per-node=1" in text and "#SBATCH --time=00:20:00" in text
    assert "#SBATCH --partition=eval" in text and "#SBATCH --no-requeue" in text
    assert f"#SBATCH --output={paths.root}/evals/0000150/logs/%x-%j.out" in text
    assert f"eval job {paths.root} --iteration 150 --tasks next_word,hellaswag" in text
    assert "export A='x y; $(z)'" in text and "HF_HUB_OFFLINE=1" in text
    (tmp_path / "eval.sbatch").write_text(text)
    assert subprocess.run(["bash", "-n", str(tmp_path / "eval.sbatch")]).returncode == 0


def test_queue_is_idempotent_and_retention_keeps_pending_evals(tmp_path: Path) -> None:
    from megalaunch.runtime.checkpoint.retention import prune
    from megalaunch.runtime.observation.eval_queue import EvalQueue

    paths = RunPaths(tmp_path / "run")
    paths.state.mkdir(parents=True)
    logs: list[str] = []
    q = EvalQueue(paths, interval=50, submit=None, job_id="7", log=logs.append)
    for it in (25, 50, 50, 100):
        q.after_save(it)
    assert [r["iteration"] for r in eval_records(paths)] == [50, 100]
    EvalPaths(paths, 50).write_state("done")
    q.after_save(50)  # a resumed segment saving 50 again: done stays done
    assert EvalPaths(paths, 50).read_state()["state"] == "done"
    assert [e["iteration"] for e in read_jsonl(paths.ledger) if e["event"] == "eval_queued"] == [50, 100]
    assert pending_iterations(paths) == {100}
    # retention: keep_last 1 would delete 100; a pending eval keeps it
    for it in (100, 150, 200):
        d = paths.checkpoints / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "metadata.json").write_text("{}")
        (d / ".metadata").write_text("")
        (d / "common.pt").write_text("")
    paths.tracker.write_text("200")
    prune(paths, keep_last=1, eval_pending=pending_iterations(paths))
    remaining = sorted(p.name for p in paths.checkpoints.glob("iter_*"))
    assert "iter_0000100" in remaining


def test_submit_failure_leaves_the_eval_queued(tmp_path: Path) -> None:
    from megalaunch.runtime.observation.eval_queue import EvalQueue

    paths = RunPaths(tmp_path / "run")
    paths.state.mkdir(parents=True)
    logs: list[str] = []
    q = EvalQueue(paths, interval=10, submit=["/nonexistent/megalaunch", "eval"], job_id="7", log=logs.append)
    q.after_save(10)
    q.join(10)
    assert EvalPaths(paths, 10).read_state()["state"] == "queued"
    assert any("not submitted" in line and "megalaunch eval" in line for line in logs)


def test_records_and_status_lines(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    EvalPaths(paths, 50).write_state("done", job_id="11")
    (EvalPaths(paths, 50).results).write_text(json.dumps(
        {"iteration": 50, "tokens": 25600, "heldout": {"ppl": 3.25}, "tasks": {"t": {"acc": 0.5}}, "wall_s": 12.0}))
    EvalPaths(paths, 100).write_state("failed", job_id="12", reason="task t: bad line 3")
    lines = format_eval_records(eval_records(paths))
    assert lines == ["iteration 50: done (job 11)  held-out ppl 3.250  t acc 0.500  (12 s)",
                     "iteration 100: failed (job 12): task t: bad line 3"]


def test_live_records_fail_a_job_slurm_no_longer_runs(tmp_path: Path) -> None:
    from megalaunch.evaluation.submit import live_records
    from megalaunch.launcher.backends.slurm import JobInfo

    class Slurm:
        def job_state(self, job_id: str) -> JobInfo | None:
            return {"21": JobInfo("21", "eval", "RUNNING", ""), "22": JobInfo("22", "eval", "TIMEOUT", "")}.get(job_id)

    paths = RunPaths(tmp_path / "run")
    EvalPaths(paths, 50).write_state("running", job_id="21")
    EvalPaths(paths, 100).write_state("submitted", job_id="22")
    EvalPaths(paths, 150).write_state("submitted", job_id="23")
    states = {r["iteration"]: (r["state"], r["reason"] or "") for r in live_records(paths, slurm=Slurm())}
    assert states[50] == ("running", "")
    assert states[100][0] == "failed" and "TIMEOUT" in states[100][1]
    assert states[150][0] == "failed" and "gone from Slurm" in states[150][1]


def test_eval_cli_errors_are_one_line(tmp_path: Path) -> None:
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    paths = write_run(prepare_run(load_recipe("tiny", []), root=tmp_path / "runs"))
    for args, says in ((["eval", str(paths.root)], "no complete checkpoint yet"),
                       (["eval", str(paths.root), "--iteration", "50"], "iteration 50 has no complete checkpoint"),
                       (["eval", str(paths.root), "--tasks", " , "], "--tasks names no task"),
                       (["eval", str(tmp_path / "nope")], "")):
        p = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", *args], capture_output=True, text=True)
        assert p.returncode != 0 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "eval", "status", str(paths.root)],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "no evals yet" in p.stdout


def test_wandb_keys_and_the_chains_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    from megalaunch.evaluation.stage import eval_metrics
    from megalaunch.runtime.observation.wandb_run import WandbRun, log_eval

    metrics = eval_metrics({"iteration": 50, "tokens": 25600, "heldout": {"ppl": 3.5, "nll": 1.25},
                            "tasks": {"t": {"acc": 0.5, "n": 8, "runner": "megalaunch"}}})
    assert metrics == {"eval/iteration": 50, "eval/tokens": 25600, "eval/heldout_ppl": 3.5, "eval/heldout_nll": 1.25,
                       "eval/t/acc": 0.5, "eval/t/n": 8}
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    paths = RunPaths(tmp_path / "run")
    paths.state.mkdir(parents=True)
    train = WandbRun.open(paths, project="p", entity=None, mode="offline", name="exp", job_id="1")
    train.log(60, {"loss": 2.0})
    train.finish()
    assert log_eval(paths, metrics=metrics, project="p", entity=None, mode="online") == train.run_id
    runs = sorted((paths.root / "wandb").glob(f"offline-run-*-{train.run_id}*/run-{train.run_id}.wandb"))
    assert len(runs) == 2  # the chain's run, continued offline by the eval
    # wandb's own service process writes the offline file; under load it can land after finish() returns
    deadline = time.monotonic() + 60
    while b"eval/heldout_ppl" not in runs[-1].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"eval/heldout_ppl" in runs[-1].read_bytes() and b"eval/heldout_ppl" not in runs[0].read_bytes()
    state = json.loads(paths.wandb_state.read_text())
    assert state["last_step"] == 60  # the training steps are untouched


class _Index:
    """lm-eval's TaskManager at the boundary megalaunch uses: what it was built with, which tasks it knows."""

    BUILT_IN: ClassVar[set[str]] = {"hellaswag", "arc_easy"}
    made: ClassVar[list[dict[str, object]]] = []

    def __init__(self, include_path: list[str] | None = None, include_defaults: bool = True) -> None:
        type(self).made.append({"include_path": include_path, "include_defaults": include_defaults})
        local = {Path(p).name for p in include_path or []}
        self.all_tasks = sorted(local | (self.BUILT_IN if include_defaults else set()))


class _OldIndex(_Index):
    def __init__(self, include_path: list[str] | None = None) -> None:  # an lm-eval without include_defaults
        super().__init__(include_path)


@pytest.mark.parametrize(("tasks", "paths", "defaults"), [
    (["mine"], ["/t/mine"], [False]),                   # every task is local: the built-in index is never parsed
    (["mine", "hellaswag"], ["/t/mine"], [False, True]),  # one is built in: the whole index, local paths too
    (["hellaswag"], [], [True]),                         # no local paths: the whole index at once
])
def test_lm_eval_indexes_its_built_in_tasks_only_when_asked_for_one(tasks: list[str], paths: list[str],
                                                                     defaults: list[bool]) -> None:
    from megalaunch.evaluation.tasks import _task_manager

    _Index.made = []
    manager = _task_manager(_Index, tasks, paths)
    assert [m["include_defaults"] for m in _Index.made] == defaults
    assert all(t in manager.all_tasks for t in tasks)
    assert _Index.made[-1]["include_path"] == (paths or None)


def test_lm_eval_without_include_defaults_gets_the_whole_index() -> None:
    from megalaunch.evaluation.tasks import _task_manager

    _Index.made = []
    manager = _task_manager(_OldIndex, ["mine"], ["/t/mine"])
    assert [m["include_defaults"] for m in _Index.made] == [True] and "mine" in manager.all_tasks
