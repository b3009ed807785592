"""Tokenization recipe and plan: input discovery, filters, size-balanced dumps, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megalaunch.config.typed import build
from megalaunch.errors import ConfigError, PreflightError
from megalaunch.tokenization.plan import InputFile, balance, find_inputs, make_plan
from megalaunch.tokenization.recipe import InputsConfig, TokenizeRecipe, load_tokenize_recipe

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "src/megalaunch/recipes/tokenize").glob("*.yaml"))


def _tree(root: Path, files: dict[str, int]) -> None:
    for rel, size in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)


def test_find_inputs_filters_and_sorts(tmp_path):
    _tree(tmp_path, {"a/1.jsonl": 10, "a/2.jsonl.gz": 10, "b/x.parquet": 10, "b/skip.csv": 5,
                     "notes.txt": 3, ".hidden/3.jsonl": 1, "b/deep/4.jsonl": 2})
    names = [os.path.relpath(f.path, tmp_path) for f in find_inputs(InputsConfig(roots=[str(tmp_path)]))]
    assert names == ["a/1.jsonl", "a/2.jsonl.gz", "b/deep/4.jsonl", "b/skip.csv", "b/x.parquet"]
    cfg = InputsConfig(roots=[str(tmp_path)], filter_in=["*.jsonl*", "b/*"], filter_out=["b/deep/*", "*.csv"])
    names = [os.path.relpath(f.path, tmp_path) for f in find_inputs(cfg)]
    assert names == ["a/1.jsonl", "a/2.jsonl.gz", "b/x.parquet"]


def test_balance_is_even_by_bytes_and_deterministic():
    files = [InputFile(f"/d/{i:02d}", size) for i, size in enumerate([90, 10, 50, 50, 40, 30, 20, 10])]
    groups = balance(files, 3)
    totals = sorted(sum(f.size for f in g) for g in groups)
    assert totals == [100, 100, 100]
    assert balance(list(reversed(files)), 3) == groups
    assert all(g == sorted(g, key=lambda f: f.path) for g in groups)
    assert len(balance(files[:2], 5)) == 2  # never an empty dump


def test_plan_splits_dumps_then_tasks(tmp_path):
    _tree(tmp_path, {f"{i}.jsonl": 100 + i for i in range(10)})
    plan = make_plan(InputsConfig(roots=[str(tmp_path)]), n_dumps=3, tasks=2)
    assert len(plan.dumps) == 3 and plan.n_files == 10
    assert all(len(d.tasks) == 2 for d in plan.dumps)
    seen = [f.path for d in plan.dumps for t in d.tasks for f in t]
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 10
    assert max(d.bytes for d in plan.dumps) - min(d.bytes for d in plan.dumps) <= 110
    assert plan.dumps[1].output_name(1) == "dump0001_task00001"
    from megalaunch.tokenization.plan import Plan

    assert Plan.from_json(plan.to_json()) == plan


def test_input_errors(tmp_path):
    with pytest.raises(PreflightError, match="does not exist"):
        find_inputs(InputsConfig(roots=[str(tmp_path / "nope")]))
    _tree(tmp_path, {"a.txt": 1})
    with pytest.raises(PreflightError, match="no input files"):
        find_inputs(InputsConfig(roots=[str(tmp_path)]))
    with pytest.raises(PreflightError, match="no reader takes it"):
        find_inputs(InputsConfig(roots=[str(tmp_path)], filter_in=["*.txt"]))
    if os.geteuid() != 0:  # root reads everything
        _tree(tmp_path, {"locked.jsonl": 1})
        os.chmod(tmp_path / "locked.jsonl", 0)
        with pytest.raises(PreflightError, match="not readable"):
            find_inputs(InputsConfig(roots=[str(tmp_path)]))


def test_recipe_is_strict():
    base = {"name": "x", "inputs": {"roots": ["/r"]}, "tokenizer": {"path": "/t.json"}}
    recipe = build(TokenizeRecipe, base)
    assert recipe.concurrent_workers == 1 and recipe.tokenizer.eos == "<|endoftext|>"
    with pytest.raises(ConfigError, match="did you mean 'n_dumps'"):
        build(TokenizeRecipe, {**base, "n_dump": 4})
    with pytest.raises(ConfigError, match="n_dumps must be >= 1"):
        build(TokenizeRecipe, {**base, "n_dumps": 0})
    with pytest.raises(ConfigError, match=r"slurm\.max_concurrent"):
        build(TokenizeRecipe, {**base, "slurm": {"max_concurrent": 0}})
    assert build(TokenizeRecipe, {**base, "tasks": 8, "workers": 3}).concurrent_workers == 3


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipes_load(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe, _ = load_tokenize_recipe(f"tokenize/{path.stem}")
    assert recipe.inputs.roots[0].startswith(str(tmp_path))  # shipped: relative to the cwd


def test_recipe_paths_are_relative_to_the_file_and_set_to_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "r.yaml").write_text(
        "name: r\ninputs: {roots: [raw]}\ntokenizer: {path: tok.json}\n")
    monkeypatch.chdir(tmp_path)
    recipe, _ = load_tokenize_recipe("conf/r.yaml", ["tokenizer.path=other.json", "n_dumps=3"])
    assert recipe.inputs.roots == (str(tmp_path / "conf" / "raw"),)
    assert recipe.tokenizer.path == str(tmp_path / "other.json")
    assert recipe.n_dumps == 3
    with pytest.raises(ConfigError, match="unknown key"):
        load_tokenize_recipe("conf/r.yaml", ["tokenizer.paht=x"])


def test_tokenize_recipes_load_through_the_training_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Includes (with paths relative to each file), did-you-mean for unknown keys, `--set` checked."""
    (tmp_path / "data").mkdir()
    base = tmp_path / "base.yaml"
    base.write_text("name: base\ninputs: {roots: [data]}\ntokenizer: {path: tok.json}\nn_dumps: 2\n")
    child = tmp_path / "sub" / "child.yaml"
    child.parent.mkdir()
    child.write_text("include: [../base.yaml]\nname: child\ntasks: 3\n")
    monkeypatch.chdir(tmp_path / "sub")
    recipe, _ = load_tokenize_recipe(str(child), ["n_dumps=4"])
    assert (recipe.name, recipe.n_dumps, recipe.tasks) == ("child", 4, 3)
    assert list(recipe.inputs.roots) == [str(tmp_path / "data")]  # relative to base.yaml, not to the cwd
    assert recipe.tokenizer.path == str(tmp_path / "tok.json")
    with pytest.raises(ConfigError, match="did you mean 'n_dumps'"):
        load_tokenize_recipe(str(child), ["n_dump=4"])
    child.write_text("include: [../base.yaml]\ntaskz: 3\n")
    with pytest.raises(ConfigError, match="taskz"):
        load_tokenize_recipe(str(child))
