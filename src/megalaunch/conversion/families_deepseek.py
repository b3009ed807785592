"""DeepSeek-V3 in the family mapping (families.py has the rest): Hugging Face config.json <-> the recipe's
multi-latent-attention fields (config/model/mla.py) and DeepSeek's MoE fields (config/model/moe.py), and the
same fields <-> the Megatron arguments a checkpoint stores.

Why a module of its own: DeepSeek names its shapes its own way (`qk_nope_head_dim` is Megatron's `qk_head_dim`,
`head_dim` in its config is the rope part), routes with sigmoid scores, an expert bias and groups, keeps its first
`first_k_dense_replace` layers dense, and ships checkpoints Megatron's layers cannot hold exactly (FP8 block
weights, DeepSeek-V2's softmax group routing, group scores other than the top-2 sum): each refused in one line
before a tensor is read. Plain dicts only: no torch, no transformers."""

from __future__ import annotations

import math
from typing import Any

from megalaunch.config.model.mla import MLA_YARN_FIXED
from megalaunch.conversion.errors import UnsupportedModelError

DEEPSEEK_ARCHITECTURES = {"DeepseekV3ForCausalLM": ("deepseek_v3", "deepseek_v3")}
# The recipe's MLA fields that make two models the same architecture.
MLA_ARCH_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                   "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim")
# Megatron-side MoE fields DeepSeek adds to MOE_ARCH_FIELDS.
DEEPSEEK_MOE_FIELDS = ("moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
                       "moe_router_topk_scaling_factor")
_REFUSED = ("deepseek_v2", "DeepseekV2ForCausalLM")


def _refuse(what: str, fix: str | None = None) -> UnsupportedModelError:
    return UnsupportedModelError(what, fix=fix)


def refuse_deepseek_v2(archs: list[Any], model_type: str) -> None:
    """DeepSeek-V2 routes with softmax scores and per-group maxima (`group_limited_greedy`), which Megatron's router
    does not compute; V3 converts."""
    if model_type in _REFUSED or any(a in _REFUSED for a in archs):
        raise _refuse(f"architecture {archs or model_type!r} (DeepSeek-V2: softmax scores with per-group maxima, "
                      "which Megatron's router does not compute) has no exact Megatron mapping",
                      fix="convert a DeepSeek-V3 model (DeepseekV3ForCausalLM)")


def _rope(cfg: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "rope"}
    if scaling.get("rope_type") != "yarn":
        raise _refuse(f"rope scaling {scaling.get('rope_type')!r}: DeepSeek-V3's MLA maps yarn only")
    differing = {k: scaling.get(k) for k, v in MLA_YARN_FIXED.items()
                 if scaling.get(k) is not None and not math.isclose(float(scaling[k]), v)}
    if differing:
        raise _refuse(f"yarn rope scaling {differing} differs from Megatron's fixed MLA values {MLA_YARN_FIXED}")
    return {"rope_type": "yarn", "rotary_scaling_factor": float(scaling.get("factor", 1.0)),
            "mscale": float(scaling.get("mscale", 1.0)), "mscale_all_dim": float(scaling.get("mscale_all_dim", 0.0))}


def deepseek_fields(cfg: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The recipe's MLA and MoE fields of a DeepSeek-V3 config.json; refuses what does not map exactly."""
    if cfg.get("quantization_config"):
        raise _refuse("quantization_config: FP8 block-quantised weights (weight_scale_inv) do not convert",
                      fix="dequantise the checkpoint to bf16 first (DeepSeek's fp8_cast_bf16.py)")
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias: true (biases on the MLA projections) has no mapping")
    if not cfg.get("rope_interleave", True):
        raise _refuse("rope_interleave: false: Megatron's MLA rotates DeepSeek's interleaved pairs only")
    experts, topk = int(cfg.get("n_routed_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    groups, group_k = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if experts < 2 or not 1 <= topk <= experts:
        raise _refuse(f"n_routed_experts {experts} / num_experts_per_tok {topk}: not a mixture of experts")
    if groups > 1 and topk // group_k != 2:
        raise _refuse(f"num_experts_per_tok {topk} / topk_group {group_k} != 2: transformers scores a group by its "
                      "top-2 experts, Megatron by its top (experts per token / groups per token)")
    if topk > 1 and not cfg.get("norm_topk_prob", True):
        raise _refuse("norm_topk_prob: false with sigmoid scores: Megatron always normalises the top-k weights")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if first_dense >= int(cfg["num_hidden_layers"]):
        raise _refuse(f"first_k_dense_replace {first_dense}: no MoE layer left")
    q_lora = cfg.get("q_lora_rank")
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    return dict(
        multi_latent_attention=True, q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]), qk_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]), **_rope(cfg, scaling),
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        moe_shared_expert_intermediate_size=shared or None, moe_first_dense_layers=first_dense,
        moe_router_score_function="sigmoid", moe_router_topk_normalize=True,
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
        moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_k if groups > 1 else None,
        moe_aux_loss_coeff=1e-4)


