"""`megalaunch plan`: every valid layout of a recipe on a cluster shape, its memory (config/planner/memory.py)
and its predicted speed, ranked. Plain arithmetic: it runs on login nodes.

The throughput model, per optimizer step on one GPU:
- compute: the model's FLOPs (matmuls 6 N per token, causal attention, the output layer; recompute adds a
  forward) over the GPU's peak times an efficiency: `GEMM_EFFICIENCY` (fitted to layouts measured with
  torch SDPA and Megatron's local layers on H200s, docs/results.md), lowered for narrower matrices (TP)
  and short micro-batches; the slowest pipeline stage sets the pace (the last one also runs the output
  layer and the loss);
- TP: 4 collectives per layer and micro-batch (2 forward, 2 backward; + 2 per recomputed forward) of the
  layer's activations, ring cost 2 (t-1)/t x bytes over the node's GPU bandwidth, not overlapped;
- CP: the KV exchange of the ring attention, half hidden behind compute;
- PP: the 1F1B bubble (p - 1) / (v m) of the compute, and the point-to-point sends;
- DP: the gradient reduce-scatter (fp32) and the parameter all-gather (bf16) of the distributed optimizer
  (an all-reduce without it), not overlapped, over NVLink inside a node and `INTERNODE_GBPS` across; FSDP's below;
- the optimizer step: memory-bound, ~40 bytes per parameter of the shard over the HBM bandwidth."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from megalaunch.config.planner.gpus import GPUSpec, gpu_spec, known_gpus
from megalaunch.config.planner.layouts import layouts
from megalaunch.config.planner.memory import (
    FSDP_NAMES,
    Layout,
    MemoryEstimate,
    ModelShape,
    estimate,
    optimizer_shard,
)
from megalaunch.config.planner.moe import active_ffn, expert_params_per_gpu, moe_step_parts
from megalaunch.config.schema import Recipe
from megalaunch.errors import PreflightError

# Of the dense peak, wide matmuls, 8k tokens per micro-batch: fitted with the memory-bound terms below to 36
# runs on H200s and H100s (docs/results.md "Fused kernels"; tests/unit/test_plan_speed.py keeps them).
GEMM_EFFICIENCY = 0.58
TP_EFFICIENCY_LOSS = 0.05  # per doubling of TP: narrower matmuls
MICROBATCH_TOKENS_HALF = 512  # tokens per micro-batch at which matmul efficiency would halve
INTERNODE_GBPS = 40.0  # per GPU across nodes (400 Gb/s InfiniBand / RoCE), achievable
SELECTIVE_RECOMPUTE_COST = 0.03  # of compute: the core attention's forward again (measured 3 %, SDPA, H200)
# Memory-bound work, over the GPU's HBM bandwidth (why an H100 trains llama3-1b 5-8 % slower than an H200 at
# the same peak, and why the 1B, narrow and with a large vocabulary, reaches a lower MFU than the 8B):
# - the layer's elementwise ops (norms, RoPE, SwiGLU, residual adds, copies): bytes per token, layer and
#   element of hidden + FFN width, by kernel choice: Megatron's unfused (training.fused_kernels off), its
#   torch.compile'd fusions (on), and liger-kernel's RoPE and SwiGLU on top (training.kernels auto|liger);
# - the output layer's loss: bytes per token and vocabulary entry: Megatron's (logits written, read by the
#   compiled cross entropy, its gradient written) or liger's kernel in megalaunch's chunked loop (TP 1);
# - the weight gradients' fp32 accumulation: bytes per parameter and micro-batch, unless the gradient-
#   accumulation fusion (runtime/model/wgrad_fusion.py; training.kernels auto|liger) computes them into main_grad.
# Fitted (bench/plan_fit.py --fit), except the gradient accumulation: measured in the H100 profiles (303 ms of
# llama3-8b's TP 2 step, 24 ms of llama3-1b's at micro-batch 8: ~19 bytes per parameter at nominal bandwidth).
ELEMENTWISE_BYTES = {"unfused": 92.0, "fused": 47.0, "liger": 16.5}
LOSS_BYTES = {"megatron": 67.0, "liger": 40.0}
WGRAD_ACCUM_BYTES = 19.0
# training.precision fp8 (runtime/model/fp8_linear.py): the transformer linears' GEMMs take FP8_GEMM_TIME of their
# bf16 time (measured: bench/fp8.py --stage gemm, the GEMMs alone); each linear's input and output gradient is
# cast, per token and element of their widths, and the weights once per step (an amax pass and one cast writing
# both layouts; rowwise with a scale per row of each); and a fixed time per layer and micro-batch (the casts'
# launches). Fitted (bench/plan_fit.py --fit) to the 12 fp8 runs of llama3-1b and llama3-8b on H200s, the bf16
# constants fixed; held out, the 8B's two fp8 runs were predicted within 5.0 % (tests/unit/test_plan_speed.py).
# Modelled on megalaunch's own FP8 path; with transformer-engine (its fused casts) the same terms are an estimate.
FP8_GEMM_TIME = 0.52
FP8_CAST_BYTES = {"tensorwise": 19.5, "rowwise": 24.0}
FP8_LAYER_US = 736.0  # microseconds per layer and micro-batch (forward and backward): the casts' launches and amax syncs
# Multi-latent attention (runtime/model/mla.py: Megatron's projections, latent norms and interleaved rotary embedding
# around megalaunch's SDPA): a fixed time per layer and micro-batch for its many small kernels, fitted with the MoE
# constants (config/planner/moe.py) on deepseek-v3-3b at micro-batch 4; micro-batch 2 held out: -4.3 %.
MLA_LAYER_US = 4596.0
PRESSURE_FROM, PRESSURE_COST = 0.90, 0.05  # memory pressure: see memory_pressure()
# Megatron-FSDP (parallel.data_sharding): ZeRO-3 gathers a layer's weights in each micro-batch's forward and
# backward and reduce-scatters its gradients beside the compute; the step waits for the traffic the compute does
# not cover and FSDP_LAYER_US per layer, micro-batch and pass (hooks, waits, copies): fitted (bench/plan_fit.py) to
# 6 FSDP runs on H200s; fitted to llama3-1b's alone, it predicted the 8B's 4 within -1.4..+0.8 %. FSDP ranks first
# only FSDP_MARGIN faster than the distributed optimizer (asynchronous saves, no gathers): a guess, not measured.
FSDP_LAYER_US, FSDP_MARGIN = 648.0, 0.03


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step_s: float
    tokens_per_s: float  # per GPU
    tflops: float  # model TFLOP/s per GPU
    parts: dict[str, float]  # seconds per step: compute, tp, cp, pp_bubble, dp, optimizer, memory_pressure
    fits: bool


@functools.lru_cache(maxsize=64)
def flops_parts(shape: ModelShape) -> tuple[float, float]:
    """(one transformer layer, the output layer) FLOPs of one training token, forward + backward: Megatron's
    num_floating_point_operations (the active parameters: an MoE layer's top-k experts and shared expert, no
    router; the attention's width heads x kv_channels, or MLA's `attn_width`)."""
    layer = 3 * (2 * shape.active_matmul_params + 2 * 2 * shape.seq * shape.attn_width * 0.5)  # causal QK^T, PV
    return layer, 3 * 2 * shape.hidden * shape.padded_vocab(1)


def flops_per_token(shape: ModelShape) -> float:
    """Model FLOPs of one training token (forward + backward), without recompute."""
    layer, logits = flops_parts(shape)
    return shape.layers * layer + logits


def _ring(bytes_: float, n: int, gbps: float) -> float:
    return 2 * (n - 1) / n * bytes_ / (gbps * 1e9) if n > 1 else 0.0


def predict(shape: ModelShape, layout: Layout, gpu: GPUSpec, *, gpus_per_node: int) -> dict[str, float]:
    """Seconds per optimizer step on one GPU, by part."""
    L = layout
    tokens_mb = L.micro_batch * shape.seq / L.cp  # tokens of one micro-batch on one GPU
    m = L.num_microbatches
    recompute_factor = {"none": 1.0, "selective": 1.0 + SELECTIVE_RECOMPUTE_COST, "full": 4.0 / 3.0}[L.recompute]
    eff = GEMM_EFFICIENCY * tokens_mb / (tokens_mb + MICROBATCH_TOKENS_HALF) * (8192 + MICROBATCH_TOKENS_HALF) / 8192
    eff *= (1 - TP_EFFICIENCY_LOSS) ** (L.tp.bit_length() - 1)
    if L.attention == "local":
        eff *= 0.55  # Megatron's unfused attention: half the speed at long sequences (docs/results.md)
    # The slowest pipeline stage sets the pace: the last one also runs the output layer and the loss
    # (Megatron splits the layers evenly; measured on 2x H200, 8 of llama3-8b's layers: PP 2 ran 20 %
    # below DP 2, where an even split predicts the 1F1B bubble alone, 12 %; docs/results.md).
    layer_flops, logits_flops = flops_parts(shape)
    stage_flops = (layer_flops * shape.layers / L.pp * recompute_factor + logits_flops) / L.tp
    compute = stage_flops * tokens_mb * m / (gpu.peak_tflops * 1e12 * eff)
    if L.fp8:  # the linears' share of the layers' FLOPs (their 6 N per token) runs in FP8
        linear_flops = 6 * shape.layer_matmul_params() * shape.layers / L.pp * recompute_factor / L.tp
        compute -= (1 - FP8_GEMM_TIME) * linear_flops * tokens_mb * m / (gpu.peak_tflops * 1e12 * eff)
        compute += 1e-6 * FP8_LAYER_US * shape.layers / L.pp * recompute_factor * m
    layers = shape.layers / L.pp
    if shape.mla:  # multi-latent attention's many small kernels (runtime/model/mla.py), per layer and micro-batch
        compute += 1e-6 * MLA_LAYER_US * layers * recompute_factor * m
    compute += memory_bound(shape, L, layers * recompute_factor, tokens_mb * m) / (gpu.hbm_tbps * 1e12)
    act_bytes = 2 * tokens_mb * shape.hidden
    forwards = 2 if L.recompute == "full" else 1
    tp_comm = _ring(act_bytes, L.tp, gpu.nvlink_gbps) * (2 * forwards + 2) * layers * m
    kv_bytes = 2 * tokens_mb * 2 * shape.kv_size / L.tp
    cp_comm = 0.5 * _ring(kv_bytes, L.cp, gpu.nvlink_gbps if L.tp * L.cp <= gpus_per_node else INTERNODE_GBPS) \
        * layers * m * 2
    bubble = compute * (L.pp - 1) / ((L.vpp or 1) * m)
    pp_bw = gpu.nvlink_gbps if L.tp * L.cp * L.pp <= gpus_per_node else INTERNODE_GBPS
    pp_comm = (2 * act_bytes / L.tp / (pp_bw * 1e9)) * 2 * m * (L.vpp or 1) if L.pp > 1 else 0.0
    n = shape.layer_matmul_params() * shape.layers / (L.tp * L.pp) + \
        shape.padded_vocab(L.tp) * shape.hidden / L.tp * (1 if shape.tied else 2) / L.pp
    dp_bw = gpu.nvlink_gbps if L.tp * L.cp * L.pp * L.dp <= gpus_per_node else INTERNODE_GBPS
    dp_comm = _dp_wait(L, n, dp_bw, compute, layers)
    optimizer = 40 * n / optimizer_shard(L) / (gpu.hbm_tbps * 1e12)
    parts = {"compute": compute, "tp": tp_comm, "cp": cp_comm, "pp_bubble": bubble + pp_comm, "dp": dp_comm,
             "optimizer": optimizer}
    if shape.moe:  # config/planner/moe.py
        moe = moe_step_parts(shape, L, flop_rate=gpu.peak_tflops * 1e12 * eff, recompute_factor=recompute_factor,
                             nvlink_gbps=gpu.nvlink_gbps, internode_gbps=INTERNODE_GBPS, gpus_per_node=gpus_per_node,
                             dp_gbps=dp_bw, hbm_tbps=gpu.hbm_tbps)
        moe["pp_bubble"] = moe["compute"] * (L.pp - 1) / ((L.vpp or 1) * m)
        for key, value in moe.items():
            parts[key] = parts.get(key, 0.0) + value
    return parts


def _dp_wait(L: Layout, n: float, bw: float, compute: float, layers: float) -> float:
    """The step's wait on data parallelism for `n` parameters per GPU (fp32 gradients, bf16 weights)."""
    g, m = L.dp * L.cp, L.num_microbatches
    if L.sharding in FSDP_NAMES:
        traffic = ((2 * m if L.sharding == "optimizer_grads_params" else 1) * _ring(2 * n, g, bw) + m * _ring(4 * n, g, bw)) / 2
        return max(0.0, traffic - compute) + 1e-6 * FSDP_LAYER_US * layers * m * 2
    return _ring(4 * n, g, bw) / 2 + _ring(2 * n, g, bw) / 2 if L.distributed_optimizer else _ring(4 * n, g, bw)


