"""Multi-latent attention (MLA, DeepSeek-V2/V3) in the recipe: the fields users set (`MLAFields`, part of
`model`), their rules (`check_mla`, run by preflight through config/topology.py before anything is written) and
their Megatron arguments (`mla_args`).

Field names are Megatron's (`q_lora_rank` -> `--q-lora-rank`). MLA projects the hidden state down to a latent of
`kv_lora_rank` (keys and values) and `q_lora_rank` (queries; null: a full-rank query projection), normalises the
latents, and projects them up per head to a `qk_head_dim` part without position ("nope"), a
`qk_pos_emb_head_dim` part with the rotary embedding (one rope key shared by all heads) and a `v_head_dim` value.
Its rotary embedding is `rope_type`: rope (plain, `rotary_base`) or yarn (DeepSeek-V3's: `rotary_scaling_factor`,
`mscale`, `mscale_all_dim`). Megatron's MLA config takes YaRN's original context (4096) and its betas (32, 1) as
fixed (`core_transformer_config_from_args` passes no flag to them): DeepSeek-V3's values, so no field here.

Standard library only: the CLI imports it on the login node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megalaunch.config.typed import doc
from megalaunch.errors import PreflightError

# Megatron's fixed YaRN parameters for MLA (MLATransformerConfig's defaults; no command-line flag reaches them).
MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


@dataclass(frozen=True, kw_only=True)
class MLAFields:
    """The multi-latent-attention part of `model` (all unused while `multi_latent_attention` is false)."""

    multi_latent_attention: bool = doc(
        "MLA: DeepSeek-V2/V3's multi-latent attention instead of (grouped-query) attention (--multi-latent-attention)",
        False)
    q_lora_rank: int | None = doc("MLA: the queries' latent width (DeepSeek-V3: 1536); null: a full-rank query "
                                  "projection (DeepSeek-V2-Lite)", None)
    kv_lora_rank: int = doc("MLA: the keys' and values' shared latent width (DeepSeek-V3: 512)", 512)
    qk_head_dim: int = doc("MLA: each head's query/key part without position (DeepSeek-V3: 128)", 128)
    qk_pos_emb_head_dim: int = doc("MLA: each head's query/key part with the rotary embedding (DeepSeek-V3: 64)", 64)
    v_head_dim: int = doc("MLA: each head's value size (DeepSeek-V3: 128)", 128)
    rope_type: Literal["rope", "yarn"] = doc(
        "MLA: rotary embedding: rope (plain, rotary_base) or yarn (DeepSeek-V3: factor 40 over 4096 positions)",
        "rope")
    rotary_scaling_factor: float = doc("MLA, yarn: the context extension factor (DeepSeek-V3: 40)", 1.0)
    mscale: float = doc("MLA, yarn: the rotary embedding's magnitude scale (DeepSeek-V3: 1.0)", 1.0)
    mscale_all_dim: float = doc("MLA, yarn: the softmax scale's YaRN correction (DeepSeek-V3: 1.0; 0: none)", 0.0)


MLA_FIELDS = frozenset(f for f in MLAFields.__dataclass_fields__)
_YARN_ONLY = ("rotary_scaling_factor", "mscale", "mscale_all_dim")


def _fail(field: str, message: str, valid: str, fix: str) -> None:
    raise PreflightError(message, field=f"model.{field}", valid=valid, fix=fix)


def is_mla(model: Any) -> bool:
    return bool(getattr(model, "multi_latent_attention", False))


def check_mla(recipe: Any) -> None:
    """Every MLA setting checked before submit: one PreflightError naming the field."""
    m = recipe.model
    if not is_mla(m):
        touched = [f for f in sorted(MLA_FIELDS - {"multi_latent_attention"})
                   if getattr(m, f) != MLAFields.__dataclass_fields__[f].default]
        if touched:
            _fail(touched[0], "is set but the model's attention is not MLA (model.multi_latent_attention is false)",
                  "MLA settings only with multi_latent_attention: true",
                  f"--set model.multi_latent_attention=true (or remove model.{touched[0]})")
        return
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if getattr(m, name) < 1:
            _fail(name, f"is {getattr(m, name)}", ">= 1", f"--set model.{name}={MLAFields.__dataclass_fields__[name].default}")
    if m.q_lora_rank is not None and m.q_lora_rank < 1:
        _fail("q_lora_rank", f"is {m.q_lora_rank}", ">= 1, or null (full-rank queries)", "--set model.q_lora_rank=null")
    if m.qk_pos_emb_head_dim % 2:
        _fail("qk_pos_emb_head_dim", f"{m.qk_pos_emb_head_dim} is odd (the rotary embedding turns pairs)", "even",
              "--set model.qk_pos_emb_head_dim=64")
    if m.num_query_groups is not None and m.num_query_groups != m.num_attention_heads:
        _fail("num_query_groups", f"{m.num_query_groups} KV groups with MLA (every head has its own key and value "
              "from the shared latent; Megatron refuses grouped-query attention with MLA)", "null with MLA",
              "--set model.num_query_groups=null")
    if m.kv_channels is not None:
        _fail("kv_channels", "is set, but MLA's head sizes are qk_head_dim + qk_pos_emb_head_dim and v_head_dim",
              "null with MLA", "--set model.kv_channels=null")
    if m.position_embedding_type != "rope" or m.use_rope_scaling:
        field = "use_rope_scaling" if m.use_rope_scaling else "position_embedding_type"
        _fail(field, "MLA rotates its rope part itself (rope_type: rope or yarn); Llama 3.1's scaling and other "
              "position encodings do not apply", "position_embedding_type: rope, use_rope_scaling: false",
              "--set model.rope_type=yarn for a scaled context")
    if m.rope_type == "rope":
        touched = [f for f in _YARN_ONLY if getattr(m, f) != MLAFields.__dataclass_fields__[f].default]
        if touched:
            _fail(touched[0], "is a YaRN setting but model.rope_type is rope", "the default with rope_type: rope",
                  "--set model.rope_type=yarn")
    elif not m.rotary_scaling_factor >= 1:
        _fail("rotary_scaling_factor", f"is {m.rotary_scaling_factor}", ">= 1 (YaRN extends the context)",
              "--set model.rotary_scaling_factor=40")
    _check_layout(recipe)


def _check_layout(recipe: Any) -> None:
    t, p = recipe.training, recipe.parallel
    if t.attention == "local" and t.transformer_impl == "local":
        raise PreflightError("local cannot run multi-latent attention (Megatron's DotProductAttention takes no "
                             "separate key and value head sizes)", field="training.attention",
                             valid="auto or sdpa (torch SDPA, runtime/model/mla.py), te with transformer-engine",
                             fix="--set training.attention=auto")
    if p.context_parallel_size > 1 and t.transformer_impl == "local":
        raise PreflightError(f"CP {p.context_parallel_size} with multi-latent attention needs transformer-engine's "
                             "attention", field="parallel.context_parallel_size", valid="1 without transformer-engine",
                             fix="--set parallel.context_parallel_size=1")


def mla_args(model: Any) -> list[str]:
    """Megatron's MLA flags for `model` (none without MLA). The rope type is always given: Megatron's MLA
    default is yarn, its attention's default rope."""
    if not is_mla(model):
        return []
    out = ["--multi-latent-attention", "--kv-lora-rank", str(model.kv_lora_rank), "--qk-head-dim",
           str(model.qk_head_dim), "--qk-pos-emb-head-dim", str(model.qk_pos_emb_head_dim), "--v-head-dim",
           str(model.v_head_dim), "--rope-type", model.rope_type]
    if model.q_lora_rank is not None:
        out += ["--q-lora-rank", str(model.q_lora_rank)]
    if model.rope_type == "yarn":
        out += ["--rotary-scaling-factor", str(model.rotary_scaling_factor), "--mscale", str(model.mscale),
                "--mscale-all-dim", str(model.mscale_all_dim)]
    return out
