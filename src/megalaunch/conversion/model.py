"""A Megatron-core GPTModel built from a recipe's `ModelConfig`, outside the training loop: the
same model `megalaunch.runtime.train` trains (layer specs from runtime/model/model.py), for conversion and
logits-parity tests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megalaunch.config.model.moe import moe_layer_pattern
from megalaunch.conversion.dims import padded_vocab_size
from megalaunch.runtime.model.model import decoder_spec, gpt_class, layer_spec, moe_pattern

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megalaunch.config.schema import ModelConfig


def transformer_config(model: ModelConfig, *, params_dtype: torch.dtype | None = None,
                       init_method_std: float = 0.02, use_cpu_initialization: bool | None = None,
                       **overrides: Any) -> TransformerConfig:
    """A Megatron TransformerConfig equivalent to what `--num-layers ...` etc. produce for this
    ModelConfig with the local implementation (no fusions). `overrides` go to TransformerConfig."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = params_dtype or torch.float32
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        num_query_groups=model.num_query_groups,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=not model.disable_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        init_method_std=init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **_moe(model),
        kv_channels=model.kv_channels,
        qk_layernorm=model.qk_layernorm,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=(not torch.cuda.is_available()) if use_cpu_initialization is None
        else use_cpu_initialization,
    )
    kwargs.update(overrides)
    if model.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kwargs, **_mla(model))
    return TransformerConfig(**kwargs)


def _mla(model: ModelConfig) -> dict[str, Any]:
    """MLATransformerConfig's fields of the recipe's multi-latent attention (config/model/mla.py's `mla_args` give
    Megatron the same in training); the YaRN fields Megatron fixes keep MLATransformerConfig's defaults."""
    return dict(q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
                qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
                rope_type=model.rope_type, rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
                rotary_scaling_factor=model.rotary_scaling_factor, mscale=model.mscale,
                mscale_all_dim=model.mscale_all_dim)


def _moe(model: ModelConfig) -> dict[str, Any]:
    """The TransformerConfig fields of the recipe's mixture of experts (as config/model/moe.py's `moe_args` pass
    them to Megatron in training), so that a converted MoE computes here what it computes in the job."""
    if not model.num_experts:
        return {"num_moe_experts": None}
    return dict(num_moe_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
                moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size,
                moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=model.moe_shared_expert_gate,
                moe_router_score_function=model.moe_router_score_function,
                moe_router_pre_softmax=model.moe_router_score_function == "softmax"
                and not model.moe_router_topk_normalize,
                moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
                moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
                moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk,
                moe_router_dtype="fp32", moe_layer_freq=_layer_freq(model))


def build_gpt_model(model: ModelConfig, *, vocab_size: int, attention: str = "local",
                    params_dtype: torch.dtype | None = None, pre_process: bool = True,
                    post_process: bool = True, make_vocab_size_divisible_by: int | None = None,
                    liger_ops: frozenset[str] = frozenset(), experts: str = "sequential",
                    **config_overrides: Any) -> GPTModel:
    """Build a Megatron-core GPTModel (the one `megalaunch.runtime.train` trains) from a recipe's
    ModelConfig, outside of the training loop.

    Args:
        model: the recipe's `model` section (shape, RoPE, norm, SwiGLU, biases, ties...).
        vocab_size: the tokenizer's vocabulary size, before padding; the embedding gets
            `padded_vocab_size(vocab_size, make_vocab_size_divisible_by, TP)` rows, as in training.
        attention: "local" (Megatron's), "sdpa" (torch SDPA) or "te" (transformer-engine).
        params_dtype: parameter dtype (default float32).
        make_vocab_size_divisible_by: default `model.make_vocab_size_divisible_by`.
        liger_ops: the ops liger-kernel computes (runtime/model/kernels.py OPS; its kernels need a GPU).
        experts: a mixture-of-experts model's experts: "sequential" (Megatron's SequentialMLP) or "grouped"
            (megalaunch's grouped-GEMM experts, runtime/model/experts/); the same checkpoint keys either way.
        config_overrides: extra TransformerConfig fields.

    Megatron's model-parallel state must exist: inside training it does; in a test or a converter
    use `with megatron_parallel_state(): ...` (one process, TP=PP=1, CPU or GPU). State-dict keys
    are Megatron's (`embedding.word_embeddings.weight`, `decoder.layers.0.self_attention.
    linear_qkv.weight`, ..., `output_layer.weight`), identical to the checkpoints training writes.
    """
    from megatron.core import parallel_state

    if model.multi_latent_attention and attention == "local":
        attention = "sdpa"  # MLA's only core attention on the local spec (runtime/model/mla.py)
    config = transformer_config(model, params_dtype=params_dtype, **config_overrides)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    divisible = make_vocab_size_divisible_by or model.make_vocab_size_divisible_by
    impl = "transformer_engine" if attention == "te" else "local"
    def spec(dense: bool) -> Any:
        return layer_spec(config, attention=attention, transformer_impl=impl, normalization=model.normalization,
                          qk_layernorm=model.qk_layernorm, liger_ops=liger_ops, experts=experts, dense=dense)

    dense = spec(True) if moe_pattern(config) is not None else None  # the first dense layers (DeepSeek-V3)
    return gpt_class(config, liger_ops)(
        config=config,
        transformer_layer_spec=decoder_spec(config, spec(False), None, dense),
        vocab_size=padded_vocab_size(vocab_size, divisible, tp),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=False,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base,
        rope_scaling=model.use_rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
    )


def _layer_freq(model: ModelConfig) -> int | list[int]:
    """Megatron's moe_layer_freq: the per-layer list where some layers are dense (Megatron then saves every layer
    under its own keys), else 1 (every layer MoE: one stacked key per tensor), as `--moe-layer-freq` in training."""
    pattern = moe_layer_pattern(model)
    return pattern if 0 in pattern else 1
