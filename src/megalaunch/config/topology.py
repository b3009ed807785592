"""The parallel layout of a recipe: how its ranks divide into TP x PP x CP x DP and how many
micro-batches make a step (`topology`), and whether the model splits that way: heads, query groups,
layers, the MLP, experts and the sequence for the chosen TP, PP, VPP, CP and EP (`check_model_parallel`).
Part of preflight (config/preflight.py); each failure is one PreflightError."""

from __future__ import annotations

from dataclasses import dataclass

from megalaunch.config.model.mla import check_mla
from megalaunch.config.model.moe import check_moe
from megalaunch.config.schema import Recipe
from megalaunch.errors import PreflightError


@dataclass(frozen=True)
class Topology:
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    num_microbatches: int


def topology(recipe: Recipe) -> Topology:
    p, t, cl = recipe.parallel, recipe.training, recipe.cluster
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        _require(getattr(p, name) >= 1, f"parallel.{name}", f"is {getattr(p, name)}", ">= 1",
                 f"--set parallel.{name}=1")
    world = cl.world_size
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if world % mp:
        raise PreflightError(
            f"world size {world} (nodes {cl.nodes} x tasks/node {cl.ntasks_per_node}) is not divisible by "
            f"TP x PP x CP = {p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x "
            f"{p.context_parallel_size} = {mp}",
            field="parallel", valid="nodes x tasks per node = TP x PP x CP x DP",
            fix="change cluster.nodes/gpus_per_node or the parallel sizes")
    dp = world // mp
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise PreflightError(
            f"global_batch_size {t.global_batch_size} is not divisible by micro_batch_size x DP = "
            f"{t.micro_batch_size} x {dp} = {per_step}",
            field="training.global_batch_size", valid=f"a multiple of {per_step}",
            fix=f"--set training.global_batch_size={max(per_step, t.global_batch_size // per_step * per_step)}")
    return Topology(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                    p.context_parallel_size, dp, t.global_batch_size // per_step)


def node_counts(recipe: Recipe) -> list[int]:
    """The node counts a training step may run on, largest first: `cluster.nodes`, then (with
    `cluster.min_nodes`) each smaller count down to it whose data-parallel size the layout allows: the
    world divides into TP x PP x CP, micro-batch x DP divides the global batch, EP divides DP x CP."""
    p, t, cl = recipe.parallel, recipe.training, recipe.cluster
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    counts = [cl.nodes]
    for n in range(cl.nodes - 1, (cl.min_nodes or cl.nodes) - 1, -1):
        world = n * cl.ntasks_per_node
        dp = world // mp
        if (world % mp == 0 and t.global_batch_size % (t.micro_batch_size * dp) == 0
                and (dp * p.context_parallel_size) % p.expert_model_parallel_size == 0):
            counts.append(n)
    return counts


def check_shrink(recipe: Recipe) -> list[int]:
    """`cluster.min_nodes` must leave at least one smaller count to shrink to; returns `node_counts`."""
    counts = node_counts(recipe)
    cl, t = recipe.cluster, recipe.training
    if cl.min_nodes is not None and len(counts) == 1:
        raise PreflightError(
            f"no node count from {cl.min_nodes} to {cl.nodes - 1} gives a data-parallel size that divides the "
            f"global batch {t.global_batch_size} (micro-batch {t.micro_batch_size}) and the model-parallel layout",
            field="cluster.min_nodes", valid="a count whose DP x micro_batch_size divides training.global_batch_size",
            fix="lower cluster.min_nodes, or choose a global_batch_size with more divisors (e.g. a multiple of "
                f"{cl.nodes * (cl.nodes - 1) * t.micro_batch_size})")
    return counts


def _require(ok: bool, field: str, message: str, valid: str, fix: str) -> None:
    if not ok:
        raise PreflightError(message, field=field, valid=valid, fix=fix)


def check_model_parallel(recipe: Recipe, topo: Topology) -> None:
    m, p = recipe.model, recipe.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    _require(m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0, "model.hidden_size",
             f"{m.hidden_size} is not divisible by num_attention_heads {m.num_attention_heads}",
             "a multiple of the head count", "fix the model shape, or set model.kv_channels (the head size)")
    _require(m.kv_channels is None or m.kv_channels >= 1, "model.kv_channels", f"is {m.kv_channels}",
             ">= 1 or null (hidden_size / num_attention_heads)", "--set model.kv_channels=null")
    _require(m.num_attention_heads % tp == 0, "parallel.tensor_model_parallel_size",
             f"TP {tp} does not divide num_attention_heads {m.num_attention_heads}",
             "a divisor of the head count", "choose another TP")
    groups = m.num_query_groups
    if groups is not None:
        _require(groups >= 1 and m.num_attention_heads % groups == 0, "model.num_query_groups",
                 f"{groups} does not divide num_attention_heads {m.num_attention_heads}",
                 "a divisor of the head count", "fix the model shape")
        _require(groups % tp == 0, "parallel.tensor_model_parallel_size",
                 f"TP {tp} does not divide num_query_groups {groups}",
                 f"a divisor of {groups}", "choose a TP that divides the KV heads")
    _require(m.num_layers % pp == 0, "parallel.pipeline_model_parallel_size",
             f"PP {pp} does not divide num_layers {m.num_layers}", "a divisor of num_layers",
             "choose another PP")
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None:
        _require(pp > 1, "parallel.virtual_pipeline_model_parallel_size",
                 "interleaving needs pipeline_model_parallel_size > 1", "null when PP = 1",
                 "--set parallel.virtual_pipeline_model_parallel_size=null")
        _require(m.num_layers % (pp * vpp) == 0, "parallel.virtual_pipeline_model_parallel_size",
                 f"num_layers {m.num_layers} is not divisible by PP x VPP = {pp * vpp}",
                 "PP x VPP dividing num_layers", "choose another VPP")
        _require(topo.num_microbatches % pp == 0, "training.global_batch_size",
                 f"the interleaved schedule needs micro-batches per step ({topo.num_microbatches}) "
                 f"divisible by PP {pp}", f"global batch = k x {pp} x micro x DP",
                 "raise global_batch_size")
    _require(not p.sequence_parallel or tp > 1, "parallel.sequence_parallel",
             "sequence parallelism needs tensor_model_parallel_size > 1", "false when TP = 1",
             "--set parallel.sequence_parallel=false")
    if p.sequence_parallel:  # each TP rank holds seq_length / TP positions (Megatron asserts it in the forward)
        _require(m.seq_length % tp == 0, "model.seq_length",
                 f"{m.seq_length} is not divisible by TP {tp}, as sequence parallelism needs", f"a multiple of {tp}",
                 "choose another seq_length or --set parallel.sequence_parallel=false")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    _require(ffn % tp == 0, "model.ffn_hidden_size",
             f"{ffn} is not divisible by TP {tp} (the MLP's column-parallel layer splits it)",
             f"a multiple of {tp}", "choose another TP or ffn_hidden_size")
    _check_experts(recipe, topo)
    check_mla(recipe)
    _check_sequence(recipe, topo)


def _check_experts(recipe: Recipe, topo: Topology) -> None:
    m, ep = recipe.model, recipe.parallel.expert_model_parallel_size
    if ep > 1 or m.num_experts:
        _require(bool(m.num_experts), "parallel.expert_model_parallel_size",
                 f"EP {ep} needs an MoE model (model.num_experts)", "1 for dense models",
                 "--set parallel.expert_model_parallel_size=1")
        assert m.num_experts is not None
        _require(m.num_experts % ep == 0, "parallel.expert_model_parallel_size",
                 f"EP {ep} does not divide num_experts {m.num_experts}", "a divisor of num_experts",
                 "choose another EP")
        _require((topo.dp * topo.cp) % ep == 0, "parallel.expert_model_parallel_size",
                 f"EP {ep} does not divide DP x CP = {topo.dp * topo.cp}", "a divisor of DP x CP",
                 "choose another EP")
    _require(recipe.parallel.expert_tensor_parallel_size is None or bool(m.num_experts),
             "parallel.expert_tensor_parallel_size", "expert TP needs an MoE model (model.num_experts)",
             "null for dense models", "--set parallel.expert_tensor_parallel_size=null")
    check_moe(recipe)


def _check_sequence(recipe: Recipe, topo: Topology) -> None:
    m = recipe.model
    _require(m.seq_length <= m.max_position_embeddings, "model.seq_length",
             f"{m.seq_length} exceeds max_position_embeddings {m.max_position_embeddings}",
             f"<= {m.max_position_embeddings}", "lower seq_length or raise max_position_embeddings")
    if topo.cp > 1:
        _require(m.seq_length % (2 * topo.cp) == 0, "model.seq_length",
                 f"{m.seq_length} is not divisible by 2 x CP = {2 * topo.cp}", "a multiple of 2 x CP",
                 "choose another seq_length or CP")
        _require(recipe.training.attention != "sdpa", "training.attention",
                 "sdpa attention does not support context parallelism", "auto, local or te with CP > 1",
                 "--set training.attention=auto")
