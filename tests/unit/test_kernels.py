"""`training.kernels` resolved in the job (runtime/model/kernels.py) and checked before submission (preflight):
which library computes each op, the fallbacks and why, and the config errors for a library a node lacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalaunch.errors import PreflightError
from megalaunch.runtime.model import kernels
from megalaunch.runtime.rank.failures import ConfigFailure, classify

LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
         "--tensor-model-parallel-size", "1", "--transformer-impl", "local"]


def _installed(monkeypatch: pytest.MonkeyPatch, *present: str) -> None:
    monkeypatch.setattr(kernels, "installed", lambda module: module in present)


@pytest.mark.parametrize(("requested", "present", "cpu", "library", "ops"), [
    ("auto", ("liger_kernel",), False, "liger" if kernels.LIGER_FASTER else "megatron", kernels.LIGER_FASTER),
    ("auto", (), False, "megatron", frozenset()),               # no liger here: Megatron's, said in the ledger
    ("auto", ("liger_kernel",), True, "megatron", frozenset()),  # CPU: liger needs CUDA
    ("liger", ("liger_kernel",), False, "liger", frozenset(kernels.OPS)),
    ("megatron", ("liger_kernel",), False, "megatron", frozenset()),
])
def test_kernels_resolve_per_node(monkeypatch, requested, present, cpu, library, ops) -> None:
    _installed(monkeypatch, *present)
    choice = kernels.resolve_kernels(requested, LLAMA, cpu=cpu)
    assert (choice.library, choice.liger_ops) == (library, ops)
    record = choice.ledger()
    assert record["requested"] == requested and record["chosen"] == library and record["why"]
    if library == "liger":
        assert set(record["fallbacks"]) == set(kernels.OPS) - ops


def test_auto_without_liger_says_why(monkeypatch) -> None:
    _installed(monkeypatch)
    assert "not importable" in kernels.resolve_kernels("auto", LLAMA, cpu=False).why


def test_auto_takes_only_the_ops_measured_faster(monkeypatch) -> None:
    _installed(monkeypatch, "liger_kernel")
    monkeypatch.setattr(kernels, "LIGER_FASTER", frozenset({"rope", "linear_ce"}))
    choice = kernels.resolve_kernels("auto", LLAMA, cpu=False)
    assert choice.library == "liger" and choice.liger_ops == {"rope", "linear_ce"}
    assert "measured as fast or faster" in choice.fallbacks["swiglu"]
    monkeypatch.setattr(kernels, "LIGER_FASTER", frozenset())
    assert kernels.resolve_kernels("auto", LLAMA, cpu=False).library == "megatron"


@pytest.mark.parametrize(("extra", "op", "words"), [
    (["--tensor-model-parallel-size", "2"], "linear_ce", "TP 2 shards the vocabulary"),
    (["--context-parallel-size", "2"], "rope", "context parallelism"),
    (["--qk-layernorm"], "rope", "q/k norms"),
    (["--rotary-percent", "0.5"], "rope", "partial rotary"),
    (["--normalization", "LayerNorm"], "rmsnorm", "not RMSNorm"),
    (["--mtp-num-layers", "1"], "linear_ce", "multi-token prediction"),
    (["--num-experts", "8"], "swiglu", "mixture-of-experts"),
    (["--tensor-model-parallel-size", "4", "--num-query-groups", "2"], "rope", "2 KV heads for TP 4"),
])
def test_an_op_liger_cannot_take_falls_back_with_its_reason(monkeypatch, extra, op, words) -> None:
    """(flag_value reads a flag's first occurrence: the variations come before the llama flags.)"""
    _installed(monkeypatch, "liger_kernel")
    choice = kernels.resolve_kernels("liger", [*extra, *LLAMA], cpu=False)
    assert op not in choice.liger_ops and words in choice.fallbacks[op]
    assert choice.library == "liger"  # the other ops still are liger's


@pytest.mark.parametrize("requested", ["auto", "liger"])
def test_a_training_flow_keeps_megatron_s_per_token_losses(monkeypatch, requested) -> None:
    """A flow (training.flow) reads per-token losses from the model (SimPO: each answer's mean log-prob);
    the fused loss makes only their sum, so a flow never gets it, and the ledger says why."""
    _installed(monkeypatch, "liger_kernel")
    choice = kernels.resolve_kernels(requested, LLAMA, cpu=False, flow="megalaunch.runtime.flows.preference_flow:PreferenceFlow")
    assert "linear_ce" not in choice.liger_ops and "per-token losses" in choice.fallbacks["linear_ce"]
    assert "rope" in choice.liger_ops
    assert "linear_ce" in kernels.resolve_kernels(requested, LLAMA, cpu=False).liger_ops


def test_nothing_fits_means_megatron(monkeypatch) -> None:
    _installed(monkeypatch, "liger_kernel")
    choice = kernels.resolve_kernels("liger", ["--tensor-model-parallel-size", "2"], cpu=False)
    assert choice.library == "megatron" and not choice.liger_ops and set(choice.fallbacks) == set(kernels.OPS)


@pytest.mark.parametrize(("requested", "present", "cpu", "argv", "words"), [
    ("liger", (), False, LLAMA, "liger-kernel, which is not installed"),
    ("liger", ("liger_kernel",), True, LLAMA, "needs a CUDA GPU"),
    ("te", (), False, LLAMA, "transformer-engine, which is not installed"),
    ("auto", (), False, ["--transformer-impl", "transformer_engine"], "transformer-engine"),
    ("fast", ("liger_kernel",), False, LLAMA, "not one of auto, megatron, liger, te"),
])
def test_a_missing_library_is_a_config_error_before_megatron_starts(monkeypatch, requested, present, cpu, argv,
                                                                    words) -> None:
    _installed(monkeypatch, *present)
    with pytest.raises(ConfigFailure) as e:
        kernels.resolve_kernels(requested, argv, cpu=cpu)
    assert words in e.value.reason and "training.kernels" in e.value.reason and e.value.fix
    failure = classify(e.value, started=False)
    assert failure.config and failure.fix == e.value.fix  # outcome config_error: the chain stops after one segment


def test_te_with_transformer_engine_present(monkeypatch) -> None:
    _installed(monkeypatch, "transformer_engine", "liger_kernel")
    te = ["--transformer-impl", "transformer_engine", *LLAMA[:-2]]
    assert kernels.resolve_kernels("auto", te, cpu=False).library == "te"
    assert kernels.resolve_kernels("te", te, cpu=False).library == "te"


@pytest.mark.parametrize(("sets", "words"), [
    (["training.kernels=liger", "cluster.gpus_per_node=0", "training.precision=fp32"], "need a GPU"),
    (["training.kernels=liger", "training.transformer_impl=transformer_engine", "cluster.gpus_per_node=1"],
     "transformer_impl: local"),
    (["training.kernels=te", "cluster.gpus_per_node=1"], "transformer-engine's layers"),
])
def test_preflight_refuses_a_kernels_choice_that_cannot_work(sets, words, tmp_path: Path) -> None:
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.preflight import check_cluster

    recipe = load_recipe("tiny", sets).recipe
    with pytest.raises(PreflightError) as e:
        check_cluster(recipe)
    assert "training.kernels" in str(e.value) and words in str(e.value)


def test_kernels_is_megalaunch_s_own_field_not_a_megatron_flag(tmp_path: Path) -> None:
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.megatron_args import megatron_args
    from megalaunch.launcher.prepare.job_inputs import runtime_settings
    from megalaunch.rundir.paths import RunPaths

    recipe = load_recipe("tiny", ["training.kernels=megatron"]).recipe
    assert "--kernels" not in megatron_args(recipe, RunPaths(tmp_path))
    assert runtime_settings(recipe).kernels == "megatron"
    assert load_recipe("tiny").recipe.training.kernels == "auto"  # the shipped default


def _shipped() -> list[str]:
    from megalaunch.config.recipe_files import shipped_recipes

    return sorted(k for k in shipped_recipes() if k.startswith("train/"))


@pytest.mark.parametrize("present", [(), ("liger_kernel",)])
def test_shipped_recipes_run_as_shipped_with_and_without_liger(monkeypatch, present, tmp_path: Path) -> None:
    """auto falls back to Megatron's kernels where liger-kernel is missing (and says so in the ledger), and
    takes liger's measured-faster ops where it is there; no shipped recipe fixes the choice."""
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.megatron_args import megatron_args
    from megalaunch.rundir.paths import RunPaths

    _installed(monkeypatch, *present)
    for ref in _shipped():
        recipe = load_recipe(ref).recipe
        assert recipe.training.kernels == "auto", ref
        argv = megatron_args(recipe, RunPaths(tmp_path))
        choice = kernels.resolve_kernels("auto", argv, cpu=False, device=H200)
        fits = kernels.LIGER_FASTER - set(kernels.liger_unsupported(argv))  # none for qwen3-235b-a22b (MoE, TP 4)
        assert choice.library == ("liger" if present and fits else "megatron"), (ref, choice)
        assert choice.experts == ("grouped" if recipe.model.num_experts else ""), (ref, choice)
        assert present or "not importable" in choice.why


def test_fused_loss_removes_the_logits_peak_from_the_memory_model() -> None:
    """llama3-1b, seq 2048, micro-batch 4, TP 1: Megatron's cross entropy keeps 6 bytes per logit (bf16 +
    fp32 softmax); the fused linear cross entropy keeps none, only its fp32 weight gradient and one chunk (its
    own terms: memory.fused_loss_bytes, measured on an H100); with TP > 1 the layout keeps Megatron's loss."""
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.planner.fit import model_shape, recipe_layout
    from megalaunch.config.planner.memory import Layout, estimate

    recipe = load_recipe("train/llama3-1b", ["model.seq_length=2048", "training.micro_batch_size=4",
                                             "training.kernels=liger"]).recipe
    shape = model_shape(recipe, recipe.data.vocab_size)
    layout = recipe_layout(recipe, 8, 8)
    assert layout.fused_loss
    fused, plain = estimate(shape, layout), estimate(shape, Layout(**{**layout.__dict__, "fused_loss": False}))
    assert plain.logits / 2**30 > 5.5 and fused.logits / 2**30 < 2.0  # 5.9 against 1.8 GiB
    assert plain.total - fused.total > 4.0 * 2**30
    tp2 = Layout(**{**layout.__dict__, "tp": 2, "dp": 4})
    assert estimate(shape, tp2).logits == estimate(shape, Layout(**{**tp2.__dict__, "fused_loss": False})).logits


def test_a_liger_failure_at_model_build_names_the_way_out() -> None:
    from megalaunch.runtime.rank.failures import known_fix

    try:
        raise ImportError("cannot import name 'LigerRopeFunction' from 'liger_kernel.ops.rope'")
    except ImportError as e:
        failure = classify(e, started=False)
    assert failure.config and "training.kernels=megatron" in (failure.fix or "")
    assert known_fix("ValueError: training.kernels: liger's norm is RMSNorm") is not None


LOCAL = [*LLAMA, "--no-gradient-accumulation-fusion"]  # what the launcher renders for the local layers


@pytest.mark.parametrize(("requested", "argv", "cpu", "torch_why", "state"), [
    ("auto", LOCAL, False, None, "on"),
    ("liger", LOCAL, False, None, "on"),
    ("megatron", LOCAL, False, None, "off: Megatron's own"),        # the reference path stays Megatron's
    ("auto", LOCAL, True, None, "off: no GPU"),
    ("auto", LOCAL, False, "torch 2.7.1 has no fp32-output matmul", "off: torch 2.7.1"),
    ("auto", [*LOCAL, "--use-torch-fsdp2"], False, None, "off: FSDP"),
    ("auto", [*LOCAL, "--num-experts", "8"], False, None, "off: mixture-of-experts"),
    ("auto", LLAMA, False, None, ""),                                # apex/TE path: Megatron decides
])
def test_gradient_accumulation_fusion_is_decided_per_node(monkeypatch, requested, argv, cpu, torch_why, state) -> None:
    _installed(monkeypatch, "liger_kernel")
    choice = kernels.with_wgrad_fusion(kernels.resolve_kernels(requested, argv, cpu=cpu), argv, cpu=cpu,
                                       torch_why=lambda: torch_why)
    assert choice.wgrad_fusion.startswith(state) and choice.wgrad_on == (state == "on")
    assert choice.ledger()["wgrad_fusion"] == choice.wgrad_fusion


def test_wgrad_fusion_module_accumulates_megatron_s_weight_gradient(monkeypatch) -> None:
    """The module registered under apex's name adds grad_output^T @ input into main_grad (what Megatron's
    layers call it for), for 2-D and 3-D activations; Megatron's layers, imported before, see it available."""
    import sys

    torch = pytest.importorskip("torch")
    from megalaunch.runtime.model import wgrad_fusion

    layers = pytest.importorskip("megatron.core.tensor_parallel.layers")
    monkeypatch.delitem(sys.modules, wgrad_fusion.MODULE, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    assert wgrad_fusion.install() and wgrad_fusion.install()  # twice: still megalaunch's, still patched
    assert layers._grad_accum_fusion_available and layers.fused_weight_gradient_mlp_cuda.__megalaunch__
    assert wgrad_fusion.enable(LOCAL) == LLAMA
    torch.manual_seed(0)
    x, dy = torch.randn(7, 3, 16), torch.randn(7, 3, 24)
    main = torch.randn(24, 16)
    product = dy.reshape(-1, 24).t() @ x.reshape(-1, 16)
    want = main + product
    sys.modules[wgrad_fusion.MODULE].wgrad_gemm_accum_fp32(x, dy, main)
    assert torch.allclose(main, want, atol=1e-5)
    half = torch.zeros(24, 16, dtype=torch.bfloat16)
    wgrad_fusion.wgrad_gemm_accum_fp16(x.reshape(-1, 16).bfloat16(), dy.reshape(-1, 24).bfloat16(), half)
    assert ((half.float() - product).abs().max() / product.abs().max()).item() < 2e-2
    monkeypatch.delitem(sys.modules, wgrad_fusion.MODULE)


@pytest.mark.parametrize(("version", "capability", "words"), [
    ("2.11.0+cu130", (9, 0), None), ("2.7.1+cu126", (9, 0), "torch 2.7.1"), ("2.11.0", (7, 0), "compute capability 7.0"),
])
def test_wgrad_fusion_needs_torch_2_8_and_an_ampere_gpu(monkeypatch, version, capability, words) -> None:
    """The fp32-output matmul of 16-bit inputs: torch >= 2.8 on compute capability >= 8.0; elsewhere the
    fusion stays off with the reason, and the fused loss sums its weight gradient in the inputs' dtype."""
    torch = pytest.importorskip("torch")
    from megalaunch.runtime.model import wgrad_fusion

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    why = wgrad_fusion.supported()
    assert why is None if words is None else words in why
    assert wgrad_fusion.fp32_output_matmul(0) == (words is None)


# --- the experts of mixture-of-experts layers ----------------------------------------------------------------

MOE = [*LLAMA, "--num-experts", "8", "--moe-router-topk", "2", "--disable-bias-linear"]
H200 = kernels.Device("NVIDIA H200", (9, 0), grouped_mm=True)


@pytest.mark.parametrize(("requested", "argv", "cpu", "device", "experts", "words"), [
    ("auto", MOE, False, H200, "grouped", "grouped: torch grouped_mm on NVIDIA H200"),
    ("liger", MOE, False, H200, "grouped", "grouped_mm"),
    ("megatron", MOE, False, H200, "sequential", "kernels: megatron"),
    ("auto", MOE, True, H200, "sequential", "on the CPU"),
    ("auto", MOE, False, kernels.Device("NVIDIA A100-SXM4-80GB", (8, 0), True), "sequential", "compute capability 8.0"),
    ("auto", MOE, False, kernels.Device("NVIDIA H100", (9, 0), False), "sequential", "no grouped_mm"),
    ("auto", MOE[:-1], False, H200, "sequential", "biases"),
    ("auto", LLAMA, False, H200, "", ""),  # a dense model: nothing to choose
])
def test_experts_are_chosen_with_the_kernels(monkeypatch, requested, argv, cpu, device, experts, words) -> None:
    _installed(monkeypatch, "liger_kernel")
    monkeypatch.delenv(kernels.EXPERTS_ENV, raising=False)
    choice = kernels.resolve_kernels(requested, argv, cpu=cpu, device=device)
    assert choice.experts == experts and words in choice.experts_why, choice
    assert choice.ledger()["experts"] == experts and choice.ledger()["experts_why"] == choice.experts_why


def test_te_keeps_its_own_experts(monkeypatch) -> None:
    _installed(monkeypatch, "transformer_engine")
    monkeypatch.delenv(kernels.EXPERTS_ENV, raising=False)
    te = [*MOE[:-1 - 8], "--transformer-impl", "transformer_engine", *MOE[-7:]]
    choice = kernels.resolve_kernels("auto", te, cpu=False, device=H200)
    assert (choice.library, choice.experts) == ("te", "te"), choice


@pytest.mark.parametrize("value", ["grouped", "sequential"])
def test_the_environment_overrides_the_experts_choice(monkeypatch, value) -> None:
    monkeypatch.setenv(kernels.EXPERTS_ENV, value)
    for cpu in (True, False):  # grouped also on the CPU (tests), sequential also on an H200 (benchmarks)
        choice = kernels.resolve_kernels("auto", MOE, cpu=cpu, device=H200)
        assert choice.experts == value and kernels.EXPERTS_ENV in choice.experts_why


@pytest.mark.parametrize(("value", "argv", "words"), [
    ("grouped-gemm", MOE, "is not one of grouped, sequential"),
    ("grouped", MOE[:-1], "biases"),
])
def test_the_environment_refuses_what_cannot_work(monkeypatch, value, argv, words) -> None:
    monkeypatch.setenv(kernels.EXPERTS_ENV, value)
    with pytest.raises(ConfigFailure, match=words):
        kernels.resolve_kernels("auto", argv, cpu=True)


def test_the_layer_spec_swaps_only_the_routed_experts() -> None:
    """model.layer_spec with experts=grouped: the MoE layer's experts are GroupedExperts; its router and shared
    experts, and every other part of the layer, are Megatron's local spec's."""
    pytest.importorskip("megatron.core")
    from megalaunch.runtime.model.experts.grouped import grouped_experts_class
    from megalaunch.runtime.model.model import layer_spec

    class Config:
        num_moe_experts = 8
        moe_grouped_gemm = False

    seq = layer_spec(Config(), experts="sequential")  # type: ignore[arg-type]
    grouped = layer_spec(Config(), experts="grouped")  # type: ignore[arg-type]
    subs_seq, subs_grouped = seq.submodules.mlp.keywords["submodules"], grouped.submodules.mlp.keywords["submodules"]
    assert subs_grouped.experts is grouped_experts_class()
    assert subs_seq.experts.func.__name__ == "SequentialMLP"
    assert repr(subs_grouped.router) == repr(subs_seq.router) and repr(subs_grouped.shared_experts) == repr(subs_seq.shared_experts)
    assert seq.submodules.mlp.func is grouped.submodules.mlp.func
    with pytest.raises(ValueError, match="valid: grouped, sequential"):
        layer_spec(Config(), experts="loop")  # type: ignore[arg-type]


def _resumed_run(tmp_path: Path, before: str | None, tracker: bool = True):  # type: ignore[no-untyped-def]
    from megalaunch.rundir.ledger import Ledger
    from megalaunch.rundir.paths import RunPaths

    paths = RunPaths(tmp_path)
    paths.ledger.parent.mkdir(parents=True, exist_ok=True)
    if before is not None:
        Ledger(paths).append("kernels", requested="auto", chosen="megatron", experts=before)
    if tracker:
        paths.checkpoints.mkdir(parents=True, exist_ok=True)
        paths.tracker.write_text("3")
    return paths


DOPT = [*MOE, "--use-distributed-optimizer"]


@pytest.mark.parametrize(("before", "argv", "tracker", "kept"), [
    ("sequential", DOPT, True, "sequential"),   # the checkpoint's class stays: the optimizer's buffers are laid out by it
    ("grouped", DOPT, True, "grouped"),         # same class: nothing to keep
    ("sequential", MOE, True, "grouped"),       # no distributed optimizer: its state goes by the model's keys
    ("sequential", DOPT, False, "grouped"),     # no checkpoint yet
    (None, DOPT, True, "grouped"),              # no earlier segment recorded
])
def test_a_resumed_run_keeps_the_experts_of_its_checkpoint(monkeypatch, tmp_path: Path, before, argv, tracker,
                                                            kept) -> None:
    monkeypatch.delenv(kernels.EXPERTS_ENV, raising=False)
    choice = kernels.resolve_kernels("auto", argv, cpu=False, device=H200)
    assert choice.experts == "grouped"
    got = kernels.keep_experts(choice, argv, _resumed_run(tmp_path, before, tracker))
    assert got.experts == kept
    assert ("kept from the run's checkpoint" in got.experts_why) == (kept != "grouped"), got


def test_forcing_the_other_experts_on_a_resumed_run_is_refused(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(kernels.EXPERTS_ENV, "grouped")
    choice = kernels.resolve_kernels("auto", DOPT, cpu=True)
    with pytest.raises(ConfigFailure, match="written with the sequential experts"):
        kernels.keep_experts(choice, DOPT, _resumed_run(tmp_path, "sequential"))
