"""What the planner counts under `training.kernels: auto` (config/planner/fit.py): liger-kernel's fused loss at TP 1
and the grouped experts' fused dispatch, where the job computes them on a GPU node (runtime/model/kernels.py); what a
layout fits the GPUs' memory only with (`fit_needs`), carried to the job in RUN/runtime.json; and the job's refusal,
before Megatron starts, on a node that would run without it (liger-kernel missing, SequentialMLP, the fused
dispatch turned off) instead of running out of memory later."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.planner.fit import fit_needs, grouped_experts, liger_loss
from megalaunch.config.planner.plan import plan_recipe
from megalaunch.launcher.prepare.job_inputs import runtime_settings
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.model import kernels
from megalaunch.runtime.rank.failures import ConfigFailure, classify
from megalaunch.runtime.rank.settings import RuntimeSettings

LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--tensor-model-parallel-size", "1", "--transformer-impl", "local"]
MOE = [*LLAMA, "--num-experts", "64", "--moe-router-topk", "8", "--disable-bias-linear"]
H200 = kernels.Device("NVIDIA H200", (9, 0), grouped_mm=True)
LOSS = {"liger_loss": "~210 GiB per GPU without it, ~116 as planned, of 140 GiB (cluster.gpu H200)"}


@pytest.mark.parametrize(("ref", "sets", "counted"), [
    ("llama3-8b", [], True),  # auto on GPUs: liger-kernel comes with megalaunch[train]
    ("llama3-8b", ["training.kernels=liger"], True),
    ("llama3-8b", ["training.kernels=megatron"], False),
    ("llama3-8b", ["training.transformer_impl=transformer_engine"], False),  # auto takes TE's layers
    ("llama3-8b", ["megatron_args.mtp_num_layers=1"], False),  # multi-token prediction computes its own losses
    ("dpo-llama3-1b", [], False),  # a flow reads per-token losses
    ("tiny", [], False),  # the CPU
])
def test_the_planner_counts_liger_loss_where_the_job_computes_it(ref: str, sets: list[str], counted: bool) -> None:
    assert liger_loss(load_recipe(ref, sets, plan_layout=False).recipe) is counted


@pytest.mark.parametrize(("sets", "grouped"), [
    (["cluster.gpu=H200"], True),
    (["cluster.gpu=H100"], True),
    (["cluster.gpu=B200"], True),
    (["cluster.gpu=A100"], False),  # compute capability 8.0: SequentialMLP
    (["cluster.gpu=L40S"], False),
    (["cluster.gpu=null", "cluster.gpu_memory_gb=141"], False),  # a GPU the planner does not know: the larger count
    (["cluster.gpu=H200", "training.kernels=megatron"], False),
    (["cluster.gpu=H200", "model.disable_bias_linear=false"], False),  # grouped experts take no bias
])
def test_the_planner_counts_the_grouped_experts_where_the_job_builds_them(sets: list[str], grouped: bool) -> None:
    recipe = load_recipe("moe-3b", sets, plan_layout=False).recipe
    assert grouped_experts(recipe) is grouped


def test_moe_3b_on_an_h200_gets_a_micro_batch_measured_fast() -> None:
    """Issue #48: `megalaunch plan moe-3b --gpu H200` and the recipe's `parallel: auto` pick micro-batch 8 or 16
    (measured 38.4 / 39.1 % MFU in 80.7 / 108.9 GiB with liger's loss), no longer 4 (33.2 %): Megatron's loss,
    assumed under auto before, put 16 at 211 GiB."""
    auto = load_recipe("moe-3b", ["cluster.gpu=H200"]).recipe
    plan = plan_recipe(load_recipe("moe-3b", plan_layout=False).recipe, 151936, gpu="H200")
    assert plan.best is not None and plan.best.layout.micro_batch in (8, 16)
    assert auto.training.micro_batch_size == plan.best.layout.micro_batch
    assert plan.best.layout.fused_loss and plan.best.layout.grouped_experts and plan.best.memory.needed_gib() < 139.8


def test_what_the_layout_fits_only_with_reaches_the_job() -> None:
    settings = runtime_settings(load_recipe("moe-3b", ["cluster.gpu=H200"]).recipe)  # micro-batch 16
    assert settings.fits_with == {"liger_loss": "~210 GiB per GPU without it, ~116 as planned, of 140 GiB "
                                                "(cluster.gpu H200)"}
    assert RuntimeSettings(**json.loads(settings.to_json())).fits_with == settings.fits_with  # RUN/runtime.json
    tight = load_recipe("moe-3b", ["cluster.gpu=H200", "cluster.gpu_memory_gb=90", "training.micro_batch_size=8"])
    assert fit_needs(tight.recipe, 151936) == {
        "liger_loss": "~134 GiB per GPU without it, ~87 as planned, of 90 GiB (cluster.gpu_memory_gb)",
        "grouped_experts": "~96 GiB per GPU without it, ~87 as planned, of 90 GiB (cluster.gpu_memory_gb)"}
    either = load_recipe("moe-3b", ["cluster.gpu=H200", "training.micro_batch_size=8"]).recipe
    assert list(fit_needs(either, 151936)) == ["liger_loss+grouped_experts"]  # each alone fits, neither does not
    assert runtime_settings(load_recipe("llama3-8b").recipe).fits_with is None  # TP 1 x PP 2: fits either way
    assert runtime_settings(load_recipe("tiny").recipe).fits_with is None  # the CPU


def test_a_node_without_liger_kernel_is_refused_where_the_layout_needs_its_loss(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    monkeypatch.setattr(kernels, "installed", lambda module: False)
    with pytest.raises(ConfigFailure) as e:
        kernels.node_kernels("auto", LLAMA, cpu=False, flow=None, paths=RunPaths(tmp_path), fits_with=LOSS)
    reason, fix = e.value.reason, e.value.fix or ""
    assert "\n" not in reason + fix
    assert reason == ("training.kernels: auto: this run's layout fits the GPUs' memory only with liger-kernel's fused "
                      f"loss ({LOSS['liger_loss']}), but this node runs without it (auto: liger-kernel is not importable "
                      "on this node)")
    assert fix == (f"install liger-kernel on the nodes (pip install 'megalaunch[train]'), or plan for Megatron's "
                   f"kernels: megalaunch resume {tmp_path} --set training.kernels=megatron --set parallel=auto")
    assert classify(e.value, started=False).config  # outcome config_error: the chain stops after this segment
    assert kernels.node_kernels("auto", LLAMA, cpu=False, flow=None, paths=RunPaths(tmp_path),
                                fits_with=None).library == "megatron"  # no need: Megatron's, as before
    monkeypatch.setattr(kernels, "installed", lambda module: module == "liger_kernel")
    choice = kernels.node_kernels("auto", LLAMA, cpu=False, flow=None, paths=RunPaths(tmp_path), fits_with=LOSS)
    assert "linear_ce" in choice.liger_ops
    with pytest.raises(ConfigFailure, match=r"TP 2 shards the vocabulary"):  # liger there, its loss not at TP 2
        tp2 = [*LLAMA[:-3], "2", *LLAMA[-2:]]
        kernels.node_kernels("auto", tp2, cpu=False, flow=None, paths=RunPaths(tmp_path), fits_with=LOSS)


@pytest.mark.parametrize(("device", "env", "words"), [
    (kernels.Device("NVIDIA H100", (9, 0), grouped_mm=False), {}, "sequential: this torch has no grouped_mm"),
    (H200, {kernels.EXPERTS_ENV: "sequential"}, "sequential: set by MEGALAUNCH_MOE_EXPERTS"),
    (H200, {"MEGALAUNCH_MOE_FUSED": "off"}, "MEGALAUNCH_MOE_FUSED=off keeps Megatron's dispatch"),
])
def test_a_node_without_the_fused_experts_is_refused_where_the_layout_needs_them(
        monkeypatch: pytest.MonkeyPatch, device: kernels.Device, env: dict[str, str], words: str) -> None:
    monkeypatch.setattr(kernels, "installed", lambda module: module == "liger_kernel")
    for name in (kernels.EXPERTS_ENV, "MEGALAUNCH_MOE_FUSED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    choice = kernels.resolve_kernels("auto", MOE, cpu=False, device=device)
    need = {"grouped_experts": "~96 GiB per GPU without it, ~87 as planned, of 90 GiB (cluster.gpu_memory_gb)"}
    with pytest.raises(ConfigFailure) as e:
        kernels.check_fit(choice, need, "/runs/r")
    assert "only with megalaunch's grouped experts and their fused dispatch (~96 GiB" in e.value.reason
    assert words in e.value.reason and "grouped_mm" in (e.value.fix or "") and "\n" not in e.value.reason
    either = {"liger_loss+grouped_experts": "~142 GiB per GPU without both, ~87 as planned, of 140 GiB"}
    assert kernels.check_fit(choice, either, "/runs/r") is choice  # liger's loss is here: enough
    monkeypatch.setattr(kernels, "installed", lambda module: False)
    with pytest.raises(ConfigFailure, match=r"fused loss or megalaunch.s grouped experts .* without both"):
        kernels.check_fit(kernels.resolve_kernels("auto", MOE, cpu=False, device=device), either, "/runs/r")


def test_a_chain_that_may_shrink_is_checked_at_its_fewest_nodes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """As preflight's memory check: the smallest step a shrink may run holds more optimizer state per GPU, so it may
    need what the full step does not; the job's check gets both (the full step's figures where both need it)."""
    from megalaunch.config.planner import fit

    def needs(recipe: object, vocab: int | None) -> dict[str, str]:
        nodes = recipe.cluster.nodes  # type: ignore[attr-defined]
        return {"liger_loss": f"at {nodes} nodes"} if nodes == 2 else {}

    monkeypatch.setattr(fit, "fit_needs", needs)
    assert runtime_settings(load_recipe("llama3-8b", ["cluster.min_nodes=2"]).recipe).fits_with == {
        "liger_loss": "at 2 nodes"}
    assert runtime_settings(load_recipe("llama3-8b").recipe).fits_with is None
