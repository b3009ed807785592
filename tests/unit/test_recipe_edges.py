"""Malformed recipes and failed submissions, through the CLI as a user runs it: one line naming the file
or field, exit status non-zero, nothing written, nothing submitted. Standard library only, so it also
runs in the core-only install (scripts/test runs it there too: login nodes have no torch)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from tests.unit.helpers import cli

BASE = "include: [tiny]\nname: edge\nrun: {{root: {root}}}\ncluster: {{backend: slurm, gpus_per_node: 0}}\n"


@pytest.fixture()
def fake_slurm(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """sinfo answers; sbatch records that it was called and fails as a real refusal does."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "sbatch-called"
    for name, body in (("sinfo", "echo slurm 22.05.8"),
                       ("sbatch", f"touch {marker}\necho 'sbatch: error: Batch job submission failed: "
                                  "Invalid account or account/partition combination specified' >&2\nexit 1")):
        f = bindir / name
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}, marker


def _one_line(proc, *must: str) -> str:
    assert proc.returncode != 0, proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megalaunch: error:"), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for text in must:
        assert text in lines[0], lines[0]
    return lines[0]


def test_a_repeated_key_is_refused_with_both_lines(tmp_path: Path, fake_slurm) -> None:
    env, marker = fake_slurm
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(BASE.format(root=tmp_path / "runs") + "training:\n  lr: 1e-3\n  train_iters: 50\n  lr: 2e-3\n")
    _one_line(cli("submit", str(recipe), env=env), str(recipe), "'lr' appears twice", "lines 6 and 8")
    assert not (tmp_path / "runs").exists() and not marker.exists()


@pytest.mark.parametrize(("content", "must"), [
    (b"", "is empty"),
    (b"   \n\n", "is empty"),
    (b"name: x\n\xff\xfe training: 1\n", "not UTF-8"),
    (b"\x00\x01\x02binary", "NUL"),
])
def test_unreadable_recipe_files_name_the_file(tmp_path: Path, content: bytes, must: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    _one_line(cli("submit", str(recipe), "--dry-run"), str(recipe), must)


def test_a_directory_is_not_a_recipe(tmp_path: Path) -> None:
    (tmp_path / "recipes").mkdir()
    _one_line(cli("submit", str(tmp_path / "recipes"), "--dry-run"), "is a directory")


@pytest.mark.parametrize(("field", "section"), [
    ("data.split", "data:\n  split: |\n    90,10,0\n    --eval-iters\n"),
    ("checkpoint.load", "checkpoint:\n  load: \"/ckpt\\n--no-load-optim\"\n"),
    ("megatron_args.exit_duration_in_mins", "megatron_args:\n  exit_duration_in_mins: |\n    5\n    --foo\n"),
    ("data.tokenizer_model", "data:\n  tokenizer_model: \"/tok\\u0000\"\n"),
])
def test_a_value_with_a_line_break_never_reaches_megatron_args(tmp_path: Path, fake_slurm, field: str,
                                                                 section: str) -> None:
    """YAML keeps line breaks in block scalars and escapes (a `--set` value's are folded to spaces)."""
    env, marker = fake_slurm
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE.format(root=tmp_path / "runs") + section)
    _one_line(cli("submit", str(recipe), env=env), field, "line break or NUL")
    assert not (tmp_path / "runs").exists() and not marker.exists()


@pytest.mark.parametrize(("sets", "field"), [
    (["training.lr_warmup_iters=300", "training.train_iters=200"], "training.lr_warmup_iters"),
    (["training.lr_decay_iters=500", "training.train_iters=200"], "training.lr_decay_iters"),
    (["training.min_lr=0.01", "training.lr=0.001"], "training.min_lr"),
])
def test_learning_rate_schedule_is_checked_before_submit(tmp_path: Path, fake_slurm, sets: list[str],
                                                         field: str) -> None:
    env, marker = fake_slurm
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE.format(root=tmp_path / "runs"))
    args = [a for s in sets for a in ("--set", s)]
    _one_line(cli("submit", str(recipe), *args, env=env), field)
    assert not marker.exists()


def test_a_refused_sbatch_leaves_no_run_directory(tmp_path: Path, fake_slurm) -> None:
    env, marker = fake_slurm
    root = tmp_path / "runs"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE.format(root=root))
    _one_line(cli("submit", str(recipe), env={**env, "XDG_STATE_HOME": str(tmp_path / "state")}),
              "Invalid account")
    assert marker.exists()  # sbatch was asked, and refused
    assert not root.exists() or not [p for p in root.iterdir() if not p.name.startswith(".")], list(root.iterdir())
    listing = cli("status", env={"XDG_STATE_HOME": str(tmp_path / "state")})
    assert "no runs yet" in listing.stdout  # nothing registered either


