"""`training.kernels`: which library computes RMSNorm, RoPE, SwiGLU and the output layer with its cross
entropy on Megatron's local layers, decided in the job like `training.attention: auto` (where importability
and the GPU are known) and recorded in the ledger.

- `megatron`: Megatron's own (unfused torch norm and rotary embedding; the torch.compile'd SwiGLU and cross
  entropy of `training.fused_kernels`);
- `liger`:    liger-kernel's Triton kernels (runtime/model/liger_layers.py) for each op whose shape they support,
  Megatron's for the rest (each fallback is named in the ledger); a CUDA GPU is needed;
- `te`:       transformer-engine's own fused layers (`transformer_impl: transformer_engine`);
- `auto`:     te with transformer_impl: transformer_engine; else liger, where liger-kernel is importable on a
  GPU, for the ops measured faster than Megatron's (LIGER_FASTER, docs/results.md); else megatron.

Mixture-of-experts layers (local spec) also get their experts here (`KernelChoice.experts`): `grouped`, megalaunch's
experts on torch's grouped GEMM (runtime/model/experts/), under auto and liger on CUDA GPUs of compute capability
9.0 or more where torch has grouped_mm (measured x8.5-x26 faster than the loop for fine-grained experts, x1.4-1.6
for Mixtral-like ones: docs/results.md); `sequential`, Megatron's SequentialMLP, elsewhere and under megatron.
MEGALAUNCH_MOE_EXPERTS=grouped|sequential overrides it (benchmarks, tests).
Under `precision: fp8` the grouped experts' GEMMs run in FP8 where the GPU can (runtime/model/experts/fp8.py, wired by
fp8_linear.install); SequentialMLP's stay bf16.

The parameters and their names are the same whichever library computes the op, so a checkpoint saved with
one choice loads with another (tests/unit/test_kernels.py).

Standard library only at module level: the launcher's tests import it without torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from megalaunch.runtime.rank.failures import ConfigFailure, flag_value, installed

if TYPE_CHECKING:  # pragma: no cover
    from megalaunch.rundir.paths import RunPaths

KERNELS = ("auto", "megatron", "liger", "te")
OPS = ("rmsnorm", "rope", "swiglu", "linear_ce")
# The ops where liger-kernel was measured faster than Megatron's path (bench/kernels.py, docs/results.md "Fused
# kernels", H100): what `auto` takes from liger. RoPE (x4.3 on the GPU) and SwiGLU (x1.03 at llama3-1b's width,
# x3.5 at llama3-8b's) per op, the fused loss end to end (no logits; megalaunch's loop around liger's kernel,
# without its host syncs). liger's RMSNorm is not faster (x0.93 on the GPU at 1b, and three times the CPU's
# launch cost): Megatron's torch norm stays.
LIGER_FASTER: frozenset[str] = frozenset({"rope", "swiglu", "linear_ce"})
EXPERTS = ("grouped", "sequential")
EXPERTS_ENV = "MEGALAUNCH_MOE_EXPERTS"
GROUPED_MIN_CAPABILITY = (9, 0)  # sm90: torch's CUTLASS grouped kernels, where grouped_mm was measured faster
# What the planner's memory fit may rely on (RuntimeSettings.fits_with, config/planner/fit.py fit_needs), in words
FIT_NEEDS = {"liger_loss": "liger-kernel's fused loss",
             "grouped_experts": "megalaunch's grouped experts and their fused dispatch"}
LIGER_FIX = ("pip install liger-kernel in the job's environment (it comes with megalaunch[train]), "
             "or --set training.kernels=auto (Megatron's kernels where liger-kernel is missing)")


@dataclass(frozen=True)
class KernelChoice:
    """The library that computes each op on this node, and why."""

    requested: str
    library: str                                 # megatron | liger | te: the choice as a whole
    why: str
    liger_ops: frozenset[str] = frozenset()      # the ops liger-kernel computes (library == liger)
    fallbacks: dict[str, str] = field(default_factory=dict)  # op -> why Megatron's computes it instead
    wgrad_fusion: str = ""                       # "on: ..." / "off: ..." (runtime/model/wgrad_fusion.py); "" n/a
    experts: str = ""                            # grouped | sequential | te: MoE layers' experts; "" without MoE
    experts_why: str = ""

    @property
    def wgrad_on(self) -> bool:
        return self.wgrad_fusion.startswith("on")

    def ledger(self) -> dict[str, object]:
        return {"requested": self.requested, "chosen": self.library, "why": self.why,
                "liger_ops": sorted(self.liger_ops), "fallbacks": dict(self.fallbacks),
                "wgrad_fusion": self.wgrad_fusion, "experts": self.experts, "experts_why": self.experts_why}


def liger_unsupported(argv: list[str], flow: bool = False) -> dict[str, str]:
    """Which ops liger-kernel cannot take in this model and layout (Megatron's argument list; `flow`: a
    training flow computes the loss), and why."""
    out: dict[str, str] = {}
    if (flag_value(argv, "--normalization") or "LayerNorm") != "RMSNorm":
        out["rmsnorm"] = "the model's norm is not RMSNorm"
    cp = int(flag_value(argv, "--context-parallel-size") or 1)
    rope_why = [why for bad, why in (
        ((flag_value(argv, "--position-embedding-type") or "learned_absolute") != "rope", "no rotary embedding"),
        (cp > 1, f"context parallelism (CP {cp}) splits the sequence"),
        ("--qk-layernorm" in argv, "q/k norms come between the projection and the rotation"),
        ("--rotary-interleaved" in argv, "interleaved rotary layout"),
        (float(flag_value(argv, "--rotary-percent") or 1.0) != 1.0, "partial rotary embedding"),
    ) if bad]
    if rope_why:
        out["rope"] = rope_why[0]
    if "--swiglu" not in argv:
        out["swiglu"] = "the MLP is not SwiGLU"
    elif flag_value(argv, "--num-experts"):
        out["swiglu"] = "mixture-of-experts layers keep Megatron's expert MLPs"
    tp = int(flag_value(argv, "--tensor-model-parallel-size") or 1)
    groups = int(flag_value(argv, "--num-query-groups") or 0)
    if "rope" not in out and 0 < groups < tp:
        out["rope"] = f"{groups} KV heads for TP {tp}: each rank takes a slice of the query heads after the rotation"
    if flow:
        out["linear_ce"] = "a training flow reads per-token losses (the fused loss makes only their sum)"
    elif tp > 1:
        out["linear_ce"] = f"TP {tp} shards the vocabulary (liger's fused linear cross entropy needs the whole)"
    elif flag_value(argv, "--mtp-num-layers"):
        out["linear_ce"] = "multi-token prediction computes its own losses"
    return out


def resolve_kernels(requested: str, argv: list[str], *, cpu: bool, flow: str | None = None,
                    device: Device | None = None) -> KernelChoice:
    """`training.kernels` decided for this node; raises ConfigFailure when the recipe asks for a library
    this node lacks (before Megatron starts, so the chain stops after one segment: outcome config_error).
    With a training flow (`flow`), the fused loss is left out: a flow reads the model's per-token losses,
    which the fused loss does not make (it gives their sum, spread as the mean over the labelled tokens).
    The experts of mixture-of-experts layers are decided with it (`experts_choice`; `device`: this node's GPU,
    looked up when not given)."""
    choice = _library(requested, argv, cpu=cpu, flow=flow)
    experts, why = experts_choice(choice, argv, cpu=cpu, device=device)
    return replace(choice, experts=experts, experts_why=why)


def _library(requested: str, argv: list[str], *, cpu: bool, flow: str | None = None) -> KernelChoice:
    if requested not in KERNELS:
        raise ConfigFailure(f"training.kernels: {requested!r} is not one of {', '.join(KERNELS)}",
                            "--set training.kernels=auto")
    te_impl = flag_value(argv, "--transformer-impl") == "transformer_engine"
    if requested == "te" or (requested == "auto" and te_impl):
        if not installed("transformer_engine"):
            raise ConfigFailure("training.kernels: te needs transformer-engine, which is not installed on this node",
                                "--set training.kernels=auto --set training.transformer_impl=local, "
                                "or install transformer-engine (pip install megalaunch[te])")
        return KernelChoice(requested, "te", "set in the recipe" if requested == "te"
                            else "auto: transformer_impl is transformer_engine (its layers bring their own fusions)")
    if requested == "megatron":
        return KernelChoice(requested, "megatron", "set in the recipe")
    if requested == "liger":
        if not installed("liger_kernel"):
            raise ConfigFailure("training.kernels: liger needs liger-kernel, which is not installed on this node",
                                LIGER_FIX)
        if cpu:
            raise ConfigFailure("training.kernels: liger needs a CUDA GPU (its kernels are Triton's); this job has none",
                                "--set training.kernels=auto (Megatron's kernels on the CPU)")
        return _liger(requested, argv, *_bench_ops(), flow=bool(flow))
    if cpu:
        return KernelChoice(requested, "megatron", "auto: Megatron's kernels on the CPU (liger-kernel needs CUDA)")
    if not installed("liger_kernel"):
        return KernelChoice(requested, "megatron", "auto: liger-kernel is not importable on this node")
    if not LIGER_FASTER:
        return KernelChoice(requested, "megatron", "auto: none of liger-kernel's kernels is measured faster yet "
                            "(bench/kernels.py); training.kernels=liger uses them")
    return _liger(requested, argv, LIGER_FASTER, "auto: liger-kernel is importable; its kernels where measured faster",
                  flow=bool(flow))


@dataclass(frozen=True)
class Device:
    """What the experts' choice needs to know of this node's GPU."""

    name: str
    capability: tuple[int, int]
    grouped_mm: bool  # torch has torch.nn.functional.grouped_mm (or torch._grouped_mm)


def this_device() -> Device | None:
    """This node's GPU (None: no CUDA GPU is visible)."""
    import torch

    from megalaunch.runtime.model.experts.gmm import grouped_mm_fn

    if not torch.cuda.is_available():
        return None
    return Device(torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()),  # type: ignore[arg-type]
                  grouped_mm_fn() is not None)


