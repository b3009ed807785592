"""The attention implementations a recipe chooses from (`training.attention`):
- `local`: Megatron's own DotProductAttention (no transformer-engine needed; slow, memory-hungry);
- `sdpa`:  `torch.nn.functional.scaled_dot_product_attention` (causal, GQA) as the core attention in
           Megatron's local layer spec: ~20-28 % more tokens/s than `local` on one GPU (docs/results.md);
- `flash`: flash-attn's `flash_attn_func` (causal, GQA) in the same place (what `auto` picks when
           flash-attn is importable and transformer-engine is not);
- `te`:    transformer-engine's spec (needs `transformer_impl: transformer_engine` and TE installed).

This module owns the `sdpa` and `flash` modules and the order of torch's SDPA backends
(MEGALAUNCH_SDPA_BACKENDS); `model.layer_spec` puts them in the spec. Multi-latent attention (MLA) takes the
`sdpa` module with separate key and value head sizes (runtime/model/mla.py).

Heavy imports (torch, megatron, flash-attn) happen inside functions: importing this module is cheap."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

ATTENTIONS = ("local", "sdpa", "flash", "te")


def sdpa_attention_class() -> type:
    """The SDPA core-attention module (built lazily: it subclasses a Megatron class)."""
    global _SDPA_CLASS
    if _SDPA_CLASS is None:
        _SDPA_CLASS = _make_sdpa_class()
    return _SDPA_CLASS


_SDPA_CLASS: type | None = None
_FLASH_CLASS: type | None = None


def flash_attention_class() -> type:
    """The flash-attn core-attention module: the SDPA module with flash-attn's kernel."""
    global _FLASH_CLASS
    if _FLASH_CLASS is None:
        base: Any = sdpa_attention_class()

        class FlashAttention(base):  # type: ignore[misc,valid-type]
            def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                        attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
                from flash_attn import flash_attn_func

                if packed_seq_params is not None or attention_bias is not None:
                    raise ValueError("attention: flash supports neither packed sequences nor an attention bias")
                sq, b, np_, hn = query.shape
                q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [b, s, heads, d]; GQA is native
                out = flash_attn_func(q, k, v, dropout_p=self.dropout_p if self.training else 0.0,
                                      softmax_scale=self.softmax_scale, causal=True)
                return out.transpose(0, 1).reshape(sq, b, np_ * hn)

        _FLASH_CLASS = FlashAttention
    return _FLASH_CLASS


SDPA_BACKENDS_ENV = "MEGALAUNCH_SDPA_BACKENDS"


def sdpa_kernel_context() -> Any:
    """A context that orders torch's SDPA backends as MEGALAUNCH_SDPA_BACKENDS says (comma-separated
    `torch.nn.attention.SDPBackend` names, e.g. `flash_attention,cudnn_attention`; torch skips a backend
    that cannot take the inputs), or none when it is unset: torch's own order, which on an H200 (torch
    2.11) already runs cuDNN's attention for llama3-8b's shapes, the fastest there (bench/sdpa_backends.py,
    docs/results.md). A way round a backend that misbehaves, without a code change."""
    names = [n.strip().upper() for n in os.environ.get(SDPA_BACKENDS_ENV, "").split(",") if n.strip()]
    if not names:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        backends = [getattr(SDPBackend, n) for n in names]
    except AttributeError as e:
        valid = ", ".join(n.lower() for n in SDPBackend.__members__ if n != "ERROR")
        raise ValueError(f"{SDPA_BACKENDS_ENV}={os.environ[SDPA_BACKENDS_ENV]!r}: valid names are {valid}") from e
    return lambda: sdpa_kernel(backends, set_priority=True)


def _make_sdpa_class() -> type:
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """Megatron's DotProductAttention interface, computed by torch's fused SDPA kernels.

        Inputs are [s, b, heads, head_dim] (key/value with the KV-group count); the output is
        [s, b, heads * head_dim] like Megatron's. Causal masking is implicit; an explicit
        attention mask, packed sequences, attention bias and sliding windows are refused, as is
        a non-vanilla softmax (Megatron's learnable offsets)."""

        def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, *args: Any, **kwargs: Any):
            super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
            if config.softmax_type != "vanilla":
                raise ValueError("attention: sdpa supports only the vanilla softmax")
            if config.window_size is not None:
                raise ValueError("attention: sdpa does not support sliding-window attention")
            if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
                raise ValueError(f"attention: sdpa supports causal attention only, got {attn_mask_type}")
            self.dropout_p = config.attention_dropout if kwargs.get("attention_dropout") is None \
                else kwargs["attention_dropout"]
            self.kernels = sdpa_kernel_context()

        def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                    attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
            if packed_seq_params is not None:
                raise ValueError("attention: sdpa does not support packed sequences")
            if attention_bias is not None:
                raise ValueError("attention: sdpa does not support an attention bias")
            sq, b = query.shape[0], query.shape[1]
            # [s, b, h, d] -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            # torch >= 2.5 shares each KV head among its query heads without copying (GQA).
            gqa = q.shape[1] != k.shape[1]
            dropout_p = self.dropout_p if self.training else 0.0
            rng: Any = contextlib.nullcontext()
            if dropout_p > 0.0 and not self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                rng = tensor_parallel.get_cuda_rng_tracker().fork()
            with rng, self.kernels():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
            # [b, h, s, d_v] -> [s, b, h * d_v] (d_v: the value head size, MLA's differs from the query's)
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    return SDPAttention
