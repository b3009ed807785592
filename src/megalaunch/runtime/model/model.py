"""The GPT/Llama model for Megatron's loop: layer specs, the model provider, and a one-process
parallel state for building a model outside the loop (the builder from a recipe's ModelConfig, for
conversion and logits-parity tests, is `megalaunch.conversion.model`).

Attention implementations (`training.attention` in a recipe):
- `local`: Megatron's own DotProductAttention (no transformer-engine needed; slow, memory-hungry);
- `sdpa`:  `torch.nn.functional.scaled_dot_product_attention` (causal, GQA) as the core attention in
           Megatron's local layer spec: ~20-28 % more tokens/s than `local` on one GPU (docs/results.md);
- `flash`: flash-attn's `flash_attn_func` (causal, GQA) in the same place (what `auto` picks when
           flash-attn is importable and transformer-engine is not);
- `te`:    transformer-engine's spec (needs `transformer_impl: transformer_engine` and TE installed).

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from megalaunch.runtime.rank.dist_env import free_port

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

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
            sq, b, np_, hn = query.shape
            # [s, b, h, d] -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            # torch >= 2.5 shares each KV head among its query heads without copying (GQA).
            gqa = np_ != k.shape[1]
            dropout_p = self.dropout_p if self.training else 0.0
            rng: Any = contextlib.nullcontext()
            if dropout_p > 0.0 and not self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                rng = tensor_parallel.get_cuda_rng_tracker().fork()
            with rng, self.kernels():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                     scale=self.softmax_scale, enable_gqa=gqa)
            # [b, h, s, d] -> [s, b, h * d]
            return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    return SDPAttention


def layer_spec(config: TransformerConfig, *, attention: str = "local", transformer_impl: str = "local",
               normalization: str = "RMSNorm", qk_layernorm: bool = False,
               liger_ops: frozenset[str] = frozenset()) -> ModuleSpec:
    """The transformer-layer spec for this attention implementation, with liger-kernel's norm and SwiGLU
    where `liger_ops` names them (runtime/model/kernels.py; the rotary embedding and the loss are the model's)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r}; valid: {', '.join(ATTENTIONS)}")
    num_experts = getattr(config, "num_moe_experts", None)
    moe_grouped_gemm = bool(getattr(config, "moe_grouped_gemm", False))
    if transformer_impl == "transformer_engine" or attention == "te":
        if attention in ("sdpa", "flash"):
            raise ValueError(f"attention: {attention} goes with transformer_impl: local (TE brings its own attention)")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm, qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, normalization=normalization)
    if attention in ("sdpa", "flash"):
        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = \
            sdpa_attention_class() if attention == "sdpa" else flash_attention_class()
    if liger_ops & {"rmsnorm", "swiglu"}:
        from megalaunch.runtime.model import liger_layers

        spec = copy.deepcopy(spec)
        if "swiglu" in liger_ops:
            spec.submodules.mlp = liger_layers.with_liger_mlp(spec.submodules.mlp)
        if "rmsnorm" in liger_ops:  # it marks its weights for sequence parallelism itself
            return _with_norm(spec, liger_layers.norm_class())
    if getattr(config, "sequence_parallel", False):
        spec = _with_norm(copy.deepcopy(spec), sequence_parallel_norm_class())
    return spec


def _custom_norm(layer: ModuleSpec) -> type | None:
    """megalaunch's norm in this layer spec (the sequence-parallel torch norm, liger's), if any."""
    import sys

    candidates = [sequence_parallel_norm_class()]
    if "megalaunch.runtime.model.liger_layers" in sys.modules:  # only a spec built with liger's ops can hold it
        candidates.append(sys.modules["megalaunch.runtime.model.liger_layers"].norm_class())
    return next((c for c in candidates if spec_uses(layer, c)), None)


def decoder_spec(config: TransformerConfig, layer: ModuleSpec, vp_stage: int | None = None) -> Any:
    """What GPTModel takes as `transformer_layer_spec`: the layer spec itself, or, where the layers use
    megalaunch's norm (the sequence-parallel torch norm, liger's), the block's submodules with that norm as
    its final norm too (Megatron would pick its torch norm, which refuses sequence parallel)."""
    norm = _custom_norm(layer)
    if norm is None:
        return layer
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=norm)


_SP_NORM: list[type] = []


