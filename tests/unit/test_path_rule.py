"""One rule for ~ and $VAR in path fields (config/paths.py): expanded once, when the recipe is
loaded where the user submits; recorded expanded in run.yaml; nothing else is expanded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from megalaunch.config.loader import load_recipe, load_run_recipe
from megalaunch.config.paths import expand_path, path_fields
from megalaunch.config.schema import Recipe
from megalaunch.errors import ConfigError
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run

EXPECTED_PATH_FIELDS = {
    "run.root", "checkpoint.load", "checkpoint.from_hf", "data.blend[].path", "data.blend_file", "data.chat_files", "data.tokenizer_model", "cluster.venv", "cluster.python", "cluster.node_health_dir",
    "cluster.megalaunch", "cluster.container.image", "cluster.container.mounts", "cluster.container.environment",
    "debug.code_snapshot", "eval.heldout_blend", "eval.task_paths", "eval.local_tasks[].path",
    "post_training.rollouts", "post_training.teacher",
}


def test_the_schema_marks_every_host_path_field() -> None:
    assert set(path_fields(Recipe)) == EXPECTED_PATH_FIELDS


@pytest.mark.parametrize(("written", "expected"), [
    ("~/x", "/home/me/x"), ("~", "/home/me"), ("$SCR/x", "/scratch/me/x"), ("${SCR}x", "/scratch/mex"),
    ("/a/$SCR/${SCR}", "/a//scratch/me//scratch/me"), ("a$", "a$"), ("$1/x", "$1/x"), ("50$-off", "50$-off"),
    ("/p/$DOLLAR", "/p/has$HOME"),  # once: a value holding a $ is not expanded again
    ("python3", "python3"), ("x~y", "x~y"),
])
def test_expansion(written: str, expected: str) -> None:
    env = {"HOME": "/home/me", "SCR": "/scratch/me", "DOLLAR": "has$HOME"}
    assert expand_path(written, "f", env) == expected


def test_unset_variable_and_unknown_user_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"\$NOPE is not set") as e:
        expand_path("$NOPE/x", "checkpoint.load", {})
    assert e.value.field == "checkpoint.load" and "export NOPE" in (e.value.fix or "")
    with pytest.raises(ConfigError, match="~nosuchuser0 names no user") as e:
        expand_path("~nosuchuser0/x", "run.root", {"HOME": "/h"})
    assert e.value.field == "run.root"


def test_every_path_field_is_expanded_when_loaded_and_recorded_expanded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLP_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "scratch" / "code").mkdir(parents=True)
    (tmp_path / "scratch" / "ckpt").mkdir()
    sets = ["run.root=$MLP_SCRATCH/runs", "checkpoint.load=${MLP_SCRATCH}/ckpt", "cluster.venv=~/venv",
            "cluster.python=~/venv/bin/python", "cluster.megalaunch=$MLP_SCRATCH/bin/megalaunch",
            "debug.code_snapshot=$MLP_SCRATCH/code", "cluster.env={A: $MLP_SCRATCH}", "megatron_args={x: ~/y}",
            "description=$MLP_SCRATCH"]
    loaded = load_recipe("tiny", sets)
    r, s = loaded.recipe, str(tmp_path / "scratch")
    assert (r.run.root, r.checkpoint.load) == (f"{s}/runs", f"{s}/ckpt")
    assert (r.cluster.venv, r.cluster.python) == (f"{tmp_path}/home/venv", f"{tmp_path}/home/venv/bin/python")
    assert r.cluster.megalaunch == f"{s}/bin/megalaunch" and r.debug.code_snapshot == f"{s}/code"
    # not path fields: the job gets what was written
    assert r.cluster.env == {"A": "$MLP_SCRATCH"} and r.megatron_args == {"x": "~/y"} and r.description == "$MLP_SCRATCH"
    paths = write_run(prepare_run(loaded))
    assert paths.root.parent == tmp_path / "scratch" / "runs"
    recorded = yaml.safe_load(paths.run_yaml.read_text())
    assert recorded["checkpoint"]["load"] == f"{s}/ckpt" and recorded["cluster"]["env"] == {"A": "$MLP_SCRATCH"}
    monkeypatch.setenv("MLP_SCRATCH", "/elsewhere")  # a teammate's shell, a compute node: nothing changes
    assert load_run_recipe(paths).checkpoint.load == f"{s}/ckpt"


def test_container_mounts_expand_the_host_side_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLP_DATA", "/lustre/data")
    loaded = load_recipe("tiny", ["cluster.container={kind: pyxis, image: $MLP_DATA/img.sqsh, "
                                  "mounts: ['$MLP_DATA:/data:ro', '~/cache:~/cache'], workdir: ~/work}"])
    co = loaded.recipe.cluster.container
    home = os.path.expanduser("~")
    assert co.image == "/lustre/data/img.sqsh"
    assert co.mounts == ("/lustre/data:/data:ro", f"{home}/cache:~/cache")
    assert co.workdir == "~/work"  # inside the container: as written


def test_tokenize_paths_follow_the_same_rule(tmp_path: Path, monkeypatch) -> None:
    from megalaunch.tokenization.recipe import load_tokenize_recipe

    monkeypatch.setenv("MLP_CORPUS", str(tmp_path / "corpus"))
    recipe = tmp_path / "tok.yaml"
    recipe.write_text("name: t\ninputs: {roots: [$MLP_CORPUS, rel]}\ntokenizer: {path: ~/tok.json}\n"
                      "output_dir: ${MLP_CORPUS}/out\n")
    r, _ = load_tokenize_recipe(str(recipe))
    assert r.inputs.roots == (str(tmp_path / "corpus"), str(tmp_path / "rel"))  # relative: to the recipe file
    assert r.tokenizer.path == os.path.expanduser("~/tok.json") and r.output_dir == f"{tmp_path}/corpus/out"
    with pytest.raises(ConfigError, match=r"inputs\.roots\[0\].*\$MLP_NOPE is not set"):
        recipe.write_text("name: t\ninputs: {roots: [$MLP_NOPE/x]}\ntokenizer: {path: /t.json}\n")
        load_tokenize_recipe(str(recipe))


def test_a_derived_sbatch_value_names_the_field_the_user_set() -> None:
    """The segment log path (RUN_ROOT/NAME-HASH/logs/%x-%j.out) is an #SBATCH line: a space in run.root
    is reported as run.root, not as the log path."""
    from megalaunch.errors import PreflightError

    with pytest.raises(PreflightError) as e:
        prepare_run(load_recipe("train/llama3-8b", ["run.root=/tmp/my runs"]))
    assert e.value.field == "run.root" and "%x" not in str(e.value)
    prepare_run(load_recipe("tiny", ["run.root=/tmp/my runs"]))  # the local backend has no #SBATCH lines


def test_conversion_and_tokenization_job_logs_name_their_directory(tmp_path: Path) -> None:
    from megalaunch.launcher.prepare.sbatch import JobHeader

    with pytest.raises(ConfigError) as e:
        JobHeader(name="x", log="/a b/logs/%x-%j.out", log_from="the output directory (OUT)", time="1:00:00",
                  cpus_per_task=1)
    assert e.value.field == "the output directory (OUT)" and "'/a b'" in str(e.value)
