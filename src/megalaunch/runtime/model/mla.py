"""Multi-latent attention (MLA, DeepSeek-V2/V3) on Megatron's local layer spec, without transformer-engine.

Megatron-core 0.19 declares MLA for its local spec (`get_gpt_layer_local_spec(multi_latent_attention=True)`),
but `MLASelfAttention` builds its core attention with `k_channels` (the query/key head size, nope + rope:
192 for DeepSeek-V3) and `v_channels` (the value head size, 128), which the local `DotProductAttention` does
not take: without TE the model does not build. torch's `scaled_dot_product_attention` takes a value head size
other than the query/key one, so the SDPA core attention (runtime/model/attention.py) with those two
arguments accepted is MLA's core attention; everything else (the low-rank projections, their norms, the
rotary embedding of the rope part, interleaved as DeepSeek lays it out) is Megatron's own MLASelfAttention.

Heavy imports happen inside functions: importing this module is cheap."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from megalaunch.runtime.model.attention import sdpa_attention_class

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.transformer.spec_utils import ModuleSpec

_MLA_CLASS: type | None = None

LOCAL_REFUSAL = ("attention: local cannot run multi-latent attention (Megatron's DotProductAttention takes no "
                 "separate key and value head sizes); use training.attention: sdpa or auto")


def is_mla(config: Any) -> bool:
    return bool(getattr(config, "multi_latent_attention", False))


def mla_core_attention_class() -> type:
    """The SDPA core attention with MLA's separate key (`k_channels`) and value (`v_channels`) head sizes."""
    global _MLA_CLASS
    if _MLA_CLASS is None:
        base: Any = sdpa_attention_class()

        class MLASDPAttention(base):  # type: ignore[misc,valid-type]
            """Megatron's core-attention interface for MLA: [s, b, heads, nope + rope] queries and keys,
            [s, b, heads, v] values, [s, b, heads * v] out. The softmax scale is MLASelfAttention's (YaRN's
            mscale included)."""

            def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                         attention_dropout: float | None = None, softmax_scale: float | None = None,
                         k_channels: int | None = None, v_channels: int | None = None,
                         cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
                super().__init__(config, layer_number, attn_mask_type, attention_type,
                                 attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                                 cp_comm_type=cp_comm_type, pg_collection=pg_collection)
                self.k_channels, self.v_channels = k_channels, v_channels

        _MLA_CLASS = MLASDPAttention
    return _MLA_CLASS


def mla_layer_spec(num_experts: int | None, moe_grouped_gemm: bool, qk_layernorm: bool, normalization: str,
                   attention: str) -> ModuleSpec:
    """Megatron's local MLA layer spec with the SDPA core attention. `flash` takes it too: flash-attn 2 takes one
    head size for queries, keys and values, while torch's SDPA picks its own flash / cuDNN / memory-efficient
    kernel for MLA's shapes. `local` is refused (LOCAL_REFUSAL)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if attention == "local":
        raise ValueError(LOCAL_REFUSAL)
    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm,
                                                  multi_latent_attention=True, normalization=normalization))
    spec.submodules.self_attention.submodules.core_attention = mla_core_attention_class()
    return spec
