"""config/planner/memory.py's model state (weights, fp32 main gradients, optimizer) against Megatron's own
theoretical-memory code (`megatron.training.theoretical_memory_usage`), which megalaunch's login-node
path cannot import: the same bytes for the most loaded GPU of every shipped GPU recipe's layout, and of
the layouts that `megalaunch plan` ranks for llama3-8b on one node."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.planner.fit import model_shape, recipe_layout
from megalaunch.config.planner.memory import estimate_stage, stage_params
from megalaunch.config.planner.plan import plan_recipe
from megalaunch.config.recipe_files import shipped_recipes
from megalaunch.config.topology import topology

pytestmark = pytest.mark.megatron

TRAIN_GPU = [k for k in sorted(shipped_recipes()) if k.startswith("train/")
             and load_recipe(k).recipe.cluster.gpus_per_node > 0]


def megatron_weight_and_optimizer_bytes(shape, layout) -> float:
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    args = SimpleNamespace(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        kv_channels=shape.head_dim, group_query_attention=shape.kv_heads != shape.heads,
        num_query_groups=shape.kv_heads, ffn_hidden_size=shape.ffn, swiglu=shape.swiglu,
        padded_vocab_size=shape.padded_vocab(layout.tp), normalization=shape.norm,
        add_bias_linear=shape.bias, untie_embeddings_and_output_weights=not shape.tied,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, data_parallel_size=layout.dp * layout.cp,
        world_size=layout.world, use_distributed_optimizer=layout.distributed_optimizer,
        num_experts=shape.experts or None, moe_shared_expert_intermediate_size=shape.shared_ffn or None,
        mtp_num_layers=None, multi_latent_attention=shape.mla is not None, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp or layout.tp, qk_layernorm=shape.qk_norm,
        moe_layer_freq=list(shape.moe_pattern) if shape.experts else 1, moe_ffn_hidden_size=shape.expert_ffn or None,
        moe_router_topk=shape.topk or 1, moe_latent_size=None,
        **_mla(shape))
    return compute_weight_and_optimizer_memory(args)


def _mla(shape) -> dict:
    ql, kl, nope, rope, v = shape.mla or (None, None, None, None, None)
    return dict(q_lora_rank=ql or None, kv_lora_rank=kl, qk_head_dim=nope, qk_pos_emb_head_dim=rope, v_head_dim=v)


def ours(shape, layout) -> float:
    """params + grads + optimizer of the stage holding the most parameters, as Megatron counts it."""
    worst = max(range(layout.pp), key=lambda s: stage_params(shape, layout, s))
    s = estimate_stage(shape, layout, worst)
    return s.params + s.grads + s.optimizer


@pytest.mark.parametrize("ref", TRAIN_GPU)
def test_model_state_matches_megatron_for_the_shipped_layouts(ref: str) -> None:
    recipe = load_recipe(ref).recipe
    topo = topology(recipe)
    shape = model_shape(recipe, recipe.data.vocab_size)
    layout = recipe_layout(recipe, topo.dp, topo.num_microbatches)
    assert ours(shape, layout) == pytest.approx(megatron_weight_and_optimizer_bytes(shape, layout), rel=0.01)


def test_model_state_matches_megatron_for_the_planned_layouts_of_llama3_8b() -> None:
    recipe = load_recipe("llama3-8b", ["cluster.nodes=1", "cluster.gpus_per_node=4",
                                       "training.global_batch_size=16"]).recipe
    shape = model_shape(recipe, 128256)
    seen = set()
    for c in plan_recipe(recipe, 128256, gpu="H200").candidates:
        key = (c.layout.tp, c.layout.pp, c.layout.dp, c.layout.distributed_optimizer, c.layout.sharding)
        if key in seen:
            continue
        seen.add(key)
        assert ours(shape, c.layout) == pytest.approx(megatron_or_sharded(shape, c.layout), rel=0.01), \
            c.layout.describe()
    assert len(seen) >= 5 and any(k[-1] != "optimizer" for k in seen)


def megatron_or_sharded(shape, layout) -> float:
    """Megatron's bytes for its distributed optimizer; for Megatron-FSDP (which its theoretical memory does not know)
    the same model state sharded as FSDP does it over DP x CP: the 2-byte weights whole and the 4-byte gradients and
    12-byte optimizer state sharded (optimizer_grads), or all 18 bytes sharded (optimizer_grads_params), counted
    from Megatron's unsharded 18 bytes a parameter."""
    if layout.sharding == "optimizer":
        return megatron_weight_and_optimizer_bytes(shape, layout)
    import dataclasses

    whole = megatron_weight_and_optimizer_bytes(shape, dataclasses.replace(layout, dp=1, cp=1,
                                                                           distributed_optimizer=False))
    n, shards = whole / 18, layout.dp * layout.cp
    return 18 * n / shards if layout.sharding == "optimizer_grads_params" else 2 * n + 16 * n / shards
