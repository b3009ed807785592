"""Does a recipe's layout fit its GPUs? The recipe's side of the memory model (config/planner/memory.py):
its shape and layout with the kernels the job will run on its GPUs (liger's fused loss, the grouped experts), the
GPU's memory from the cluster profile, preflight's refusal with the estimate's breakdown and the changes that would
fit, and what a layout fits only with (`fit_needs`: the job refuses a node without it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megalaunch.config.megatron_args import fused_kernels
from megalaunch.config.planner.gpus import GIB, gpu_spec, known_gpus
from megalaunch.config.planner.memory import Layout, MemoryEstimate, ModelShape, estimate
from megalaunch.config.schema import Recipe
from megalaunch.errors import PreflightError


def model_shape(recipe: Recipe, vocab_size: int | None) -> ModelShape:
    from megalaunch.config.model.moe import is_moe, moe_layer_pattern

    m = recipe.model
    moe: dict = {}
    if is_moe(m):
        moe = dict(experts=m.num_experts, topk=m.moe_router_topk, shared_gate=m.moe_shared_expert_gate,
                   expert_ffn=m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size,
                   shared_ffn=m.moe_shared_expert_intermediate_size or 0, moe_pattern=tuple(moe_layer_pattern(m)),
                   capacity=m.moe_expert_capacity_factor, dispatcher=m.moe_token_dispatcher_type)
    return ModelShape(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                      kv_heads=m.num_query_groups or m.num_attention_heads, ffn=m.ffn_hidden_size or 4 * m.hidden_size,
                      vocab=vocab_size or 32000, seq=m.seq_length, swiglu=m.swiglu,
                      tied=not m.untie_embeddings_and_output_weights, norm=m.normalization,
                      bias=not m.disable_bias_linear, qkv_bias=m.add_qkv_bias,
                      vocab_divisible_by=m.make_vocab_size_divisible_by, kv_channels=m.kv_channels,
                      qk_norm=m.qk_layernorm, **moe, **mla_shape(m))


def mla_shape(m: Any) -> dict:
    """The ModelShape's multi-latent-attention sizes (none for other attention)."""
    if not m.multi_latent_attention:
        return {}
    return {"mla": (m.q_lora_rank or 0, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim)}


def recipe_layout(recipe: Recipe, dp: int, num_microbatches: int) -> Layout:
    """The recipe's layout as the memory and speed models see it, with the kernels the job will run on the
    cluster's GPUs (`liger_loss`, `grouped_experts`, `speed_kernels`)."""
    p, t = recipe.parallel, recipe.training
    return Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
                  dp=dp, vpp=p.virtual_pipeline_model_parallel_size, micro_batch=t.micro_batch_size,
                  num_microbatches=num_microbatches, recompute=t.recompute, sequence_parallel=p.sequence_parallel,
                  distributed_optimizer=p.use_distributed_optimizer, precision=t.precision, fp8_recipe=t.fp8_recipe,
                  sharding=p.data_sharding, **expert_layout(recipe),
                  attention="local" if t.attention == "local" else "sdpa", fused=fused_kernels(recipe),
                  fused_loss=liger_loss(recipe), kernels=speed_kernels(recipe))


def expert_layout(recipe: Recipe) -> dict:
    """The Layout's EP, expert TP (Megatron's: expert TP null means TP) and experts; none for a dense model."""
    from megalaunch.config.model.moe import expert_tensor_parallel_size, is_moe

    if not is_moe(recipe.model):
        return {}
    return {"ep": recipe.parallel.expert_model_parallel_size, "etp": expert_tensor_parallel_size(recipe),
            "grouped_experts": grouped_experts(recipe)}


def liger_loss(recipe: Recipe, gpus_per_node: int | None = None) -> bool:
    """Whether the job computes the output layer's loss with liger's fused linear cross entropy (at TP 1: the
    memory model applies it there only), as runtime/model/kernels.py decides on a GPU node: under training.kernels
    liger, and under auto (liger-kernel comes with megalaunch[train]: a node without it is refused where the
    layout fits only with this loss, `fit_needs`), unless transformer_impl is transformer_engine (auto takes TE's
    layers), a training flow reads per-token losses, or multi-token prediction computes its own. Never on CPUs."""
    from megalaunch.runtime.model.kernels import LIGER_FASTER

    t = recipe.training
    gpus = recipe.cluster.gpus_per_node if gpus_per_node is None else gpus_per_node
    if gpus == 0 or t.kernels not in ("auto", "liger") or t.transformer_impl == "transformer_engine":
        return False
    if t.flow or recipe.post_training.flow or "mtp_num_layers" in recipe.megatron_args:
        return False
    return t.kernels == "liger" or "linear_ce" in LIGER_FASTER


