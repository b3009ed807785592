"""Hugging Face configs <-> megalaunch ModelConfig for the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3 dense)
and its mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: their MoE fields in families_moe.py).

Only plain dicts (config.json) here: no transformers import, so this also runs where transformers is
absent and is cheap to test."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.errors import UnsupportedModelError
from megalaunch.conversion.families_deepseek import (
    DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_MOE_FIELDS,
    MLA_ARCH_FIELDS,
    deepseek_fields,
    hf_deepseek_config,
    refuse_deepseek_v2,
)
from megalaunch.conversion.families_moe import MOE_ARCH_FIELDS, MOE_ARCHITECTURES, hf_moe_config, moe_fields

# Hugging Face architecture -> (family, model_type).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    **MOE_ARCHITECTURES,
    **DEEPSEEK_ARCHITECTURES,
}
FAMILY_ARCHITECTURE = {family: arch for arch, (family, _) in ARCHITECTURES.items()}
# Megatron hard-codes Llama 3.1's rope scaling except the factor (--rope-scaling-factor: 8 for
# Llama 3.1, 32 for Llama 3.2), so only these values of the other three convert.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# The fields that make two models the same architecture (the rest are training choices).
ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "position_embedding_type", "rotary_base", "rotary_percent", "use_rope_scaling",
               "rope_scaling_factor", "normalization",
               "norm_epsilon", "swiglu", "disable_bias_linear", "add_qkv_bias",
               "untie_embeddings_and_output_weights", "kv_channels", "qk_layernorm", *MOE_ARCH_FIELDS,
               *DEEPSEEK_MOE_FIELDS, *MLA_ARCH_FIELDS)
# Families whose attention has an RMSNorm over head_dim on each head's queries and keys (Megatron's --qk-layernorm).
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# Families with biases on q, k and v (and nowhere else).
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")


@dataclass(frozen=True)
class HFModel:
    """What a Hugging Face config says, in megalaunch terms."""

    family: str
    architecture: str
    model: ModelConfig
    vocab_size: int
    dtype: str | None
    notes: tuple[str, ...] = ()


def _unsupported(what: str, fix: str | None = None) -> UnsupportedModelError:
    return UnsupportedModelError(what, valid=", ".join(sorted(ARCHITECTURES)), fix=fix)


def _named_valid(call: Any, *args: Any) -> Any:
    """families_moe's refusals, with the valid architectures named (that module cannot import this one)."""
    try:
        return call(*args)
    except UnsupportedModelError as e:
        raise _unsupported(e.message, e.fix) from None


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or transformers 4 `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind in (None, "default") else {**params, "rope_type": kind}
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if scaling:
        scaling = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type"))}
    return float(cfg.get("rope_theta", 10000.0)), scaling or None


def _check_mappable(cfg: dict[str, Any], family: str) -> None:
    """Refuse what has no exact Megatron counterpart (one line naming the config field)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported(f"hidden_act {cfg.get('hidden_act')!r}: only silu (SwiGLU) is mapped")
    if cfg.get("mlp_bias"):
        raise _unsupported("mlp_bias: true has no mapping (Megatron's biases are all-or-nothing)")
    if family not in QKV_BIAS_FAMILIES and cfg.get("attention_bias"):
        raise _unsupported("attention_bias: true (bias on o_proj too) has no mapping; add_qkv_bias covers QKV only")


def _kv_channels(cfg: dict[str, Any], family: str, hidden: int, heads: int) -> int | None:
    """model.kv_channels: the config's head_dim where it is not hidden / heads (Qwen3, Mistral Nemo), and always
    for Qwen3 (as its recipes write it); None where the head size follows from hidden / heads."""
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise _unsupported(f"hidden_size {hidden} is not a multiple of {heads} heads and the config has no head_dim")
        return None
    if family in QK_NORM_FAMILIES or int(head_dim) * heads != hidden:
        return int(head_dim)
    return None


def _architecture(cfg: dict[str, Any]) -> str:
    """The config's supported architecture (by `architectures`, else `model_type`), or the one-line refusal."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        by_type = {mt: a for a, (_, mt) in ARCHITECTURES.items()}
        arch = by_type.get(cfg.get("model_type", ""))
    if arch is None:
        _named_valid(refuse_deepseek_v2, archs, str(cfg.get("model_type", "")))
        moe = any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")) \
            or any("Moe" in str(a) or "Mixtral" in str(a) for a in archs)
        what = " (a mixture of experts the mapping does not know)" if moe else ""
        raise _unsupported(f"architecture {archs or cfg.get('model_type')!r}{what} has no Megatron mapping")
    return arch


def _rope(cfg: dict[str, Any]) -> tuple[float, bool, float]:
    """(rope theta, use Llama 3.1 rope scaling, its factor), refusing any other scaling."""
    theta, scaling = rope_settings(cfg)
    use_rope_scaling, factor = False, 8.0
    if scaling is not None:
        if scaling.get("rope_type") != "llama3":
            raise _unsupported(f"rope scaling {scaling.get('rope_type')!r}: only Llama 3.1's 'llama3' is mapped")
        differing = {k: scaling.get(k) for k, v in LLAMA3_ROPE.items() if not math.isclose(float(scaling.get(k, -1)), v)}
        if differing:
            raise _unsupported(f"llama3 rope scaling {differing} differs from Megatron's fixed {LLAMA3_ROPE}")
        use_rope_scaling, factor = True, float(scaling.get("factor", 8.0))
    if theta != int(theta):
        raise _unsupported(f"rope_theta {theta} is not an integer (model.rotary_base is)")
    return theta, use_rope_scaling, factor


def model_from_hf_config(cfg: dict[str, Any], *, make_vocab_size_divisible_by: int = 128) -> HFModel:
    """Read a Hugging Face config.json dict; refuse what Megatron's GPT cannot represent exactly."""
    arch = _architecture(cfg)
    family = ARCHITECTURES[arch][0]
    notes: list[str] = []

    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    _check_mappable(cfg, family)
    deepseek = family == "deepseek_v3"  # MLA: its config's head_dim is the rope part, not a head size
    kv_channels = None if deepseek else _kv_channels(cfg, family, hidden, heads)
    if cfg.get("use_sliding_window") or (family in ("mistral", "mixtral") and cfg.get("sliding_window")
                                         and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0)):
        notes.append(f"sliding_window {cfg.get('sliding_window')} is not in the recipe schema: logits agree only "
                     "for sequences up to the window")
    if deepseek:
        theta, use_rope_scaling, factor = rope_settings(cfg)[0], False, 8.0
        moe = _named_valid(deepseek_fields, cfg, rope_settings(cfg)[1])
    else:
        theta, use_rope_scaling, factor = _rope(cfg)
        moe = _named_valid(moe_fields, cfg, family)
    if cfg.get("router_jitter_noise"):
        notes.append(f"router_jitter_noise {cfg['router_jitter_noise']} (training-time noise on the router's inputs) "
                     "is not in the recipe schema: Megatron routes without it")

    max_pos = int(cfg.get("max_position_embeddings", 2048))
    model = ModelConfig(
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=None if deepseek else int(cfg.get("num_key_value_heads") or heads),
        kv_channels=kv_channels,
        qk_layernorm=family in QK_NORM_FAMILIES or deepseek,
        seq_length=min(max_pos, 4096),
        max_position_embeddings=max_pos,
        position_embedding_type="rope",
        rotary_base=int(theta),
        use_rope_scaling=use_rope_scaling,
        rope_scaling_factor=factor,
        normalization="RMSNorm",
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        disable_bias_linear=True,
        add_qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        **moe,
    )
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return HFModel(family, arch, model, int(cfg["vocab_size"]), dtype, tuple(notes))


def head_dim(model: ModelConfig) -> int:
    """The head size: model.kv_channels, else hidden / heads."""
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def _normalized(model: ModelConfig) -> ModelConfig:
    """Defaults spelled out. An MoE model (every layer MoE: the rest is refused) has no dense MLP, so its
    ffn_hidden_size weighs nothing and only the experts' width (moe_ffn_hidden_size, else ffn_hidden_size)
    counts; a dense model's MoE fields are unused and compare equal."""
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    out = replace(model, num_query_groups=model.num_query_groups or model.num_attention_heads,
                  ffn_hidden_size=ffn, kv_channels=None if model.multi_latent_attention else head_dim(model))
    if model.num_experts:
        every_layer = not model.moe_first_dense_layers and model.moe_layer_freq == 1
        return replace(out, ffn_hidden_size=0 if every_layer else ffn, moe_ffn_hidden_size=model.moe_ffn_hidden_size or ffn)
    defaults: dict[str, Any] = {f: ModelConfig.__dataclass_fields__[f].default
                                for f in (*MOE_ARCH_FIELDS, *DEEPSEEK_MOE_FIELDS)}
    return replace(out, **defaults)


def differences(recipe: ModelConfig, hf: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(field, recipe value, Hugging Face value) for every architecture field that differs."""
    a, b = _normalized(recipe), _normalized(hf)
    out = []
    for name in ARCH_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        same = math.isclose(x, y, rel_tol=1e-9) if isinstance(x, float) and isinstance(y, float) else x == y
        if not same:
            out.append((name, x, y))
    return out


def hf_config_from_model(model: ModelConfig, *, family: str, vocab_size: int, dtype: str) -> dict[str, Any]:
    """A config.json for `model` (when no Hugging Face config travels with the checkpoint)."""
    if family not in FAMILY_ARCHITECTURE:
        raise UnsupportedModelError(f"family {family!r}", valid=", ".join(sorted(FAMILY_ARCHITECTURE)))
    if model.normalization != "RMSNorm" or not model.swiglu or not model.disable_bias_linear \
            or model.position_embedding_type != "rope" or model.rotary_percent != 1.0:
        raise UnsupportedModelError("only RMSNorm + SwiGLU + RoPE models without linear biases map to "
                                    f"the {family} family")
    moe = hf_deepseek_config(model) if family == "deepseek_v3" else hf_moe_config(model, family)
    if model.multi_latent_attention and family != "deepseek_v3":
        raise UnsupportedModelError(f"multi-latent attention does not fit family {family!r}",
                                    fix="use --family deepseek_v3")
    if model.add_qkv_bias != (family == "qwen2") and family != "qwen2_moe":
        raise UnsupportedModelError(f"add_qkv_bias={model.add_qkv_bias} does not fit family {family!r}",
                                    fix="use --family qwen2 (qwen2_moe) for QKV biases, qwen3 (qwen3_moe) for "
                                        "QK-norm, llama, mistral or mixtral otherwise")
    if model.qk_layernorm != (family in QK_NORM_FAMILIES) and family != "deepseek_v3":
        raise UnsupportedModelError(f"qk_layernorm={model.qk_layernorm} does not fit family {family!r}",
                                    fix="use --family qwen3 (qwen3_moe) for QK-norm, llama, mistral, qwen2, mixtral "
                                        "or qwen2_moe otherwise")
    rope: dict[str, Any] = {"rope_theta": float(model.rotary_base), "rope_type": "default"}
    llama3 = {"factor": float(model.rope_scaling_factor), **LLAMA3_ROPE}
    if model.use_rope_scaling:
        rope = {**rope, "rope_type": "llama3", **llama3}
    arch = FAMILY_ARCHITECTURE[family]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch][1],
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups or model.num_attention_heads,
        "head_dim": head_dim(model),
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "rope_parameters": rope,
        "rope_theta": float(model.rotary_base),
        "rope_scaling": None if not model.use_rope_scaling else {"rope_type": "llama3", **llama3},
        "attention_dropout": 0.0,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if family in ("mistral", "mixtral"):
        cfg["sliding_window"] = None
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.num_layers)
    if family in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    return {**cfg, **moe}

