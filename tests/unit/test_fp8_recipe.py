"""`training.precision: fp8` on the launcher's side (config/megatron_args.py, preflight, the job's settings):
megalaunch's own FP8 path changes nothing in Megatron's arguments (the job reads the recipe from runtime.json);
with transformer-engine's layers, TE's own recipe is rendered (a golden file: it cannot run here); what cannot
work is refused before anything is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.megatron_args import megatron_args
from megalaunch.config.preflight import check_cluster
from megalaunch.errors import PreflightError
from megalaunch.launcher.prepare.job_inputs import runtime_settings
from megalaunch.rundir.paths import RunPaths

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "args"
GPU = ["cluster.gpus_per_node=1", "cluster.tasks_per_node=1", "training.fused_kernels=true"]
TE = ["training.transformer_impl=transformer_engine", "training.kernels=te", "training.attention=te"]


def args(tmp_path: Path, *sets: str, recipe: str = "tiny") -> list[str]:
    return megatron_args(load_recipe(recipe, list(sets)).recipe, RunPaths(tmp_path / "run"))


@pytest.mark.parametrize("fp8_recipe", ["tensorwise", "rowwise"])
def test_megalaunchs_fp8_renders_bf16s_arguments_and_tells_the_job(tmp_path: Path, fp8_recipe: str) -> None:
    fp8 = [*GPU, "training.precision=fp8", f"training.fp8_recipe={fp8_recipe}"]
    assert args(tmp_path, *fp8) == args(tmp_path, *GPU, "training.precision=bf16")
    assert "--bf16" in args(tmp_path, *fp8) and "--cross-entropy-loss-fusion" in args(tmp_path, *fp8)
    assert runtime_settings(load_recipe("tiny", fp8).recipe).fp8 == fp8_recipe
    assert runtime_settings(load_recipe("tiny", [*GPU, "training.precision=bf16"]).recipe).fp8 is None


def test_fp8_on_a_cpu_job_keeps_fp32_weights(tmp_path: Path) -> None:
    cpu = ["cluster.gpus_per_node=0", "training.precision=fp8"]
    check_cluster(load_recipe("tiny", cpu).recipe)  # allowed: FP8 GEMMs on fp32 weights
    assert args(tmp_path, *cpu) == args(tmp_path, "cluster.gpus_per_node=0", "training.precision=fp32")
    with pytest.raises(PreflightError) as e:  # bf16 still is not
        check_cluster(load_recipe("tiny", ["cluster.gpus_per_node=0", "training.precision=bf16"]).recipe)
    assert "training.precision" in str(e.value)


def test_fp8_with_transformer_engine_renders_tes_recipe(tmp_path: Path) -> None:
    base = args(tmp_path, *GPU, *TE, "training.precision=bf16")
    fp8 = args(tmp_path, *GPU, *TE, "training.precision=fp8")
    i = fp8.index("--fp8-format")
    assert fp8[i:i + 4] == ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]  # TE: e4m3 forward, e5m2 grads
    assert fp8[:i] + fp8[i + 4:] == base  # and nothing else changes


def test_golden_megatron_args_of_llama3_8b_in_fp8_on_transformer_engine(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", "/home/user")
    got = "\n".join(args(tmp_path, "training.precision=fp8", *TE, recipe="llama3-8b")).replace(str(tmp_path), "RUN")
    golden = GOLDEN / "llama3-8b.fp8-te.args"
    if os.environ.get("MEGALAUNCH_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got + "\n")
    assert got + "\n" == golden.read_text(), f"{golden.name} changed; if intended, regenerate (MEGALAUNCH_UPDATE_GOLDEN=1)"


def test_preflight_refuses_rowwise_on_transformer_engine() -> None:
    recipe = load_recipe("tiny", [*GPU, *TE, "training.precision=fp8", "training.fp8_recipe=rowwise"]).recipe
    with pytest.raises(PreflightError) as e:
        check_cluster(recipe)
    assert "training.fp8_recipe" in str(e.value) and "tensorwise" in str(e.value)


def test_an_unknown_fp8_recipe_names_the_field() -> None:
    with pytest.raises(Exception) as e:
        load_recipe("tiny", ["training.fp8_recipe=blockwise"])
    assert "training.fp8_recipe" in str(e.value) and "tensorwise" in str(e.value)