def grouped_experts(recipe: Recipe, gpu: str | None = None, gpus_per_node: int | None = None) -> bool:
    """Whether the job builds megalaunch's grouped experts for an MoE model (runtime/model/kernels.py's
    experts_choice) on GPUs named `gpu` (default cluster.gpu): training.kernels auto or liger, local layers, no
    biases, a GPU of compute capability 9.0 or more. A GPU the planner does not know counts as not (SequentialMLP
    keeps more). The job refuses a node that builds others where the layout fits only with them (`fit_needs`)."""
    from megalaunch.runtime.model.kernels import GROUPED_MIN_CAPABILITY

    t, spec = recipe.training, gpu_spec(gpu or recipe.cluster.gpu)
    gpus = recipe.cluster.gpus_per_node if gpus_per_node is None else gpus_per_node
    return (gpus > 0 and t.kernels in ("auto", "liger") and t.transformer_impl == "local"
            and recipe.model.disable_bias_linear and spec is not None and spec.capability >= GROUPED_MIN_CAPABILITY)


def speed_kernels(recipe: Recipe) -> str:
    """The kernels the speed model assumes (config/planner/plan.py): liger's (its RoPE, SwiGLU and, at TP 1, fused
    loss, and the gradient-accumulation fusion) for training.kernels auto and liger: liger-kernel comes with
    megalaunch[train] on the GPU nodes. The memory model counts liger's loss where the job computes it
    (`liger_loss`)."""
    return "liger" if recipe.training.kernels in ("auto", "liger") else "megatron"


@dataclass(frozen=True)
class GPUMemory:
    gib: float
    source: str  # what said so: "cluster.gpu H100" or "cluster.gpu_memory_gb"


def gpu_memory(recipe: Recipe) -> GPUMemory | None:
    """The GPU memory the cluster profile states (None when it says nothing, or the job runs on CPUs)."""
    cl = recipe.cluster
    if cl.gpus_per_node == 0:
        return None
    if cl.gpu_memory_gb:
        return GPUMemory(float(cl.gpu_memory_gb), "cluster.gpu_memory_gb")
    if cl.gpu:
        spec = gpu_spec(cl.gpu)
        if spec is None:
            raise PreflightError(f"{cl.gpu!r} is not a GPU megalaunch knows", field="cluster.gpu",
                                 valid=known_gpus(), fix="name one of them, or set cluster.gpu_memory_gb")
        return GPUMemory(spec.memory_gib, f"cluster.gpu {cl.gpu}")
    return None


def fits(est: MemoryEstimate, memory_gib: float) -> bool:
    return est.needed_gib() <= memory_gib


def _alternatives(recipe: Recipe, layout: Layout) -> list[tuple[str, Layout]]:
    """Single changes that lower memory, as (the --set that makes it, the layout it gives)."""
    m, cl = recipe.model, recipe.cluster
    out: list[tuple[str, Layout]] = []
    if layout.recompute != "full":
        out.append(("--set training.recompute=full", dataclasses.replace(layout, recompute="full")))
    if layout.micro_batch > 1:
        mb = layout.micro_batch // 2
        out.append((f"--set training.micro_batch_size={mb}",
                    dataclasses.replace(layout, micro_batch=mb, num_microbatches=layout.num_microbatches * 2)))
    if layout.tp > 1 and not layout.sequence_parallel:
        out.append(("--set parallel.sequence_parallel=true", dataclasses.replace(layout, sequence_parallel=True)))
    tp2 = layout.tp * 2
    kv = m.num_query_groups or m.num_attention_heads
    if (layout.dp % 2 == 0 and tp2 <= max(cl.gpus_per_node, 1) and kv % tp2 == 0
            and m.num_attention_heads % tp2 == 0):
        out.append((f"--set parallel.tensor_model_parallel_size={tp2} --set parallel.sequence_parallel=true",
                    dataclasses.replace(layout, tp=tp2, dp=layout.dp // 2, sequence_parallel=True,
                                        num_microbatches=layout.num_microbatches * 2)))
    pp2 = layout.pp * 2
    if layout.dp % 2 == 0 and m.num_layers % pp2 == 0:
        out.append((f"--set parallel.pipeline_model_parallel_size={pp2}",
                    dataclasses.replace(layout, pp=pp2, dp=layout.dp // 2, vpp=None,
                                        num_microbatches=layout.num_microbatches * 2)))
    return out