def experts_choice(choice: KernelChoice, argv: list[str], *, cpu: bool,
                   device: Device | None = None) -> tuple[str, str]:
    """Which experts the mixture-of-experts layers get, and why ("" without MoE); MEGALAUNCH_MOE_EXPERTS first."""
    if not flag_value(argv, "--num-experts"):
        return "", ""
    bias = "--disable-bias-linear" not in argv
    forced = os.environ.get(EXPERTS_ENV, "").strip()
    if forced:
        if forced not in EXPERTS:
            raise ConfigFailure(f"{EXPERTS_ENV}={forced!r} is not one of {', '.join(EXPERTS)}",
                                f"unset {EXPERTS_ENV}, or set it to one of {', '.join(EXPERTS)}")
        if forced == "grouped" and (bias or choice.library == "te"):
            raise ConfigFailure(f"{EXPERTS_ENV}=grouped: " + ("the experts have biases (grouped experts take none)"
                                if bias else "transformer_impl: transformer_engine brings its own experts"),
                                f"unset {EXPERTS_ENV}, or --set model.disable_bias_linear=true")
        return forced, f"{forced}: set by {EXPERTS_ENV}"
    if choice.library == "te":
        return "te", "te: transformer-engine's layer spec brings its experts"
    if choice.requested == "megatron":
        return "sequential", "sequential: kernels: megatron"
    if cpu:
        return "sequential", "sequential: on the CPU"
    if bias:
        return "sequential", "sequential: the experts have biases (grouped experts take none)"
    dev = device or this_device()
    if dev is None:
        return "sequential", "sequential: no CUDA GPU is visible"
    if not dev.grouped_mm:
        return "sequential", "sequential: this torch has no grouped_mm"
    if dev.capability < GROUPED_MIN_CAPABILITY:
        cap = ".".join(map(str, dev.capability))
        return "sequential", f"sequential: {dev.name} (compute capability {cap}; grouped_mm is measured on 9.0+)"
    return "grouped", f"grouped: torch grouped_mm on {dev.name}"


