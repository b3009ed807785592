"""The mixture-of-experts half of the family mapping (families.py has the rest): Hugging Face config.json <->
the recipe's MoE fields (config/model/moe.py) for Mixtral, Qwen2-MoE and Qwen3-MoE, and the same fields <->
the Megatron arguments a checkpoint stores.

Why a module of its own: the three families name one thing three ways (`num_local_experts` / `num_experts`,
`intermediate_size` as Mixtral's expert width but Qwen's dense width, `norm_topk_prob` absent for Mixtral),
and a model that only partly maps (dense layers between the MoE ones) must be refused
before a tensor is read. Plain dicts only: no torch, no transformers. Its refusals name no valid architectures:
families.py, which knows them all, adds them."""

from __future__ import annotations

from typing import Any

from megalaunch.conversion.errors import UnsupportedModelError

# family -> (Hugging Face architecture, model_type)
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": ("mixtral", "mixtral"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "qwen2_moe"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3_moe"),
}
MOE_FAMILIES = tuple(f for f, _ in MOE_ARCHITECTURES.values())
# The recipe's MoE fields that make two models the same architecture (the aux-loss weight is a training choice).
MOE_ARCH_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                   "moe_shared_expert_gate", "moe_router_topk_normalize", "moe_router_score_function",
                   "moe_first_dense_layers", "moe_layer_freq")
# config.json's key for each MoE field (named in errors).
MOE_HF_KEYS = {"num_experts": "num_local_experts / num_experts", "moe_router_topk": "num_experts_per_tok",
               "moe_ffn_hidden_size": "moe_intermediate_size (Mixtral: intermediate_size)",
               "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
               "moe_shared_expert_gate": "architectures", "moe_router_topk_normalize": "norm_topk_prob",
               "moe_router_score_function": "architectures", "moe_first_dense_layers": "mlp_only_layers",
               "moe_layer_freq": "decoder_sparse_step", "moe_aux_loss_coeff": "router_aux_loss_coef"}
def _refuse(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(what)


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts: `num_local_experts` (Mixtral; Qwen3-MoE as transformers 5 saves it) or `num_experts`."""
    value = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not value or int(value) < 2:
        raise _refuse(f"num_local_experts/num_experts {value!r}: a mixture of experts needs >= 2 experts")
    return int(value)


def _check_every_layer_moe(cfg: dict[str, Any], layers: int) -> None:
    """Qwen's `mlp_only_layers` and `decoder_sparse_step` make some layers dense. megalaunch trains such models
    (runtime/model/model.py moe_pattern), but Megatron then saves every layer under its own keys (not the stacked
    layer axis this mapping writes) and the dense layers' MLPs are not mapped: refused, not half-converted."""
    dense = sorted(set(int(i) for i in cfg.get("mlp_only_layers") or []) & set(range(layers)))
    step = int(cfg.get("decoder_sparse_step") or 1)
    if dense or step != 1:
        what = f"mlp_only_layers {dense}" if dense else f"decoder_sparse_step {step}"
        raise _refuse(f"{what}: dense layers between the MoE layers are not converted yet (megalaunch trains "
                      "them, but their per-layer checkpoint keys are not mapped)")


def moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The recipe's MoE fields from config.json (empty for a dense family). Refuses what does not map exactly."""
    if family not in MOE_FAMILIES:
        return {}
    _check_every_layer_moe(cfg, int(cfg["num_hidden_layers"]))
    experts = num_experts(cfg)
    topk = int(cfg.get("num_experts_per_tok") or 2)
    if not 1 <= topk <= experts:
        raise _refuse(f"num_experts_per_tok {topk} of {experts} experts")
    fields: dict[str, Any] = dict(num_experts=experts, moe_router_topk=topk, moe_router_score_function="softmax",
                                  moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001) or 0.0))
    if family == "mixtral":  # intermediate_size is each expert's width; the top-k weights always renormalised
        fields.update(moe_ffn_hidden_size=None, moe_router_topk_normalize=True)
        return fields
    if not cfg.get("moe_intermediate_size"):
        raise _refuse(f"{family} config without moe_intermediate_size (each expert's width)")
    fields.update(moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                  moe_router_topk_normalize=bool(cfg.get("norm_topk_prob", False)))
    if family == "qwen2_moe":
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if shared < 1:
            raise _refuse(f"shared_expert_intermediate_size {shared}: Qwen2-MoE's layer always has its shared expert")
        fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return fields