def memory_bound(shape: ModelShape, L: Layout, layers: float, tokens: float) -> float:
    """Bytes one GPU moves per step in memory-bound kernels (the constants above): `layers` of the stage
    (recomputed ones counted again), `tokens` of its micro-batches."""
    width = (shape.hidden / L.tp if L.sequence_parallel else shape.hidden) + active_ffn(shape) / L.tp
    liger = L.kernels == "liger"
    kind = "liger" if liger else ("fused" if L.fused else "unfused")
    loss = LOSS_BYTES["liger" if liger and L.tp == 1 else "megatron"] * shape.padded_vocab(L.tp) / L.tp * tokens
    params = shape.layer_matmul_params() * shape.layers / (L.tp * L.pp) + \
        expert_params_per_gpu(shape, L, shape.moe_layers) / L.pp
    wgrad = 0.0 if liger else WGRAD_ACCUM_BYTES * params * L.num_microbatches
    casts = 0.0
    if L.fp8:  # QKV, proj, FC1, FC2: each input (QKV's and FC1's gathered under SP) and output gradient
        h, q, kv, t = shape.hidden, shape.q_size, shape.kv_size, L.tp
        inputs = 2 * h + (q + shape.ffn) / t
        grads = (q + 2 * kv) / t + 2 * h + (2 if shape.swiglu else 1) * shape.ffn / t
        # and the weights, once per step (kept for the step's micro-batches)
        casts = FP8_CAST_BYTES[L.fp8] * ((inputs + grads) * layers * tokens + params)
    return ELEMENTWISE_BYTES[kind] * width * layers * tokens + loss + wgrad + casts