def sequence_parallel_norm_class() -> type:
    """Torch LayerNorm/RMSNorm for Megatron's local layers that works with sequence parallelism.

    Megatron's `WrappedTorchNorm` refuses sequence parallelism, and its local spec always uses it for
    RMSNorm (apex has none), so without transformer-engine a Llama with `sequence_parallel: true`
    could not be built. What sequence parallelism needs from a norm is what TE's and apex's norms do:
    mark the weights `sequence_parallel`, so that Megatron all-reduces their gradients over the
    tensor-parallel group (each rank saw only its slice of the sequence; finalize_model_grads.py).
    The forward is the same torch module either way."""
    if _SP_NORM:
        return _SP_NORM[0]
    import torch

    class SequenceParallelTorchNorm:
        def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                    zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> Any:
            if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
                raise ValueError("zero-centred gamma, persist_layer_norm and memory_efficient_layer_norm need "
                                 "transformer-engine or apex; the torch norm has none of them")
            if config.normalization == "LayerNorm":
                norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
            elif config.normalization == "RMSNorm":
                norm = torch.nn.RMSNorm(hidden_size, eps=eps)
            else:
                raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm")
            for param in norm.parameters():
                param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
            return norm

    _SP_NORM.append(SequenceParallelTorchNorm)
    return SequenceParallelTorchNorm


def _torch_norm() -> type:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def _with_norm(spec: Any, norm: type) -> Any:
    """The spec with Megatron's torch norm replaced by `norm` wherever it appears (layer norms, the
    q/k norms), in place on a copy the caller made."""
    import dataclasses
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    old = _torch_norm()

    def swap(obj: Any) -> Any:
        if obj is old:
            return norm
        if isinstance(obj, ModuleSpec):
            obj.module, obj.submodules = swap(obj.module), swap(obj.submodules)
            return obj
        if isinstance(obj, functools.partial):
            return functools.partial(swap(obj.func), *map(swap, obj.args),
                                     **{k: swap(v) for k, v in obj.keywords.items()})
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                object.__setattr__(obj, f.name, swap(getattr(obj, f.name)))
            return obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(swap(x) for x in obj)
        return obj

    return swap(spec)


def spec_uses(spec: Any, module: type) -> bool:
    """Whether `module` appears anywhere in a layer or block spec (submodules, lists of layer specs)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is module:
        return True
    if isinstance(spec, ModuleSpec):
        return spec_uses(spec.module, module) or spec_uses(spec.submodules, module)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return any(spec_uses(getattr(spec, f.name), module) for f in dataclasses.fields(spec))
    if isinstance(spec, (list, tuple)):
        return any(spec_uses(x, module) for x in spec)
    return False


@contextlib.contextmanager
def megatron_parallel_state(seed: int = 1234) -> Iterator[None]:
    """One-process Megatron parallel state (TP=PP=1) for building and running a model outside the
    training loop, e.g. logits-parity tests. Uses gloo and the CPU when no GPU is present (turning
    on `cpu_compat` for the process), NCCL otherwise. Tears everything down on exit."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu = not torch.cuda.is_available()
    if cpu:
        from megalaunch.runtime.model import cpu_compat

        cpu_compat.enable()
    created = False
    if not dist.is_initialized():
        # an explicit address, not MASTER_ADDR/MASTER_PORT: setting those would leak into every
        # process this one starts later, pointing them at a port that may be taken by then
        dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


# --- inside Megatron's loop -------------------------------------------------------------------

def model_provider(attention: str, liger_ops: frozenset[str] = frozenset()) -> Any:
    """Megatron's `model_provider(pre_process, post_process, vp_stage, config, pg_collection)` for
    a GPT built from the parsed Megatron arguments, with the given attention implementation and the
    ops liger-kernel computes (runtime/model/kernels.py)."""

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                config: Any = None, pg_collection: Any = None) -> GPTModel:
        from megatron.training import get_args
        from megatron.training.argument_utils import core_transformer_config_from_args

        args = get_args()
        cfg = config if config is not None else core_transformer_config_from_args(args)
        spec = layer_spec(cfg, attention=attention, transformer_impl=args.transformer_impl,
                          normalization=args.normalization, qk_layernorm=args.qk_layernorm, liger_ops=liger_ops)
        return gpt_class(cfg, liger_ops)(
            config=cfg,
            transformer_layer_spec=decoder_spec(cfg, spec, vp_stage),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            rope_scaling=args.use_rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )

    return provide


def gpt_class(config: Any, liger_ops: frozenset[str]) -> type:
    """GPTModel, or liger's loss model (runtime/model/liger_layers.py); with liger's rotary embedding, the config
    asks for Megatron's single-QKV rotary seam, which liger then fills."""
    from megatron.core.models.gpt import GPTModel

    if liger_ops & {"rope", "linear_ce"}:
        from megalaunch.runtime.model import liger_layers

        if "rope" in liger_ops:
            liger_layers.install_rope()
            config.fused_single_qkv_rope = True
        if "linear_ce" in liger_ops:
            return liger_layers.gpt_model_class()
    return GPTModel
