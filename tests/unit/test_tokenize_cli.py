"""CLI wiring of `tokenize` and `data`, the job-array script, Slurm submission with a fake client,
status parsing, and one-line errors."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from megalaunch.cli.main import app, main
from megalaunch.config.loader import load_recipe
from megalaunch.config.typed import build
from megalaunch.data.writer import write_dataset
from megalaunch.errors import RunDirError
from megalaunch.launcher.backends.slurm import JobInfo
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.tokenization.recipe import TokenizeRecipe
from megalaunch.tokenization.status import _array_tasks, dump_statuses
from megalaunch.tokenization.submit import array_spec, create_run, render_job_script, submit

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.support.corpus import documents, train_bpe_tokenizer

    return train_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json",
                               list(documents(50, mean_words=20)), vocab_size=300)


@pytest.fixture
def corpus(tmp_path):
    from tests.support.corpus import write_jsonl_corpus

    write_jsonl_corpus(tmp_path / "raw", n_files=4, docs_per_file=5, mean_words=20)
    return tmp_path / "raw"


class FakeSlurm:
    def __init__(self):
        self.submitted = []
        self.queue: dict[str, JobInfo] = {}
        self.cancelled = []

    def sbatch(self, script, extra_args=(), *, cwd=None, env=None):
        self.submitted.append((Path(script), list(extra_args)))
        return str(100 + len(self.submitted))

    def squeue(self, job_ids=(), *, me=False):
        return dict(self.queue)

    def job_state(self, job_id):
        return JobInfo(job_id, "tok-x", "CANCELLED", "")

    def scancel(self, job_ids, **kw):
        self.cancelled += list(job_ids)


def _recipe(corpus, tok, **over):
    return build(TokenizeRecipe, {"name": "x", "inputs": {"roots": [str(corpus)]}, "tokenizer": {"path": str(tok)},
                                  "n_dumps": 3, "tasks": 2, "workers": 2,
                                  "slurm": {"partition": "cpu", "max_concurrent": 2, "setup": ["module load foo"],
                                            "options": {"constraint": "amd"}}, **over})


def test_array_spec():
    assert array_spec([0, 1, 2, 5, 7, 8], 4) == "0-2,5,7-8%4"
    assert array_spec([3]) == "3"


def test_job_script_is_cpu_only_valid_bash(corpus, tok, tmp_path):
    recipe = _recipe(corpus, tok)
    run, _ = create_run(recipe, tmp_path / "run")
    script = render_job_script(run, recipe)
    for line in ("#SBATCH --job-name=tok-x", "#SBATCH --cpus-per-task=2", "#SBATCH --partition=cpu",
                 "#SBATCH --constraint=amd", "#SBATCH --no-requeue", "module load foo",
                 "-m megalaunch.tokenization.job"):
        assert line in script
    assert f"#SBATCH --output={run.logs}/%x-%A_%a.out" in script
    assert "gpu" not in script.replace("tokenization", "")
    path = tmp_path / "s.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-S", "warning", str(path)], check=True)


def test_slurm_submit_throttles_resumes_and_refuses_a_second_writer(corpus, tok, tmp_path):
    run, _ = create_run(_recipe(corpus, tok), tmp_path / "run")
    slurm = FakeSlurm()
    first = submit(run, slurm=slurm)
    assert first.job_id == "101" and slurm.submitted[0][1] == ["--array=0-2%2"]
    slurm.queue = {"101_0": JobInfo("101_0", "tok-x", "RUNNING", ""),
                   "101_[1-2%2]": JobInfo("101_[1-2%2]", "tok-x", "PENDING", "JobArrayTaskLimit")}
    assert [s.state for s in dump_statuses(run, slurm)] == ["running", "pending", "pending"]
    with pytest.raises(RunDirError, match="still queued or running"):
        submit(run, slurm=slurm)
    slurm.queue = {}
    run.write_json(run.summary(1), {"documents": 5, "tokens": 50})
    states = dump_statuses(run, slurm)
    assert [s.state for s in states] == ["cancelled", "done", "cancelled"]
    again = submit(run, slurm=slurm)
    assert again.dumps == (0, 2) and slurm.submitted[-1][1] == ["--array=0,2%2"]


def test_shipped_recipe_names_the_array_after_its_input(tok, tmp_path):
    """tokenize/jsonl sets no `name`: two runs over different sources get different arrays (issue 15)."""
    from tests.support.corpus import write_jsonl_corpus

    from megalaunch.tokenization.recipe import load_run_recipe, load_tokenize_recipe

    names = {}
    for source in ("web", "code"):
        write_jsonl_corpus(tmp_path / "raw" / source, n_files=1, docs_per_file=2, mean_words=5)
        recipe, _ = load_tokenize_recipe("tokenize/jsonl", [f"inputs.roots=[{tmp_path / 'raw' / source}]",
                                                             f"tokenizer.path={tok}", "n_dumps=1", "tasks=1"])
        run, _ = create_run(recipe, tmp_path / f"run-{source}")
        names[source] = render_job_script(run, load_run_recipe(run)).split("#SBATCH --job-name=")[1].split("\n")[0]
    assert names == {"web": "tok-web", "code": "tok-code"}
    both, _ = load_tokenize_recipe("tokenize/jsonl", [f"inputs.roots=[{tmp_path / 'raw' / 'web'},{tmp_path / 'raw' / 'code'}]",
                                                      f"tokenizer.path={tok}"])
    assert both.name == "web+code"
    named, _ = load_tokenize_recipe("tokenize/jsonl", [f"inputs.roots=[{tmp_path / 'raw' / 'web'}]",
                                                       f"tokenizer.path={tok}", "name=fineweb"])
    assert named.name == "fineweb"


@pytest.mark.parametrize(("roots", "name"), [
    (["/data/raw/web/"], "web"), (["/a/shard-01.jsonl.gz"], "shard-01"), (["/a/x", "/b/x"], "x"),
    (["/a/w", "/a/c", "/a/m", "/a/b"], "w+c+2-more"), (["/data/my web $(x)"], "my-web-x"), (["/"], "tokenize"),
])
def test_name_from_inputs_is_sbatch_safe(roots, name):
    from megalaunch.config.values import SBATCH_SAFE
    from megalaunch.tokenization.recipe import name_from_inputs

    assert name_from_inputs(roots) == name
    assert SBATCH_SAFE.match(f"tok-{name}")


class _Clock:
    """time.time() and time.monotonic() that move only when told (the progress writer and status read it)."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def test_status_rate_is_the_recent_window_then_stalled_then_the_runs_average(corpus, tok, tmp_path, monkeypatch,
                                                                            capsys):
    pytest.importorskip("datatrove")
    from megalaunch.cli.tokenize import _print_status
    from megalaunch.tokenization import pipeline, status
    from megalaunch.tokenization.status import STALE_S, totals

    clock = _Clock()
    monkeypatch.setattr(pipeline, "time", clock)
    monkeypatch.setattr(status, "time", clock)
    run, _ = create_run(_recipe(corpus, tok, n_dumps=1), tmp_path / "run")
    slurm = FakeSlurm()
    job = submit(run, slurm=slurm).job_id
    slurm.queue = {f"{job}_0": JobInfo(f"{job}_0", "tok-x", "RUNNING", "")}
    progress = [pipeline._Progress(str(run.dump_dir(0) / "progress"), t) for t in range(2)]  # the tasks' writer
    for _ in range(120):  # 10 minutes at 1,000 tok/s per task ...
        clock.now += pipeline.PROGRESS_INTERVAL_S
        for p in progress:
            p.update(10, int(1000 * pipeline.PROGRESS_INTERVAL_S))
    for _ in range(12):  # ... then a minute at 100 tok/s per task
        clock.now += pipeline.PROGRESS_INTERVAL_S
        for p in progress:
            p.update(1, int(100 * pipeline.PROGRESS_INTERVAL_S))
    (dump,) = dump_statuses(run, slurm)
    assert dump.state == "running" and dump.tokens_per_s == pytest.approx(200.0)  # not ~1,800 since the start
    assert totals([dump])["tokens_per_s"] == pytest.approx(200.0)
    clock.now += STALE_S + 1  # no progress since
    (dump,) = dump_statuses(run, slurm)
    assert dump.tokens_per_s is None and "no progress for" in dump.detail
    _print_status([dump], totals([dump]))
    assert "stalled" in capsys.readouterr().out.splitlines()[-1]
    for p in progress:  # both tasks finish; the dump's summary is written a minute later
        p.finish()
    slurm.queue = {}
    clock.now += 60
    run.write_json(run.summary(0), {"documents": dump.documents, "tokens": dump.tokens, "finished": clock.now})
    (dump,) = dump_statuses(run, slurm)
    span = clock.now - progress[0].started
    assert dump.state == "done" and dump.tokens_per_s == pytest.approx(dump.tokens / span)
    total = totals([dump])
    assert total["rate_over"] == "run" and total["tokens_per_s"] == pytest.approx(dump.tokens / span)
    _print_status([dump], total)
    assert f"{dump.tokens / span:,.0f} tok/s on average" in capsys.readouterr().out