def keep_experts(choice: KernelChoice, argv: list[str], paths: RunPaths) -> KernelChoice:
    """The choice with the experts of the run's checkpoint kept. Both classes write the same model checkpoint, but
    the distributed optimizer saves its state per gradient buffer (dp_reshardable), laid out by the parameters (one
    3D weight per linear layer, or one per expert): resumed by the other class, the Adam moments would load into
    the wrong elements without an error (measured on tiny-moe: the losses after the resume moved by 1e-3). So a
    resumed run keeps the experts of its previous segment (its `kernels` record); MEGALAUNCH_MOE_EXPERTS asking for
    the other is refused."""
    from megalaunch.rundir.ledger import Ledger

    if not choice.experts or "--use-distributed-optimizer" not in argv or paths.read_tracker() is None:
        return choice
    before = str((Ledger(paths).last("kernels") or {}).get("experts") or "")
    if not before or before == choice.experts:
        return choice
    if os.environ.get(EXPERTS_ENV, "").strip():
        raise ConfigFailure(f"{EXPERTS_ENV}={choice.experts}: this run's checkpoint was written with the {before} "
                            "experts, and the distributed optimizer's state does not carry over between them",
                            f"unset {EXPERTS_ENV} (the run keeps {before}), or start a new run")
    return replace(choice, experts=before, experts_why=f"{before}: kept from the run's checkpoint (the distributed "
                   f"optimizer's state is laid out per experts class; this node alone: {choice.experts_why})")