def _require(ok: bool, what: str, family: str, fix: str) -> None:
    if not ok:
        raise UnsupportedModelError(f"{what} does not fit family {family!r}", fix=fix)


def hf_moe_config(model: Any, family: str) -> dict[str, Any]:
    """config.json's MoE keys for `model` (a ModelConfig) in `family`; refuses a model the family cannot hold."""
    if family not in MOE_FAMILIES:
        if model.num_experts:
            raise UnsupportedModelError(f"a mixture of experts ({model.num_experts} experts) does not fit family "
                                        f"{family!r}", fix="use --family mixtral, qwen2_moe or qwen3_moe")
        return {}
    _require(bool(model.num_experts), "a dense model (model.num_experts is null)", family,
             "use --family llama, mistral, qwen2 or qwen3")
    _require(model.moe_first_dense_layers == 0 and model.moe_layer_freq == 1,
             "dense layers between MoE layers (moe_first_dense_layers / moe_layer_freq)", family,
             "only models with every layer MoE convert")
    _require(model.moe_router_score_function == "softmax" and not model.moe_router_topk_scaling_factor
             and not model.moe_router_enable_expert_bias and not model.moe_router_num_groups,
             "sigmoid, scaled, biased or group-limited routing", family, "only softmax top-k routers convert")
    shared = model.moe_shared_expert_intermediate_size
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    expert_ffn = model.moe_ffn_hidden_size or ffn
    common = {"num_experts_per_tok": model.moe_router_topk, "router_aux_loss_coef": model.moe_aux_loss_coeff,
              "output_router_logits": False}
    if family == "mixtral":
        _require(not shared, "a shared expert", family, "use --family qwen2_moe")
        _require(model.moe_router_topk_normalize, "moe_router_topk_normalize: false", family, "use --family qwen2_moe")
        return {**common, "num_local_experts": model.num_experts, "intermediate_size": expert_ffn,
                "router_jitter_noise": 0.0}
    qwen = {**common, "num_experts": model.num_experts, "moe_intermediate_size": expert_ffn, "intermediate_size": ffn,
            "norm_topk_prob": model.moe_router_topk_normalize, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if family == "qwen2_moe":
        _require(bool(shared) and model.moe_shared_expert_gate, "an MoE layer without a gated shared expert", family,
                 "use --family mixtral or qwen3_moe")
        return {**qwen, "shared_expert_intermediate_size": shared, "qkv_bias": model.add_qkv_bias}
    _require(not shared, "a shared expert", family, "use --family qwen2_moe")
    return qwen


def moe_from_megatron_args(get: Any) -> dict[str, Any]:
    """The recipe's MoE fields from a checkpoint's Megatron arguments (`get(name, default)`)."""
    experts = get("num_experts")
    if not experts:
        return {}
    freq = get("moe_layer_freq", 1)
    pattern = freq if isinstance(freq, list) else [1 if i % int(freq) == 0 else 0 for i in range(get("num_layers"))]
    first_dense = pattern.index(1) if 1 in pattern else 0
    coeff = get("moe_aux_loss_coeff", 0.0)
    return dict(num_experts=int(experts), moe_router_topk=int(get("moe_router_topk", 2)),
                moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
                moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
                moe_shared_expert_gate=bool(get("moe_shared_expert_gate", False)),
                moe_router_score_function=get("moe_router_score_function", "softmax") or "softmax",
                moe_router_topk_normalize=not get("moe_router_pre_softmax", False),
                moe_first_dense_layers=first_dense, moe_layer_freq=_period(pattern[first_dense:]),
                moe_aux_loss_coeff=float(coeff[0] if isinstance(coeff, list) else coeff or 0.0))


def _period(pattern: list[int]) -> int:
    """Megatron's layer pattern after the first dense layers as megalaunch's moe_layer_freq (the distance
    between the first two MoE layers; 1 where every layer is MoE)."""
    ones = [i for i, v in enumerate(pattern) if v]
    return ones[1] - ones[0] if len(ones) > 1 else 1


def megatron_moe_args(model: Any) -> dict[str, Any]:
    """The MoE part of the `args` hf-to-mcore stores (as `--num-experts ...` would set them)."""
    if not model.num_experts:
        return {"num_experts": None}
    return dict(num_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
                moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
                moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=model.moe_shared_expert_gate,
                moe_router_score_function=model.moe_router_score_function,
                moe_router_pre_softmax=not model.moe_router_topk_normalize, moe_layer_freq=1,
                moe_aux_loss_coeff=model.moe_aux_loss_coeff, expert_model_parallel_size=1)
