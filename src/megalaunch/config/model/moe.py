"""Mixture-of-experts in the recipe: the fields users set (`MoEFields`, part of `model`), their rules
(`check_moe`, run by preflight through config/topology.py before anything is written) and their Megatron arguments (`moe_args`).

Field names follow Megatron's (`moe_router_topk` -> `--moe-router-topk`) except where megalaunch says a
thing the way users say it: `moe_first_dense_layers` (the first k layers dense, as DeepSeek-V3's
`first_k_dense_replace`) becomes Megatron's `--moe-layer-freq` list, `moe_router_topk_normalize`
becomes `--moe-router-pre-softmax` (softmax) and `moe_expert_capacity_factor: null` means dropless.

Standard library only: the CLI imports it on the login node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megalaunch.config.typed import doc
from megalaunch.errors import PreflightError

Recipe = Any  # config/schema.py's Recipe (which imports this module: no import back)

DEFAULT_AUX_LOSS_COEFF = 1e-3  # Qwen3-MoE's router_aux_loss_coef; Megatron's own default (0) balances nothing


@dataclass(frozen=True, kw_only=True)
class MoEFields:
    """The mixture-of-experts part of `model` (all unused while `num_experts` is null)."""

    num_experts: int | None = doc("MoE: routed experts per MoE layer (--num-experts); null for a dense model", None)
    moe_router_topk: int = doc("MoE: experts each token is routed to", 2)
    moe_ffn_hidden_size: int | None = doc("MoE: each routed expert's MLP width (default: ffn_hidden_size)", None)
    moe_shared_expert_intermediate_size: int | None = doc(
        "MoE: width of the shared expert(s) every token passes through (all shared experts together; null: none)",
        None)
    moe_shared_expert_gate: bool = doc("MoE: a sigmoid gate on the shared expert's output (Qwen2-MoE)", False)
    moe_layer_freq: int = doc("MoE: every N-th layer is an MoE layer (1: all of them, after the dense ones)", 1)
    moe_first_dense_layers: int = doc("MoE: the first k layers keep a dense MLP (DeepSeek-V3: 3)", 0)
    moe_router_score_function: Literal["softmax", "sigmoid"] = doc(
        "MoE: router scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)", "softmax")
    moe_router_topk_normalize: bool = doc(
        "MoE: the chosen experts' weights sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3); false: softmax over all "
        "experts, weights as they fall (Qwen2-MoE); sigmoid scores are always normalised for top-k > 1", True)
    moe_router_topk_scaling_factor: float | None = doc(
        "MoE: multiply the routing weights by this (DeepSeek-V3: 2.5)", None)
    moe_router_num_groups: int | None = doc("MoE: expert groups for group-limited routing (DeepSeek-V3: 8)", None)
    moe_router_group_topk: int | None = doc("MoE: groups each token may use (DeepSeek-V3: 4)", None)
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = doc(
        "MoE: balancing loss: aux_loss (per micro-batch, GShard), seq_aux_loss (per sequence, DeepSeek), "
        "global_aux_loss (over the global batch), none (e.g. with the expert bias alone)", "aux_loss")
    moe_aux_loss_coeff: float = doc(f"MoE: weight of the balancing loss (default {DEFAULT_AUX_LOSS_COEFF}; 0: off)",
                                    DEFAULT_AUX_LOSS_COEFF)
    moe_router_enable_expert_bias: bool = doc(
        "MoE: the aux-loss-free balancing of DeepSeek-V3: a per-expert bias on the routing scores, nudged "
        "towards balance after every step (needs sigmoid scores)", False)
    moe_router_bias_update_rate: float = doc("MoE: how fast the expert bias moves", 1e-3)
    moe_z_loss_coeff: float | None = doc("MoE: router z-loss weight (1e-3 is a common start; null: off)", None)
    moe_expert_capacity_factor: float | None = doc(
        "MoE: tokens an expert takes, as a multiple of its even share; null: dropless (every token processed)", None)
    moe_token_drop_policy: Literal["probs", "position"] = doc(
        "MoE, with a capacity factor: which tokens an over-full expert drops: the lowest-scoring or the last", "probs")
    moe_pad_expert_input_to_capacity: bool = doc(
        "MoE, with a capacity factor: pad every expert's input to its capacity (static shapes)", False)
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = doc(
        "MoE: how tokens reach their experts across expert-parallel ranks: alltoall (sends each token where it "
        "goes) or allgather (every rank sees every token)", "alltoall")


MOE_FIELDS = frozenset(f for f in MoEFields.__dataclass_fields__)
_MEGATRON_NAMED = MOE_FIELDS - {"moe_first_dense_layers", "moe_router_topk_normalize", "moe_layer_freq",
                                "moe_expert_capacity_factor"}


def _fail(field: str, message: str, valid: str, fix: str) -> None:
    raise PreflightError(message, field=f"model.{field}", valid=valid, fix=fix)


def is_moe(model: Any) -> bool:
    return bool(getattr(model, "num_experts", None))


def moe_layer_pattern(model: Any) -> list[int]:
    """1 for each MoE layer, 0 for each dense one: the first `moe_first_dense_layers` dense, then every
    `moe_layer_freq`-th of the rest an MoE layer (counting from the first after the dense ones)."""
    k, freq = model.moe_first_dense_layers, model.moe_layer_freq
    return [0 if i < k or (i - k) % freq else 1 for i in range(model.num_layers)]


def check_moe(recipe: Recipe) -> None:
    """Every MoE setting checked before submit: one PreflightError naming the field."""
    m, p = recipe.model, recipe.parallel
    if not is_moe(m):
        touched = [f for f in sorted(MOE_FIELDS - {"num_experts"})
                   if getattr(m, f) != MoEFields.__dataclass_fields__[f].default]
        if touched:
            _fail(touched[0], "is set but the model is dense (model.num_experts is null)",
                  "MoE settings only with num_experts", f"--set model.num_experts=8 (or remove model.{touched[0]})")
        return
    n, k = m.num_experts, m.moe_router_topk
    assert n is not None
    if n < 2:
        _fail("num_experts", f"is {n}", ">= 2 (null for a dense model)", "--set model.num_experts=8")
    if not 1 <= k <= n:
        _fail("moe_router_topk", f"{k} experts per token out of {n}", f"1..{n}", "--set model.moe_router_topk=2")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(m, name)
        if value is not None and value < 1:
            _fail(name, f"is {value}", ">= 1 (or null)", f"--set model.{name}=null")
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        _fail("moe_shared_expert_gate", "gates a shared expert the model does not have",
              "true only with moe_shared_expert_intermediate_size", "--set model.moe_shared_expert_gate=false")
    if m.moe_layer_freq < 1:
        _fail("moe_layer_freq", f"is {m.moe_layer_freq}", ">= 1", "--set model.moe_layer_freq=1")
    if not 0 <= m.moe_first_dense_layers < m.num_layers:
        _fail("moe_first_dense_layers", f"{m.moe_first_dense_layers} of {m.num_layers} layers",
              f"0..{m.num_layers - 1} (at least one MoE layer)", "--set model.moe_first_dense_layers=0")
    _check_router(m)
    _check_capacity(m)
    _check_expert_layout(recipe)
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        raise PreflightError(
            f"an MoE model at TP {p.tensor_model_parallel_size} needs sequence parallelism (Megatron's MoE layer "
            "refuses TP > 1 without it)", field="parallel.sequence_parallel", valid="true with MoE and TP > 1",
            fix="--set parallel.sequence_parallel=true")


def _check_router(m: Any) -> None:
    n, k = m.num_experts, m.moe_router_topk
    sigmoid = m.moe_router_score_function == "sigmoid"
    if sigmoid and not m.moe_router_topk_normalize and k > 1:
        _fail("moe_router_topk_normalize", "false with sigmoid scores: Megatron always normalises them for top-k > 1",
              "true with sigmoid scores", "--set model.moe_router_topk_normalize=true")
    if m.moe_router_enable_expert_bias and not sigmoid:
        _fail("moe_router_enable_expert_bias", "needs sigmoid router scores (the bias is added to them)",
              "true only with moe_router_score_function: sigmoid", "--set model.moe_router_score_function=sigmoid")
    if not m.moe_aux_loss_coeff >= 0:
        _fail("moe_aux_loss_coeff", f"is {m.moe_aux_loss_coeff}", ">= 0", f"--set model.moe_aux_loss_coeff={DEFAULT_AUX_LOSS_COEFF}")
    if m.moe_router_load_balancing_type == "none" and m.moe_aux_loss_coeff > 0:
        _fail("moe_aux_loss_coeff", f"{m.moe_aux_loss_coeff} with moe_router_load_balancing_type: none (no loss to weigh)",
              "0 with load balancing none", "--set model.moe_aux_loss_coeff=0")
    if m.moe_z_loss_coeff is not None and not m.moe_z_loss_coeff >= 0:
        _fail("moe_z_loss_coeff", f"is {m.moe_z_loss_coeff}", ">= 0 or null", "--set model.moe_z_loss_coeff=null")
    if m.moe_router_topk_scaling_factor is not None and not m.moe_router_topk_scaling_factor > 0:
        _fail("moe_router_topk_scaling_factor", f"is {m.moe_router_topk_scaling_factor}", "> 0 or null",
              "--set model.moe_router_topk_scaling_factor=null")
    if not m.moe_router_bias_update_rate >= 0:
        _fail("moe_router_bias_update_rate", f"is {m.moe_router_bias_update_rate}", ">= 0",
              "--set model.moe_router_bias_update_rate=1e-3")
    groups, group_k = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_k is None):
        _fail("moe_router_group_topk" if groups else "moe_router_num_groups",
              "group-limited routing needs both moe_router_num_groups and moe_router_group_topk",
              "both set or both null", "--set model.moe_router_num_groups=null --set model.moe_router_group_topk=null")
    if groups is not None:
        if groups < 1 or n % groups:
            _fail("moe_router_num_groups", f"{groups} groups do not divide {n} experts", f"a divisor of {n}",
                  "--set model.moe_router_num_groups=null")
        if not 1 <= group_k <= groups or group_k * (n // groups) < k:
            _fail("moe_router_group_topk", f"{group_k} of {groups} groups ({n // groups} experts each) cannot hold "
                  f"top-{k}", f"1..{groups}, with group_topk x experts per group >= {k}",
                  "--set model.moe_router_group_topk=" + str(min(groups, max(1, -(-k // (n // groups))))))


def _check_capacity(m: Any) -> None:
    cf = m.moe_expert_capacity_factor
    if cf is None:
        if m.moe_pad_expert_input_to_capacity:
            _fail("moe_pad_expert_input_to_capacity", "pads to a capacity that dropless routing does not have",
                  "true only with moe_expert_capacity_factor", "--set model.moe_expert_capacity_factor=1.25")
        if m.moe_token_drop_policy != "probs":
            _fail("moe_token_drop_policy", "chooses which tokens to drop, but dropless routing drops none",
                  "probs (the default) without a capacity factor", "--set model.moe_expert_capacity_factor=1.25")
        return
    if not cf > 0:
        _fail("moe_expert_capacity_factor", f"is {cf}", "> 0 (1.0: each expert takes its even share), or null for "
              "dropless", "--set model.moe_expert_capacity_factor=null")
    if m.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
        _fail("moe_router_load_balancing_type", f"{m.moe_router_load_balancing_type} with a capacity factor "
              "(Megatron drops tokens only with aux_loss, seq_aux_loss or none)",
              "aux_loss, seq_aux_loss or none", "--set model.moe_router_load_balancing_type=aux_loss")


def _check_expert_layout(recipe: Recipe) -> None:
    m, p = recipe.model, recipe.parallel
    ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
    etp = expert_tensor_parallel_size(recipe)
    if etp < 1 or ffn % etp:
        raise PreflightError(f"expert TP {etp} does not divide the experts' ffn size {ffn}",
                             field="parallel.expert_tensor_parallel_size", valid=f"a divisor of {ffn}",
                             fix="--set parallel.expert_tensor_parallel_size=1")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % p.tensor_model_parallel_size:
        _fail("moe_shared_expert_intermediate_size", f"{shared} is not divisible by TP {p.tensor_model_parallel_size}",
              f"a multiple of {p.tensor_model_parallel_size}", "choose another TP")
    world = recipe.cluster.world_size
    ep = p.expert_model_parallel_size
    mp = p.pipeline_model_parallel_size
    if world % (etp * ep * mp):
        raise PreflightError(f"world size {world} is not divisible by expert TP x EP x PP = {etp} x {ep} x {mp}",
                             field="parallel.expert_model_parallel_size",
                             valid="expert TP x EP x PP dividing nodes x tasks per node",
                             fix="choose another EP or parallel.expert_tensor_parallel_size")


def expert_tensor_parallel_size(recipe: Recipe) -> int:
    """Expert TP as Megatron resolves it: the recipe's, else the dense layers' TP."""
    p = recipe.parallel
    return p.expert_tensor_parallel_size or p.tensor_model_parallel_size


def moe_args(model: Any) -> list[str]:
    """Megatron's MoE flags for `model` (none for a dense one)."""
    if not is_moe(model):
        return []
    out = ["--num-experts", str(model.num_experts), "--moe-router-topk", str(model.moe_router_topk)]
    for name in sorted(_MEGATRON_NAMED - {"num_experts", "moe_router_topk"}):
        value = getattr(model, name)
        if value is None or value is False or (name == "moe_router_bias_update_rate"
                                               and not model.moe_router_enable_expert_bias):
            continue
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    if model.moe_first_dense_layers or model.moe_layer_freq != 1:
        out += ["--moe-layer-freq", "[" + ",".join(map(str, moe_layer_pattern(model))) + "]"]
    if model.moe_router_score_function == "softmax" and not model.moe_router_topk_normalize:
        out.append("--moe-router-pre-softmax")
    if model.moe_expert_capacity_factor is not None:
        out += ["--moe-expert-capacity-factor", str(model.moe_expert_capacity_factor)]
    out += ["--moe-router-dtype", "fp32"]  # routing decided in fp32: bf16 scores tie and flip experts
    return out
