"""The GPT/Llama model for Megatron's loop: the transformer-layer spec for a recipe's attention
(runtime/model/attention.py) and kernels, the block spec with megalaunch's norm (runtime/model/norms.py),
the model class and the model provider. The builder from a recipe's ModelConfig, for conversion and
logits-parity tests, is `megalaunch.conversion.model`; the parallel state it needs outside the loop is
runtime/model/standalone.py.

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megalaunch.runtime.model.attention import ATTENTIONS, flash_attention_class, sdpa_attention_class
from megalaunch.runtime.model.mla import is_mla, mla_layer_spec
from megalaunch.runtime.model.norms import custom_norm, sequence_parallel_norm_class, with_norm

if TYPE_CHECKING:  # pragma: no cover
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megalaunch.runtime.model.fp8 import Fp8Choice


def layer_spec(config: TransformerConfig, *, attention: str = "local", transformer_impl: str = "local",
               normalization: str = "RMSNorm", qk_layernorm: bool = False,
               liger_ops: frozenset[str] = frozenset(), experts: str = "sequential", dense: bool = False) -> ModuleSpec:
    """The transformer-layer spec for this attention implementation, with liger-kernel's norm and SwiGLU
    where `liger_ops` names them (runtime/model/kernels.py; the rotary embedding and the loss are the model's)
    and, in mixture-of-experts layers (all but `dense`: the same layer with a dense MLP), `experts`: Megatron's SequentialMLP ("sequential") or megalaunch's
    grouped-GEMM experts ("grouped", runtime/model/experts/; the shared experts stay Megatron's)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r}; valid: {', '.join(ATTENTIONS)}")
    num_experts = None if dense else getattr(config, "num_moe_experts", None)
    moe_grouped_gemm = bool(getattr(config, "moe_grouped_gemm", False))
    if transformer_impl == "transformer_engine" or attention == "te":
        if attention in ("sdpa", "flash"):
            raise ValueError(f"attention: {attention} goes with transformer_impl: local (TE brings its own attention)")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm, qk_layernorm,
                                                          multi_latent_attention=is_mla(config))
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if is_mla(config):  # multi-latent attention: torch SDPA with MLA's key and value head sizes (runtime/model/mla.py)
        spec = mla_layer_spec(num_experts, moe_grouped_gemm, qk_layernorm, normalization, attention)
    else:
        spec = get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, normalization=normalization)
    if attention in ("sdpa", "flash") and not is_mla(config):
        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = \
            sdpa_attention_class() if attention == "sdpa" else flash_attention_class()
    if experts not in ("grouped", "sequential", "te", ""):
        raise ValueError(f"experts {experts!r}; valid: grouped, sequential")
    if num_experts and experts == "grouped":
        from megalaunch.runtime.model.experts import activation, permute
        from megalaunch.runtime.model.experts.grouped import with_grouped_experts

        if activation.fusion_on():
            permute.install()  # dropless permutations by gathers, no atomics (runtime/model/experts/permute.py)
        spec = copy.deepcopy(spec)
        spec.submodules.mlp = with_grouped_experts(spec.submodules.mlp)
    if liger_ops & {"rmsnorm", "swiglu"}:
        from megalaunch.runtime.model import liger_layers

        spec = copy.deepcopy(spec)
        if "swiglu" in liger_ops:
            spec.submodules.mlp = liger_layers.with_liger_mlp(spec.submodules.mlp)
        if "rmsnorm" in liger_ops:  # it marks its weights for sequence parallelism itself
            return with_norm(spec, liger_layers.norm_class())
    if getattr(config, "sequence_parallel", False):
        spec = with_norm(copy.deepcopy(spec), sequence_parallel_norm_class())
    return spec


def moe_pattern(config: TransformerConfig) -> list[int] | None:
    """Which layers are mixture-of-experts (1) and which dense (0), as Megatron reads `moe_layer_freq` (an
    int N: every N-th layer from the first; a list: per layer, e.g. the first k dense); None when every layer
    is the same kind."""
    if not getattr(config, "num_moe_experts", None):
        return None
    freq = getattr(config, "moe_layer_freq", 1)
    n = int(config.num_layers)
    pattern = [1 if i % freq == 0 else 0 for i in range(n)] if isinstance(freq, int) else [int(x) for x in freq]
    return None if all(pattern) else pattern


def decoder_spec(config: TransformerConfig, layer: ModuleSpec, vp_stage: int | None = None,
                 dense: ModuleSpec | None = None) -> Any:
    """What GPTModel takes as `transformer_layer_spec`: the layer spec itself, or the block's submodules where
    the layers differ or use megalaunch's norm: `dense` (the same layer with a dense MLP) for the layers
    `moe_pattern` calls dense (Megatron's own block spec does this for its specs only: given one layer spec,
    every layer was built as an MoE layer), and megalaunch's norm (the sequence-parallel torch norm, liger's)
    as the final norm too (Megatron would pick its torch norm, which refuses sequence parallel)."""
    norm = custom_norm(layer)
    pattern = moe_pattern(config) if dense is not None else None
    if norm is None and pattern is None:
        return layer
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    if pattern is None:
        specs = [layer] * count
    else:
        every = [layer if p else dense for p in pattern]
        layout = getattr(config, "pipeline_model_parallel_layout", None)
        if layout is not None:
            from megatron.core.transformer.enums import LayerType

            specs = [every[i] for i in layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)]
        else:
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
            specs = every[offset:offset + count]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm if norm is not None else LayerNormImpl)


# --- inside Megatron's loop -------------------------------------------------------------------

def model_provider(attention: str, liger_ops: frozenset[str] = frozenset(), fp8: Fp8Choice | None = None,
                   on_fp8: Callable[[list[str], dict[str, str]], None] | None = None,
                   experts: str = "sequential") -> Any:
    """Megatron's `model_provider(pre_process, post_process, vp_stage, config, pg_collection)` for
    a GPT built from the parsed Megatron arguments, with the given attention implementation, the
    ops liger-kernel computes (runtime/model/kernels.py) and, with `fp8`, FP8 GEMMs in the transformer
    layers (runtime/model/fp8_linear.py; `on_fp8` hears which layers took them and which did not) and, in
    mixture-of-experts layers, the experts `KernelChoice.experts` names (grouped or sequential)."""

    def provide(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                config: Any = None, pg_collection: Any = None) -> GPTModel:
        from megatron.training import get_args
        from megatron.training.argument_utils import core_transformer_config_from_args

        args = get_args()
        cfg = config if config is not None else core_transformer_config_from_args(args)

        def build(dense: bool) -> ModuleSpec:
            return layer_spec(cfg, attention=attention, transformer_impl=args.transformer_impl,
                              normalization=args.normalization, qk_layernorm=args.qk_layernorm, liger_ops=liger_ops,
                              experts=experts, dense=dense)

        spec, dense = build(False), (build(True) if moe_pattern(cfg) is not None else None)
        model = gpt_class(cfg, liger_ops)(
            config=cfg,
            transformer_layer_spec=decoder_spec(cfg, spec, vp_stage, dense),
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
        if fp8 is not None and fp8.recipe is not None:
            from megalaunch.runtime.model import fp8_linear
            from megalaunch.runtime.model.fp8 import Formats

            done, kept = fp8_linear.install(model, Formats.of(fp8.recipe, fused=fp8.fused_casts))
            if on_fp8 is not None:
                on_fp8(done, kept)
        return model

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
