"""Recipes: every shipped one loads; composition, precedence, provenance and --set coercion."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe, parse_set
from megalaunch.config.preflight import preflight
from megalaunch.config.recipe_files import shipped_recipes
from megalaunch.errors import ConfigError

TRAIN = sorted(k for k in shipped_recipes() if k.startswith("train/"))
CLUSTERS = sorted(k.split("/")[1] for k in shipped_recipes() if k.startswith("clusters/"))
MODELS = sorted(k for k in shipped_recipes() if k.startswith("models/"))


@pytest.mark.parametrize("ref", TRAIN)
def test_every_training_recipe_loads_and_passes_preflight(ref: str) -> None:
    loaded = load_recipe(ref)
    topo, _ = preflight(loaded.recipe)
    assert topo.world_size == topo.tp * topo.pp * topo.cp * topo.dp


@pytest.mark.parametrize("ref", TRAIN)
def test_no_shipped_recipe_needs_a_library_beyond_the_train_install(ref: str, tmp_path: Path, monkeypatch) -> None:
    """Shipped recipes run as shipped on a node without transformer-engine, apex or flash-attn: the
    job's kernel check (runtime/rank/failures.py) passes with none of them importable, and sequence
    parallelism, where a recipe asks for it, uses megalaunch's torch norm on the local layers."""
    from megalaunch.config.megatron_args import megatron_args
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.runtime.rank import failures

    monkeypatch.setattr(failures, "installed", lambda module: False)
    recipe = load_recipe(ref).recipe
    argv = megatron_args(recipe, RunPaths(tmp_path))
    notes = failures.check_kernels(argv, recipe.training.attention)
    assert recipe.training.transformer_impl == "local"
    assert recipe.training.attention != "local" or recipe.model.seq_length <= 2048, \
        "Megatron's local attention materialises seq x seq scores: use sdpa for long sequences"
    assert bool(notes) == recipe.parallel.sequence_parallel


@pytest.mark.parametrize("model", MODELS)
def test_every_model_shape_composes_into_a_valid_recipe(model: str, tmp_path: Path) -> None:
    r = tmp_path / "r.yaml"
    r.write_text(f"include: [{model}, training/pretrain, clusters/slurm]\nname: m\n"
                 "data: {mock: true, vocab_size: 32000}\ntraining: {global_batch_size: 1024}\n"
                 "cluster: {gpu: null}\n")  # the shape alone: whether it fits 8 GPUs is test_memory_plan's
    loaded = load_recipe(str(r))
    assert loaded.origin("model.num_layers") == f"recipes/{model}.yaml"
    preflight(loaded.recipe)


def test_scaling_paper_shapes_are_exact() -> None:
    expected = {"1.7b": (24, 2304, 24), "3.6b": (32, 3072, 30), "7.5b": (32, 4096, 36), "18.4b": (48, 6144, 40),
                "39.1b": (64, 8192, 48), "76.1b": (80, 10240, 60), "145.6b": (96, 12288, 80),
                "310.1b": (128, 16384, 96)}
    import yaml

    for size, (heads, hidden, layers) in expected.items():
        model = yaml.safe_load(shipped_recipes()[f"models/gpt-{size}"].read_text())["model"]
        assert (model["num_attention_heads"], model["hidden_size"], model["num_layers"]) == (heads, hidden, layers)


def test_precedence_set_over_file_over_includes(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("include: [tiny]\ntraining: {lr: 1e-3, seed: 7}\n")
    top = tmp_path / "top.yaml"
    top.write_text("include: [base.yaml]\nname: p\ntraining: {lr: 2e-3}\n")
    loaded = load_recipe(str(top), ["training.lr=5e-4"])
    r = loaded.recipe
    assert r.training.lr == 5e-4 and isinstance(r.training.lr, float)
    assert r.training.seed == 7
    assert loaded.origin("training.lr") == "--set"
    assert loaded.origin("training.seed") == str(base)
    assert loaded.origin("model.hidden_size") == "recipes/models/tiny.yaml"
    assert loaded.origin("training.adam_eps") == "default"


def test_later_include_overrides_earlier(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("training: {seed: 1}\n")
    (tmp_path / "b.yaml").write_text("training: {seed: 2}\n")
    top = tmp_path / "top.yaml"
    top.write_text("include: [tiny, a.yaml, b.yaml]\nname: p\n")
    assert load_recipe(str(top)).recipe.training.seed == 2


@pytest.mark.parametrize(("expr", "key", "value"), [
    ("training.lr=5e-4", ["training", "lr"], "5e-4"),  # YAML keeps it a string; the schema makes it a float
    ("cluster.modules=[cuda/12, nccl]", ["cluster", "modules"], ["cuda/12", "nccl"]),
    ("cluster.env={A: 1, B: x}", ["cluster", "env"], {"A": 1, "B": "x"}),
    ("cluster.partition=null", ["cluster", "partition"], None),
    ("chain.auto_requeue=false", ["chain", "auto_requeue"], False),
])
def test_parse_set(expr: str, key: list[str], value: object) -> None:
    assert parse_set(expr) == (key, value)


def test_set_coercion_into_the_schema() -> None:
    r = load_recipe("tiny", ["training.lr=5e-4", "cluster.modules=[a, b]", "cluster.env={X: 1}",
                             "training.train_iters=1e3"]).recipe
    assert r.training.lr == pytest.approx(5e-4)
    assert r.cluster.modules == ("a", "b")
    assert r.cluster.env == {"X": "1"}
    assert r.training.train_iters == 1000


def test_include_cycle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("include: [b.yaml]\n")
    (tmp_path / "b.yaml").write_text("include: [a.yaml]\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_run_yaml_round_trips(tmp_path: Path) -> None:
    import yaml

    from megalaunch.config.loader import load_resolved
    from megalaunch.launcher.prepare.prepare import prepare_run

    loaded = load_recipe("llama3-70b", cluster="pyxis")
    prepared = prepare_run(loaded, chain_name="x-00000000", created="T", root=tmp_path)
    again = load_resolved(yaml.safe_load(prepared.files["run.yaml"]))
    assert again == loaded.recipe
    assert "# recipes/models/llama3-70b.yaml" in prepared.files["run.yaml"]