def memory_pressure(used: float) -> float:
    """The slowdown charged to a layout that needs `used` of the GPU's memory: none up to
    `PRESSURE_FROM`, then rising linearly to `PRESSURE_COST` at 100 %. Near the limit the caching
    allocator frees and retries (`num_alloc_retries`), a checkpoint save's buffers or a longer
    document may not fit, and the memory model's own error (-3..+8 % measured) decides whether it
    fits at all: a layout a few percent faster on paper is not worth that (a heuristic, not measured)."""
    return PRESSURE_COST * min(1.0, max(0.0, (used - PRESSURE_FROM) / (1 - PRESSURE_FROM)))


def step_key(step_s: float) -> float:
    """Step times equal to 4 significant digits are a tie (SP on or off, say), which less memory wins;
    relative, so that a tiny model's microseconds still rank."""
    return float(f"{step_s:.4g}")


def rank_key(c: Candidate) -> tuple[bool, float, float]:
    """Fitting first, then faster (FSDP by FSDP_MARGIN, else the distributed optimizer), then less memory."""
    return not c.fits, step_key(c.step_s * (1 + FSDP_MARGIN * (c.layout.sharding != "optimizer"))), c.memory.needed_gib()


def rank(shape: ModelShape, gpu: GPUSpec, memory_gib: float, *, world: int, gpus_per_node: int, global_batch: int,
         attention: str = "sdpa", precision: str = "bf16", distributed_optimizer: bool = True,
         fused: bool = False, fused_loss: bool = False, kernels: str = "megatron",
         fp8_recipe: str = "tensorwise", fsdp: bool = True, grouped_experts: bool = False) -> list[Candidate]:
    """Every layout, fastest first; layouts that do not fit come after all that do."""
    out = []
    for layout in layouts(shape, world=world, gpus_per_node=gpus_per_node, global_batch=global_batch,
                          attention=attention, precision=precision, distributed_optimizer=distributed_optimizer,
                          fused=fused, fused_loss=fused_loss, kernels=kernels, fp8_recipe=fp8_recipe, fsdp=fsdp,
                          grouped_experts=grouped_experts):
        mem = estimate(shape, layout)
        parts = predict(shape, layout, gpu, gpus_per_node=gpus_per_node)
        parts["memory_pressure"] = sum(parts.values()) * memory_pressure(mem.needed_gib() / memory_gib)
        step = sum(parts.values())
        tokens = global_batch * shape.seq / step / world
        out.append(Candidate(layout=layout, memory=mem, step_s=step, tokens_per_s=tokens,
                             tflops=tokens * flops_per_token(shape) / 1e12, parts=parts,
                             fits=mem.needed_gib() <= memory_gib))
    out.sort(key=rank_key)
    return out