def mtp_layers(cfg: dict[str, Any]) -> int:
    """Multi-token-prediction modules stored after the last layer (DeepSeek-V3: 1, as `model.layers.61.*`)."""
    return int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)


def hf_deepseek_config(model: Any) -> dict[str, Any]:
    """config.json's DeepSeek-V3 keys for `model` (a ModelConfig); refuses a model DeepseekV3ForCausalLM cannot hold."""
    def require(ok: bool, what: str, fix: str) -> None:
        if not ok:
            raise UnsupportedModelError(f"{what} does not fit family 'deepseek_v3'", fix=fix)

    require(model.multi_latent_attention and model.qk_layernorm, "a model without MLA and its latent norms "
            "(multi_latent_attention, qk_layernorm)", "use another --family")
    require(bool(model.num_experts) and model.moe_router_score_function == "sigmoid"
            and model.moe_router_enable_expert_bias and model.moe_layer_freq == 1,
            "an attention or MoE layout other than DeepSeek-V3's (sigmoid router with expert bias, the first k layers "
            "dense, then all MoE)", "use the recipe's model as DeepSeek-V3 writes it")
    groups, group_k = model.moe_router_num_groups or 1, model.moe_router_group_topk or 1
    require(groups == 1 or model.moe_router_topk // group_k == 2, "group routing other than top-2 group scores",
            "moe_router_topk = 2 x moe_router_group_topk")
    shared = model.moe_shared_expert_intermediate_size or 0
    expert_ffn = model.moe_ffn_hidden_size or model.ffn_hidden_size
    require(shared % expert_ffn == 0, f"a shared expert of {shared} (not a multiple of the experts' {expert_ffn})",
            "moe_shared_expert_intermediate_size = n x moe_ffn_hidden_size")
    rope: dict[str, Any] = {"rope_theta": float(model.rotary_base), "rope_type": "default"}
    if model.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=model.rotary_scaling_factor, mscale=model.mscale,
                    mscale_all_dim=model.mscale_all_dim, **MLA_YARN_FIXED)
    return {"q_lora_rank": model.q_lora_rank, "kv_lora_rank": model.kv_lora_rank,
            "qk_nope_head_dim": model.qk_head_dim, "qk_rope_head_dim": model.qk_pos_emb_head_dim,
            "v_head_dim": model.v_head_dim, "head_dim": model.qk_pos_emb_head_dim, "rope_interleave": True,
            "rope_parameters": rope, "rope_scaling": rope if model.rope_type == "yarn" else None,
            "n_routed_experts": model.num_experts, "num_experts_per_tok": model.moe_router_topk,
            "moe_intermediate_size": expert_ffn, "n_shared_experts": shared // expert_ffn,
            "first_k_dense_replace": model.moe_first_dense_layers, "n_group": groups, "topk_group": group_k,
            "norm_topk_prob": model.moe_router_topk_normalize,
            "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0, "num_nextn_predict_layers": 0,
            "attention_bias": False, "num_key_value_heads": model.num_attention_heads}


def mla_from_megatron_args(get: Any) -> dict[str, Any]:
    """The recipe's MLA fields (and DeepSeek's router fields) from a checkpoint's Megatron arguments."""
    out: dict[str, Any] = {}
    if get("num_experts"):
        out.update(moe_router_enable_expert_bias=bool(get("moe_router_enable_expert_bias", False)),
                   moe_router_num_groups=get("moe_router_num_groups"), moe_router_group_topk=get("moe_router_group_topk"),
                   moe_router_topk_scaling_factor=get("moe_router_topk_scaling_factor"))
    if not get("multi_latent_attention", False):
        return out
    rope = get("rope_type") or "yarn"  # Megatron's MLA default
    out.update(multi_latent_attention=True, q_lora_rank=get("q_lora_rank"), kv_lora_rank=int(get("kv_lora_rank")),
               qk_head_dim=int(get("qk_head_dim")), qk_pos_emb_head_dim=int(get("qk_pos_emb_head_dim")),
               v_head_dim=int(get("v_head_dim")), rope_type=rope)
    if rope == "yarn":
        out.update(rotary_scaling_factor=float(get("rotary_scaling_factor", 1.0)), mscale=float(get("mscale", 1.0)),
                   mscale_all_dim=float(get("mscale_all_dim", 0.0)))
    return out


def megatron_mla_args(model: Any) -> dict[str, Any]:
    """The MLA (and DeepSeek router) part of the `args` hf-to-mcore stores (as the flags would set them)."""
    out: dict[str, Any] = {"multi_latent_attention": bool(model.multi_latent_attention)}
    if model.num_experts:
        out.update(moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
                   moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk,
                   moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor)
    if model.multi_latent_attention:
        out.update(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
                   qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
                   rope_type=model.rope_type, rotary_scaling_factor=model.rotary_scaling_factor, mscale=model.mscale,
                   mscale_all_dim=model.mscale_all_dim)
    return out