def test_array_task_parsing():
    class Q:
        def squeue(self, ids):
            return {"7_3": JobInfo("7_3", "n", "RUNNING", ""), "7_[4-5,9%2]": JobInfo("7_[4-5,9%2]", "n", "PENDING", "")}

    assert _array_tasks("7", Q()) == {3: "RUNNING", 4: "PENDING", 5: "PENDING", 9: "PENDING"}


def test_cli_plan_submit_status_check_blend(corpus, tok, tmp_path, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"inputs: {{roots: [{corpus}]}}\ntokenizer: {{path: {tok}}}\nbackend: local\n")
    runner = CliRunner()
    run_dir = tmp_path / "run"
    res = runner.invoke(app, ["tokenize", "plan", str(recipe), "--run-dir", str(run_dir), "--set", "n_dumps=2"])
    assert res.exit_code == 0, res.output
    assert "into 2 dumps" in res.output and "megalaunch tokenize submit" in res.output
    assert "(job array tok-raw)" in res.output  # no `name` in the recipe: the input folder's
    res = runner.invoke(app, ["tokenize", "submit", str(run_dir)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["tokenize", "status", str(run_dir)])
    assert res.exit_code == 0 and "2/2 dumps" in res.output and "20 documents" in res.output, res.output
    # finished: the average over the run, not a rate of nothing running
    assert " 0 tok/s" not in res.output and "tok/s on average" in res.output, res.output
    check = _next(res.output, "data check")  # from here on, each stage runs the command the one before printed
    assert check == ["data", "check", str(run_dir / "output"), "--tokenizer", str(tok)]
    res = runner.invoke(app, check)
    assert res.exit_code == 0 and "2/2 pairs ok" in res.output and f"(vocabulary {300})" in res.output, res.output
    monkeypatch.chdir(tmp_path)  # the printed `data blend` writes ./blend.txt
    res = runner.invoke(app, _next(res.output, "data blend"))
    assert res.exit_code == 0 and "sha256" in res.output, res.output
    assert len((tmp_path / "blend.txt").read_text().split()) == 4
    submit = _next(res.output, "submit")
    assert submit[:2] == ["submit", "RECIPE"] and submit[2] == "--set"
    loaded = load_recipe("tiny", [submit[3], "data.mock=false", "run.root=" + str(tmp_path / "runs")])
    blend_sha = res.output.split("sha256 ")[1].split()[0].rstrip(",")
    assert prepare_run(loaded).blend_sha256 == blend_sha  # the run would train on this very blend


def _next(output: str, command: str) -> list[str]:
    """The arguments of the `next: megalaunch COMMAND ...` line a stage printed."""
    import shlex

    line = next(x for x in output.splitlines() if x.startswith(f"next: megalaunch {command}"))
    return shlex.split(line.removeprefix("next: megalaunch "))


def test_one_line_errors(corpus, tok, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: c\ninputs: {{roots: [{corpus}]}}\ntokenizer: {{path: meta-llama/Llama-3-8B}}\n")
    with pytest.raises(SystemExit) as exc:
        main(["tokenize", "plan", str(recipe), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "tokenizer.path" in err and "hubs are unreachable" in err
    recipe.write_text(f"name: c\ninputs: {{roots: [{corpus}]}}\ntokenizer: {{path: {tok}, bos: '<s>'}}\n")
    with pytest.raises(SystemExit):
        main(["tokenize", "plan", str(recipe), "--run-dir", str(tmp_path / "run")])
    assert "'<s>' is not in the vocabulary" in capsys.readouterr().err
    (tmp_path / "d").mkdir()
    write_dataset(tmp_path / "d" / "p", [[1, 2, 3]])
    (tmp_path / "d" / "p.bin").write_bytes(b"\x00")
    with pytest.raises(SystemExit) as exc:
        main(["data", "check", str(tmp_path / "d")])
    out = capsys.readouterr()
    assert exc.value.code == 2 and "BAD" in out.out and "truncated" in out.err


def test_output_dir_not_writable(corpus, tok, tmp_path):
    from megalaunch.errors import PreflightError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PreflightError, match="cannot create output directory"):
        create_run(_recipe(corpus, tok, output_dir=str(blocker / "out")), tmp_path / "run")


def test_blend_next_command_keeps_paths_and_weights(tmp_path, monkeypatch):
    """The `--set data.blend=...` that `data blend` prints reads back as the same entries, odd paths included."""
    from megalaunch.cli.data import blend_setting

    monkeypatch.chdir(tmp_path)
    odd = ["/data/my web: 1, {x}", "rel/code", "/data/ünï'$(x)"]
    loaded = load_recipe("tiny", [blend_setting(odd, [0.7, 0.25, 1e-05])])
    assert [(e.path, e.weight) for e in loaded.recipe.data.blend] == [
        (odd[0], 0.7), (str(tmp_path / "rel/code"), 0.25), (odd[2], 1e-05)]
    assert [e.weight for e in load_recipe("tiny", [blend_setting(odd[:1], None)]).recipe.data.blend] == [None]