def with_wgrad_fusion(choice: KernelChoice, argv: list[str], *, cpu: bool, torch_why: Any = None) -> KernelChoice:
    """The choice with gradient-accumulation fusion decided (runtime/model/wgrad_fusion.py): on under auto and liger
    where the launcher turned Megatron's off for want of apex and torch can compute it; Megatron's own under
    megatron and te. `torch_why()` says why torch cannot (None: it can); the job passes wgrad_fusion.supported."""
    from megalaunch.runtime.model import wgrad_fusion

    if wgrad_fusion.FLAG not in argv:
        return choice  # Megatron's own decision (TE's or apex's layers): nothing to add
    if choice.requested == "megatron" or choice.library == "te":
        why = "off: Megatron's own (its fusion needs apex)"
    elif cpu:
        why = "off: no GPU"
    elif {"--use-torch-fsdp2", "--use-megatron-fsdp"} & set(argv):
        why = "off: FSDP keeps no main_grad for it"
    elif flag_value(argv, "--num-experts"):
        why = "off: mixture-of-experts layers (their expert GEMMs are not measured with it)"
    else:
        blocked = (torch_why or wgrad_fusion.supported)()
        why = f"off: {blocked}" if blocked else "on: torch's fp32-output matmul into main_grad (no apex needed)"
    return replace(choice, wgrad_fusion=why)


def node_kernels(requested: str, argv: list[str], *, cpu: bool, flow: str | None, paths: RunPaths,
                 fits_with: dict[str, str] | None) -> KernelChoice:
    """This node's kernels for the job (`resolve_kernels`, the experts of the run's checkpoint kept, the layout's
    memory fit checked, the gradient-accumulation fusion decided): a ConfigFailure before Megatron starts for a
    library the recipe asks for and this node lacks, or one the layout fits the GPUs' memory only with."""
    choice = keep_experts(resolve_kernels(requested, argv, cpu=cpu, flow=flow), argv, paths)
    return with_wgrad_fusion(check_fit(choice, fits_with, str(paths.root)), argv, cpu=cpu)