@pytest.mark.parametrize("argv", [["submit"], ["submit", "tiny", "--nodes", "4"], ["trigger", "halt", "RUN"]])
def test_usage_errors_are_at_most_three_lines(argv: list[str]) -> None:
    proc = cli(*argv)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 3 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("megalaunch: error:"), lines


@pytest.mark.parametrize(("name", "value", "refused"), [
    ("GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567", False),  # a revision, by its name
    ("MODEL_SHA", "0123456789abcdef0123456789abcdef01234567", False),
    ("MY_SETTING", "0123456789abcdef0123456789abcdef01234567", True),  # 40 hex: a W&B key, whatever its name
    ("WANDB_KEY_COPY", "local-0123456789abcdef0123456789abcdef01234567", True),
    ("HF_HOME", "/scratch/hf", False),
])
def test_secrets_are_judged_by_name_and_value_together(tmp_path: Path, name: str, value: str, refused: bool) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"include: [tiny]\nname: s\nrun: {{root: {tmp_path / 'runs'}}}\n"
                      f"cluster: {{env: {{{name}: '{value}'}}}}\n")
    proc = cli("submit", str(recipe), "--dry-run")
    if refused:
        _one_line(proc, f"cluster.env.{name}", "secret")
    else:
        assert proc.returncode == 0, proc.stderr


def test_a_section_of_the_wrong_shape_is_refused_though_a_profile_replaces_it(tmp_path: Path) -> None:
    recipe = tmp_path / "shape.yaml"
    recipe.write_text("include: [tiny]\nname: shape\ncluster: [1, 2]\n")
    _one_line(cli("submit", str(recipe), "--cluster", "local", "--dry-run"), "cluster:", str(recipe),
              "where a mapping belongs")
    recipe.write_text("include: [tiny]\nname: shape\ndata: {blend: {path: /x}}\n")
    _one_line(cli("submit", str(recipe), "--dry-run"), "data.blend:", "not a list of mappings")


@pytest.mark.parametrize(("sets", "must", "must_not"), [
    (["training.micro_batch_size=0"], "error: training.micro_batch_size must be >= 1", "training: "),
    (["cluster.nodes=0"], "error: cluster.nodes must be >= 1", "cluster: "),
    (["name=a%b"], "error: name 'a%b' must be", "<recipe>"),
    (["training.nodes=2"], "'nodes' is a field of cluster", "megatron_args"),
    (["logging.wandb_api_key=x"], "did you mean", "megatron_args"),
    (["training.recompute_granularity=full"], "did you mean 'recompute'", "megatron_args"),
    (["run.root=/tmp/my runs"], "run.root: '/tmp/my runs'", "%x"),
])
def test_one_prefix_and_a_pointed_message(sets: list[str], must: str, must_not: str) -> None:
    line = _one_line(cli("submit", "train/llama3-8b", *[a for s in sets for a in ("--set", s)], "--dry-run"), must)
    assert must_not not in line and line.count("megalaunch: error:") == 1
    assert line.count("(did you mean") <= 1 and len(line) < 400
    if "did you mean" in line:  # at most the three closest names
        assert line.split("(did you mean", 1)[1].split(")")[0].count("'") <= 6


def test_an_unknown_recipe_name_offers_every_close_name() -> None:
    line = _one_line(cli("submit", "train/llama3-9b", "--dry-run"), "not found")
    assert "'train/llama3-8b'" in line and "'train/llama3-1b'" in line


@pytest.mark.parametrize(("sets", "field"), [
    (["model.seq_length=4095", "model.max_position_embeddings=8192"], "model.seq_length"),
    # TP pinned: `parallel: auto` would pick a TP that divides the width (TP 1)
    (["model.ffn_hidden_size=14335", "parallel.tensor_model_parallel_size=2"], "model.ffn_hidden_size"),
])
def test_checks_megatron_makes_only_at_model_build_or_forward_are_made_before_submit(sets: list[str], field: str) -> None:
    _one_line(cli("submit", "train/llama3-8b", *[a for s in sets for a in ("--set", s)], "--dry-run"), f"error: {field}:")