def check_memory(recipe: Recipe, dp: int, num_microbatches: int, vocab_size: int | None) -> MemoryEstimate | None:
    """Refuse a layout whose estimated peak does not fit the GPU, with the breakdown and what would fit
    (mixture-of-experts models too: config/planner/moe.py)."""
    mem = gpu_memory(recipe)
    if mem is None or recipe.workload:
        return None
    shape = model_shape(recipe, vocab_size)
    layout = recipe_layout(recipe, dp, num_microbatches)
    est = estimate(shape, layout)
    if fits(est, mem.gib):
        return est
    fixes = []
    singles = _alternatives(recipe, layout)
    candidates = singles + [(f"{c1} {c2}", l2) for c1, l1 in singles for c2, l2 in _alternatives(recipe, l1)
                            if c2.split("=")[0] != c1.split("=")[0]]
    seen: set[frozenset[str]] = set()
    for change, alt in candidates:  # single changes first, then pairs
        key = frozenset(change.split(" --set "))
        alt_est = estimate(shape, alt)
        if fits(alt_est, mem.gib) and key not in seen and not any(k < key for k in seen):
            seen.add(key)
            fixes.append(f"{change} (~{alt_est.needed_gib():.0f} GiB)")
    fix = "; ".join(fixes[:3]) if fixes else "more GPUs (cluster.nodes), more TP or PP, training.recompute=full"
    stage = f" (pipeline stage {est.stage})" if layout.pp > 1 else ""
    raise PreflightError(
        f"{layout.describe()} needs ~{est.needed_gib():.0f} GiB per GPU{stage} but the GPU has {mem.gib:.0f} GiB "
        f"({mem.source}): estimated {est.breakdown()}, + {(est.needed_gib() - est.total / GIB):.1f} GiB context, "
        "NCCL and fragmentation",
        field="parallel", valid=f"a layout that fits {mem.gib:.0f} GiB (see `megalaunch plan {recipe.name}`)",
        fix=fix)


# What `fit_needs` names, and the job's check of each (runtime/model/kernels.py check_fit)
NEEDS = {"liger_loss": "fused_loss", "grouped_experts": "grouped_experts"}


def fit_needs(recipe: Recipe, vocab_size: int | None) -> dict[str, str]:
    """What the layout fits the GPUs' memory only with, of the kernels the memory model counts under
    training.kernels auto (`liger_loss`, `grouped_experts`; "liger_loss+grouped_experts": either, where each alone
    fits but not neither), each with the figures (a clause): the job refuses a node that would run without it
    (RuntimeSettings.fits_with), before it runs out of memory at its first step or hours later."""
    from megalaunch.config.topology import topology

    mem = gpu_memory(recipe)
    if mem is None or recipe.workload:
        return {}
    topo = topology(recipe)
    shape, layout = model_shape(recipe, vocab_size), recipe_layout(recipe, topo.dp, topo.num_microbatches)
    est = estimate(shape, layout)
    used = {need: field for need, field in NEEDS.items() if getattr(layout, field)}
    if not used or not fits(est, mem.gib):
        return {}

    def without(*fields: str) -> MemoryEstimate:
        off: dict[str, Any] = dict.fromkeys(fields, False)
        return estimate(shape, dataclasses.replace(layout, **off))

    needs = {need: f"~{alt.needed_gib():.0f} GiB per GPU without it" for need, alt in
             ((need, without(field)) for need, field in used.items()) if not fits(alt, mem.gib)}
    if not needs and len(used) > 1 and not fits(both := without(*used.values()), mem.gib):  # either will do
        needs = {"+".join(used): f"~{both.needed_gib():.0f} GiB per GPU without both"}
    return {need: f"{text}, ~{est.needed_gib():.0f} as planned, of {mem.gib:.0f} GiB ({mem.source})"
            for need, text in needs.items()}