def set_lines(layout: Layout) -> list[str]:
    """The `--set` overrides that give a recipe this layout."""
    return [f"parallel.tensor_model_parallel_size={layout.tp}",
            f"parallel.pipeline_model_parallel_size={layout.pp}",
            f"parallel.virtual_pipeline_model_parallel_size={layout.vpp if layout.vpp else 'null'}",
            f"parallel.context_parallel_size={layout.cp}",
            f"parallel.sequence_parallel={'true' if layout.sequence_parallel else 'false'}",
            f"training.micro_batch_size={layout.micro_batch}",
            f"training.recompute={layout.recompute}", f"parallel.data_sharding={layout.sharding}",
            f"parallel.expert_model_parallel_size={layout.ep}",
            f"parallel.expert_tensor_parallel_size={'null' if layout.etp is None else layout.etp}"]


@functools.lru_cache(maxsize=32)
def _ranked(shape: ModelShape, gpu: GPUSpec, memory_gib: float, **kw: Any) -> tuple[Candidate, ...]:
    """`rank`, once per input: every load of a recipe with `parallel: auto` plans (config/planner/auto.py)."""
    return tuple(rank(shape, gpu, memory_gib, **kw))


@dataclass(frozen=True)
class Plan:
    recipe_name: str
    gpu: GPUSpec
    memory_gib: float
    nodes: int
    gpus_per_node: int
    candidates: list[Candidate]

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None