def check_fit(choice: KernelChoice, fits_with: dict[str, str] | None, run_dir: str) -> KernelChoice:
    """The choice, unless the planner found that the run's layout fits the GPUs' memory only with a kernel this
    node runs without (`fits_with`: what, "a+b" for either, and the figures): under `kernels: auto` a node without
    liger-kernel would fall back to Megatron's loss (a torch without grouped_mm to SequentialMLP) and run out of
    memory at the first step, or hours later. A ConfigFailure instead, before Megatron starts: the chain stops
    after this segment (outcome config_error), with the fix."""
    for needs, figures in (fits_with or {}).items():
        whys = [why for need in needs.split("+") if (why := _without(choice, need)) is not None]
        if len(whys) < len(needs.split("+")):
            continue
        what = " or ".join(FIT_NEEDS.get(need, need) for need in needs.split("+"))
        cap = ".".join(map(str, GROUPED_MIN_CAPABILITY))
        install = ("install liger-kernel on the nodes (pip install 'megalaunch[train]')" if "liger_loss" in needs else
                   f"build the grouped experts (megalaunch[train]'s torch, with grouped_mm, on compute capability "
                   f"{cap}+ GPUs; {EXPERTS_ENV} and MEGALAUNCH_MOE_FUSED unset)")
        raise ConfigFailure(f"training.kernels: {choice.requested}: this run's layout fits the GPUs' memory only with "
                            f"{what} ({figures}), but this node runs without {'either' if len(whys) > 1 else 'it'} "
                            f"({'; '.join(whys)})",
                            f"{install}, or plan for Megatron's kernels: megalaunch resume {run_dir} "
                            "--set training.kernels=megatron --set parallel=auto")
    return choice


def _without(choice: KernelChoice, need: str) -> str | None:
    """Why this node's choice lacks what the layout's fit needs (None: it has it)."""
    if need == "liger_loss":
        return None if "linear_ce" in choice.liger_ops else choice.fallbacks.get("linear_ce") or choice.why
    if need == "grouped_experts":
        from megalaunch.runtime.model.experts.activation import fusion_on

        if choice.experts != "grouped":
            return choice.experts_why or "no grouped experts"
        return None if fusion_on() else "MEGALAUNCH_MOE_FUSED=off keeps Megatron's dispatch"
    return f"{need} is not a kernel this job knows"


def _bench_ops() -> tuple[frozenset[str], str]:
    """liger's ops under `kernels: liger`: all, or those MEGALAUNCH_LIGER_OPS names (bench/kernels.py measures
    the ops one set at a time with it; unknown names are refused, not ignored)."""
    named = os.environ.get("MEGALAUNCH_LIGER_OPS", "").strip()
    if not named:
        return frozenset(OPS), "set in the recipe"
    ops = frozenset(op.strip() for op in named.replace("+", ",").split(",") if op.strip())
    if ops - set(OPS):
        raise ConfigFailure(f"MEGALAUNCH_LIGER_OPS: {', '.join(sorted(ops - set(OPS)))} is not one of {', '.join(OPS)}",
                            "unset MEGALAUNCH_LIGER_OPS, or name ops from that list")
    return ops, f"set in the recipe, ops limited to {', '.join(sorted(ops))} by MEGALAUNCH_LIGER_OPS"


def _liger(requested: str, argv: list[str], wanted: frozenset[str], why: str, flow: bool = False) -> KernelChoice:
    unsupported = liger_unsupported(argv, flow)
    ops = frozenset(op for op in wanted if op not in unsupported)
    fallbacks = {op: unsupported.get(op, "Megatron's was measured as fast or faster") for op in OPS if op not in ops}
    if not ops:
        return KernelChoice(requested, "megatron", f"{why}, but none of its ops fits this model", fallbacks=fallbacks)
    return KernelChoice(requested, "liger", why, ops, fallbacks)
