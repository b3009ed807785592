"""`megalaunch resume RUN [--set KEY=VALUE ...]` (issue 15, items 3 and 4): checks like submit before it
queues (finished run, blend changed without --set, a checkpoint the chain needs gone: one line, no job),
and changes a run's settings as a recorded command (old and new value, old and new blend hash, who).

The chain is the real one on the local backend with the counter stand-in trainer; "no job" means no
new `submitted` event in the ledger (the local backend records each segment it starts there)."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from tests.unit.helpers import cli, counter_recipe

from megalaunch.data.blend import resolve_blend
from megalaunch.data.writer import write_dataset
from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint import resume as runtime_resume

ITERS = 12


def _events(run: Path, name: str) -> list[dict]:
    return [e for e in read_jsonl(run / "state" / "ledger.jsonl") if e["event"] == name]


def _frozen(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}


@pytest.fixture
def data(tmp_path: Path) -> dict[str, Path]:
    for name, docs in (("web", [[1, 2, 3], [4] * 9]), ("code", [[7, 8], [9] * 5])):
        (tmp_path / "data" / name).mkdir(parents=True)
        write_dataset(tmp_path / "data" / name / "part_00", docs)
    v1, v2 = tmp_path / "v1.txt", tmp_path / "v2.txt"
    resolve_blend([(str(tmp_path / "data" / "web"), None)]).write(v1)
    resolve_blend([(str(tmp_path / "data" / "web"), 0.5), (str(tmp_path / "data" / "code"), 0.5)]).write(v2)
    return {"v1": v1, "v2": v2}


@pytest.fixture
def finished(tmp_path: Path, data: dict[str, Path]) -> Path:
    """A run of the counter trainer on blend v1 that reached its target (one segment)."""
    recipe = counter_recipe(tmp_path, training=f"{{train_iters: {ITERS}, lr_warmup_iters: 1, log_interval: 1}}",
                            data=f"{{mock: false, blend_file: {data['v1']}, tokenizer_type: NullTokenizer, "
                                 "vocab_size: 512}", checkpoint="{save_time_estimate_s: 1, save_interval: 4}")
    proc = cli("submit", str(recipe), env={"COUNTER_STEP_S": "0.02"})
    assert proc.returncode == 0, proc.stderr
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert RunPaths(run).read_tracker() == ITERS
    return run


def _refused(run: Path, *args: str, needles: tuple[str, ...]) -> None:
    before_submitted, before_files = len(_events(run, "submitted")), _frozen(run)
    proc = cli("resume", str(run), *args, env={"COUNTER_STEP_S": "0.02"})
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert len(_events(run, "submitted")) == before_submitted  # no job
    assert _events(run, "settings_changed") == []
    after = _frozen(run)
    assert {k: after[k] for k in before_files if k != "data_blend.txt"} == \
        {k: v for k, v in before_files.items() if k != "data_blend.txt"}


def test_a_finished_run_is_refused_without_a_job(finished: Path) -> None:
    _refused(finished, needles=("already reached its target", f"iteration {ITERS}",
                                f"megalaunch resume {finished} --set training.train_iters=N"))


def test_set_validates_like_submit_and_writes_nothing_when_refused(finished: Path, tmp_path: Path) -> None:
    _refused(finished, "--set", "training.lr=-1", needles=("training.lr must be > 0",))
    _refused(finished, "--set", "training.nmae=3", needles=("--set training.nmae", "unknown key"))
    _refused(finished, "--set", "name=other", needles=("--set name", "cannot change on resume"))
    _refused(finished, "--set", "run.root=/elsewhere", needles=("--set run.root", "cannot change on resume"))
    _refused(finished, "--set", f"data.blend_file={tmp_path / 'nope.txt'}", needles=("data.blend_file",
                                                                                       "does not exist"))
    _refused(finished, "--set", "data.blend=[{path: /nope}]", needles=("data.blend and data.blend_file",))


def test_set_records_the_change_and_the_chain_resumes_with_it(finished: Path, data: dict[str, Path]) -> None:
    paths = RunPaths(finished)
    runtime_resume.check_blend(paths, allow_change=False, write=True, job_id="seg")  # as the trainer does
    old_manifest = json.loads(paths.manifest.read_text())
    modes = {n: os.stat(finished / n).st_mode for n in ("data_blend.txt", "run.yaml", "manifest.json")}
    proc = cli("resume", str(finished), "--set", f"data.blend_file={data['v2']}",
               "--set", f"training.train_iters={2 * ITERS}", env={"COUNTER_STEP_S": "0.02"})
    assert proc.returncode == 0, proc.stderr
    (event,) = _events(finished, "settings_changed")
    v1_sha = old_manifest["data_blend_sha256"]
    v2_sha = hashlib.sha256(data["v2"].read_bytes()).hexdigest()
    assert v1_sha != v2_sha
    assert event["blend_sha256"] == {"old": v1_sha, "new": v2_sha}
    assert event["changes"] == [{"key": "data.blend_file", "old": str(data["v1"]), "new": str(data["v2"])},
                                {"key": "training.train_iters", "old": ITERS, "new": 2 * ITERS}]
    assert event["user"] == getpass.getuser() and event["recipe_sha256"]["old"] == old_manifest["recipe_sha256"]
    manifest = json.loads(paths.manifest.read_text())
    assert manifest["data_blend_sha256"] == v2_sha and manifest["recipe_sha256"] == event["recipe_sha256"]["new"]
    assert manifest["changes"][0]["blend_sha256"] == event["blend_sha256"]
    assert paths.data_blend.read_bytes() == data["v2"].read_bytes()
    assert {n: os.stat(finished / n).st_mode for n in modes} == modes  # 0640 stays 0640
    run_yaml = paths.run_yaml.read_text()
    assert f"blend_file: {data['v2']}  # megalaunch resume --set" in run_yaml
    assert "counter.yaml" in run_yaml  # the other values keep where they came from
    assert json.loads(paths.runtime_json.read_text())["train_iters"] == 2 * ITERS
    # the chain went on with the new settings, and the trainer's blend check accepts the recorded change
    assert paths.read_tracker() == 2 * ITERS
    assert _events(finished, "chain_stopped")[-1]["reason"].startswith("training reached its target")
    runtime_resume.check_blend(paths, allow_change=False, write=False, job_id="check")
    assert f"data blend sha256: {v1_sha[:12]} -> {v2_sha[:12]}" in proc.stdout


def test_a_blend_changed_by_hand_is_refused_before_a_job(finished: Path, data: dict[str, Path]) -> None:
    paths = RunPaths(finished)
    runtime_resume.check_blend(paths, allow_change=False, write=True, job_id="seg")  # as the trainer does
    shutil.copyfile(data["v2"], paths.data_blend)  # what `data blend --output RUN/...` used to do
    _refused(finished, "--set", f"training.train_iters={2 * ITERS}",
             needles=("data_blend.txt was changed outside megalaunch", "--set data.blend_file=FILE"))
    _refused(finished, needles=("data_blend.txt was changed outside megalaunch",))
    with pytest.raises(runtime_resume.BlendChanged, match=r"megalaunch resume .* --set data\.blend_file"):
        runtime_resume.check_blend(paths, allow_change=False, write=False, job_id="check")


def test_a_missing_checkpoint_the_chain_needs_is_refused_before_a_job(finished: Path) -> None:
    for d in (finished / "checkpoints").glob("iter_*"):
        shutil.rmtree(d)
    _refused(finished, "--set", f"training.train_iters={2 * ITERS}",
             needles=(f"checkpoint of iteration {ITERS}", "holds no iter_* directory"))


def test_a_missing_checkpoint_load_is_refused_before_the_first_checkpoint(tmp_path: Path) -> None:
    from megalaunch.config.loader import load_recipe
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    source = tmp_path / "pretrained"
    source.mkdir()
    loaded = load_recipe(str(counter_recipe(tmp_path)), [f"checkpoint.load={source}"])
    run = write_run(prepare_run(loaded)).root
    source.rmdir()
    _refused(run, needles=("checkpoint.load", f"{source} is not a directory"))