def plan_recipe(recipe: Recipe, vocab_size: int | None, *, nodes: int | None = None, gpus_per_node: int | None = None,
                gpu: str | None = None) -> Plan:
    """The ranked layouts of `recipe` on `nodes` x `gpus_per_node` GPUs of type `gpu` (defaults: the
    recipe's cluster profile). One-line PreflightError when the GPU is unknown or there are no GPUs."""
    from megalaunch.config.megatron_args import fused_kernels
    from megalaunch.config.planner.fit import grouped_experts, liger_loss, model_shape, speed_kernels

    cl = recipe.cluster
    nodes = nodes or cl.nodes
    gpn = gpus_per_node if gpus_per_node is not None else cl.gpus_per_node
    if nodes < 1 or gpn < 1:
        raise PreflightError(f"{nodes} nodes x {gpn} GPUs per node: planning needs GPUs", field="--gpus-per-node",
                             valid=">= 1 GPU per node and >= 1 node", fix="--nodes 1 --gpus-per-node 8")
    name = gpu or cl.gpu
    spec = gpu_spec(name)
    if spec is None:
        raise PreflightError(f"{name!r} is not a GPU megalaunch knows" if name else "no GPU type given",
                             field="--gpu" if gpu or not cl.gpu else "cluster.gpu", valid=known_gpus(),
                             fix="--gpu H100 (or set cluster.gpu in the cluster profile)")
    memory = float(cl.gpu_memory_gb) if cl.gpu_memory_gb and not gpu else spec.memory_gib
    t = recipe.training
    attention = "local" if t.attention == "local" else ("te" if t.attention == "te" else "sdpa")
    cands = list(_ranked(model_shape(recipe, vocab_size), spec, memory, world=nodes * gpn, gpus_per_node=gpn,
                         global_batch=t.global_batch_size, attention=attention, precision=t.precision,
                         distributed_optimizer=recipe.parallel.use_distributed_optimizer,
                         fused=fused_kernels(recipe, gpn), fused_loss=liger_loss(recipe, gpn),
                         kernels=speed_kernels(recipe), fp8_recipe=t.fp8_recipe,
                         fsdp=recipe.parallel.use_distributed_optimizer and recipe.checkpoint.async_save is not True
                         and recipe.checkpoint.ckpt_format == "torch_dist",
                         grouped_experts=grouped_experts(recipe, spec.name, gpn)))
    if recipe.post_training.method != "none" or recipe.training.flow:  # flows: PP 1, CP 1 (config/schema.py)
        cands = [c for c in cands if c.layout.pp == 1 and c.layout.cp == 1
                 and (c.layout.micro_batch % 2 == 0 or recipe.post_training.method not in ("dpo", "ipo"))]  # pairs
    if not cands:
        raise PreflightError(f"no layout of {recipe.name} divides {nodes * gpn} GPUs and global batch "
                             f"{t.global_batch_size}", field="training.global_batch_size",
                             valid="a multiple of the data-parallel size", fix="raise training.global_batch_size")
    return Plan(recipe.name, spec, memory, nodes, gpn, cands)
