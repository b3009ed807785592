"""The mixture-of-experts terms of the planner's memory and speed models (config/planner/memory.py, plan.py).
Plain arithmetic, standard library only.

Parameters and model state. An MoE layer's attention, shared expert and router are dense: split over TP (the
router is whole on every TP rank) and their optimizer state over DP x CP, as a dense layer's. Its routed experts
(experts x 3 x hidden x expert ffn with SwiGLU) are split over EP x expert TP: a GPU holds
`experts / EP` experts of `expert ffn / ETP` each, with bf16 weights and fp32 main gradients of those, and the
distributed optimizer splits their fp32 master weights and Adam moments (12 bytes a parameter) over Megatron's
expert data-parallel group, world / (ETP x EP x PP) = TP x CP x DP / (ETP x EP) ranks.
Example: 8 experts of 3 x 64 x 64 (98,304 parameters a layer) on 4 GPUs at EP 2: each holds 49,152 (98 KiB of
weights, 196 KiB of gradients) and 12 x 49,152 / 2 bytes of optimizer state; at EP 4, half of each.

Activations of an MoE layer, per micro-batch, in place of the dense MLP's (memory.py's other terms unchanged).
Tokens entering the layer on a GPU: t = micro-batch x seq / CP / TP (SP: Megatron's MoE layer needs it at
TP > 1; t without the / TP at TP 1). What a GPU keeps, in bf16 elements unless named:
- router: logits and scores in fp32 (8 x experts bytes per token): t x experts x 8 bytes;
- shared expert: as a dense MLP of its width (3 or 5 x width / TP per token of the micro-batch);
- routed tokens: a GPU's experts receive r = t x top-k x load tokens, where load is the most loaded EP rank's
  share over the mean: the capacity factor when set (it drops the rest), else `DROPLESS_LOAD` (dropless; a
  calibration constant), never more than EP; with ETP > 1 the tokens are also gathered over ETP (x ETP tokens,
  / ETP width: the expert activations are the same, the dispatch input x ETP);
- alltoall: the dispatched input (r x hidden x ETP), kept for the experts' first linear, and the experts'
  activations r x (3 or 5) x expert ffn (FC1's output and the SwiGLU output, as a dense MLP's; unfused 5); on
  Megatron's paths (SequentialMLP, token dropping, MEGALAUNCH_MOE_FUSED=off) also the combined output (r x hidden).
  megalaunch's grouped experts with dropless routing (`fused_dispatch`: runtime/model/experts/permute.py's Combine
  keeps only the token order, activation.py's SwiGLU x probabilities only its input) keep no combined output:
  measured on one H200, moe-3b at seq 4096, 3.3-3.5 GiB per sequence against 4.1 counted with it (docs/results.md);
- allgather: every token of the EP x TP group gathered (t x EP x TP x hidden), then as alltoall without the
  dispatched copy (r x hidden each for the permuted input and the output).

Speed (plan.py): the active parameters' FLOPs (Megatron's count, `flops_parts`: top-k experts and the shared
expert in MoE layers, no router) at the dense GEMM efficiency, the experts' share x `MOE_STEP_CALIBRATION`; the
routed rows' copies (`ROUTED_BYTES` per token x top-k x hidden element and MoE layer, at the HBM bandwidth); the
experts' weight gradients added to their fp32 main_grad after every micro-batch (`EXPERT_WGRAD_BYTES` a parameter:
the grouped GEMMs have no gradient-accumulation fusion); `MOE_LAYER_US` per MoE layer and micro-batch (the
dispatcher's host sync for the tokens per expert, and the small kernels around the experts); the token exchange:
per MoE layer and micro-batch, t x top-k x hidden x 2 bytes each way (dispatch and combine), forward and backward
(x 2 x 2), at the NVLink bandwidth when the EP x ETP group fits in a node (`EP_NVLINK_FRACTION` of it: all-to-all,
not a ring) and `INTERNODE_GBPS` across. Fitted with the grouped experts and their fused dispatch on one H200
(bench/moe_fit.py, docs/results.md "Mixture-of-experts")."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalaunch.config.planner.shape import Layout, ModelShape

# Dropless routing: the most loaded EP rank receives this multiple of its even share of the routed tokens at the
# memory peak (aux-loss balanced routing). Not measured: a guess to replace with the first measured MoE peak.
DROPLESS_LOAD = 1.25
# NCCL's all-to-all inside an NVSwitch node, of the ring bus bandwidth (gpus.py), for the MB-sized messages of a
# micro-batch: not measured here, a guess (every pair of GPUs talks at full link rate; a ring's pipelining is lost).
EP_NVLINK_FRACTION = 0.9
# Fitted on four runs with the grouped experts and their fused dispatch, one H200, 2026-12-02 (bench/moe_fit.py: moe-3b
# at micro-batch 16 and 4, global batch 64; 2 layers of Mixtral 8x7B at 2, global batch 16; deepseek-v3-3b at 4, global
# batch 32; seq 4096, liger's loss), with plan.py's MLA_LAYER_US. Held out: moe-3b micro-batch 8 +1.6 %, Mixtral-like
# micro-batch 1 +0.7 %, deepseek-v3-3b micro-batch 2 -4.3 %; each of the seven left out of a fit on the other six
# within 4.2 %. The grouped GEMMs of narrow experts (ffn 768) ran no slower end to end than the dense ones: the
# narrower-is-slower factor the micro-benchmarks suggested (385 of 568 TFLOP/s, FACTS.md) fitted to nothing.
MOE_STEP_CALIBRATION = 1.066
ROUTED_BYTES = 42.0  # measured: the copies of moe-3b's profile at micro-batch 16 (300 ms a step) at nominal bandwidth
MOE_LAYER_US = 723.0
EXPERT_WGRAD_BYTES = 19.0  # plan.py's WGRAD_ACCUM_BYTES (measured in profiles of the fp32 adds)


def expert_shard(layout: Layout) -> int:
    """Over how many ranks the experts' optimizer state is split: the expert data-parallel group."""
    return layout.expert_dp if layout.distributed_optimizer or layout.sharding != "optimizer" else 1


def expert_params_per_gpu(shape: ModelShape, layout: Layout, moe_layers: int) -> float:
    """The routed experts' parameters one GPU holds for `moe_layers` MoE layers."""
    return moe_layers * shape.expert_params / (layout.ep * (layout.etp or 1))


def load(shape: ModelShape, layout: Layout) -> float:
    """The most loaded GPU's routed tokens over the mean (module docstring)."""
    return min(shape.capacity if shape.capacity is not None else DROPLESS_LOAD, float(layout.ep))


def layer_tokens(shape: ModelShape, layout: Layout) -> float:
    """Tokens of one micro-batch entering an MoE layer on one GPU (SP splits them over TP)."""
    sp = layout.sequence_parallel and layout.tp > 1
    return layout.micro_batch * shape.seq / layout.cp / (layout.tp if sp else 1)


def fused_dispatch(shape: ModelShape, layout: Layout) -> bool:
    """Whether the routed tokens come back through the grouped experts' fused Combine (module docstring): the
    all-to-all dispatcher with dropless routing (runtime/model/experts/permute.py takes no other)."""
    return layout.grouped_experts and shape.dispatcher == "alltoall" and shape.capacity is None


def moe_mlp_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes an MoE layer's MLP part (router, shared expert, routed experts, dispatch) keeps for its backward,
    one micro-batch on one GPU (module docstring)."""
    t = layer_tokens(shape, layout)
    etp = layout.etp or 1
    act = (3 if layout.fused else 5) if shape.swiglu else 2
    shared = act * shape.shared_ffn / layout.tp * 2 * layout.micro_batch * shape.seq / layout.cp
    r = t * shape.topk * load(shape, layout)
    experts = r * act * shape.expert_ffn * 2
    if shape.dispatcher == "allgather":
        tp_sp = layout.tp if layout.sequence_parallel else 1
        dispatch = (t * layout.ep * tp_sp * shape.hidden + 2 * r * shape.hidden) * 2
    else:
        dispatch = r * shape.hidden * (etp + (0 if fused_dispatch(shape, layout) else 1)) * 2
    router = t * shape.experts * 8
    return router + shared + experts + dispatch


def expert_flops_per_token(shape: ModelShape) -> float:
    """The routed experts' FLOPs of one training token, forward + backward, all layers (Megatron's count)."""
    return 6.0 * shape.moe_layers * shape.topk * shape.mlp_params(shape.expert_ffn)


def a2a_seconds(shape: ModelShape, layout: Layout, moe_layers: float, nvlink_gbps: float, internode_gbps: float,
                gpus_per_node: int) -> float:
    """One GPU's token exchange per micro-batch over `moe_layers` MoE layers (dispatch and combine, forward and
    backward); nothing with EP x ETP 1. Of the bytes, (n - 1) / n leave the GPU."""
    n = layout.ep * (layout.etp or 1)
    if n == 1:
        return 0.0
    bw = nvlink_gbps * EP_NVLINK_FRACTION if n <= gpus_per_node else internode_gbps
    per_layer = layer_tokens(shape, layout) * shape.topk * shape.hidden * 2 * 2 * 2 * (n - 1) / n
    return moe_layers * per_layer / (bw * 1e9)


def _ring(bytes_: float, n: int, gbps: float) -> float:
    return 2 * (n - 1) / n * bytes_ / (gbps * 1e9) if n > 1 else 0.0


def moe_step_parts(shape: ModelShape, layout: Layout, *, flop_rate: float, recompute_factor: float,
                   nvlink_gbps: float, internode_gbps: float, gpus_per_node: int, dp_gbps: float,
                   hbm_tbps: float) -> dict[str, float]:
    """What an MoE model adds to one GPU's step (plan.py's dense parts are of the active parameters): `compute`,
    the experts' GEMMs against dense ones (`flop_rate`: the dense FLOP/s) and the terms around them; `ep`, the
    token exchange (full recompute exchanges again in its forward); `dp`, the experts' gradient reduce-scatter and weight all-gather
    over the expert data-parallel group; `optimizer`, the step over their shard (40 bytes a parameter)."""
    L, m = layout, layout.num_microbatches
    tokens = L.micro_batch * shape.seq / L.cp
    expert = expert_flops_per_token(shape) / L.pp * recompute_factor / L.tp * tokens * m / flop_rate
    compute = expert * (MOE_STEP_CALIBRATION - 1)
    passes = 1.5 if L.recompute == "full" else 1.0
    routed = tokens * m * shape.topk * shape.hidden * shape.moe_layers / L.pp / L.tp * passes
    compute += routed * ROUTED_BYTES / (hbm_tbps * 1e12)
    compute += 1e-6 * MOE_LAYER_US * shape.moe_layers / L.pp * m * passes
    ne = expert_params_per_gpu(shape, L, shape.moe_layers) / L.pp
    # the experts' weight gradients, added to their fp32 main_grad after each micro-batch (no gradient-accumulation
    # fusion for grouped GEMMs; the dense layers' is plan.py's `wgrad`)
    compute += EXPERT_WGRAD_BYTES * ne * m / (hbm_tbps * 1e12)
    ep = a2a_seconds(shape, L, shape.moe_layers / L.pp, nvlink_gbps, internode_gbps, gpus_per_node) * m * passes
    g = L.expert_dp
    dp = _ring(4 * ne, g, dp_gbps) / 2 + _ring(2 * ne, g, dp_gbps) / 2 if L.distributed_optimizer \
        else _ring(4 * ne, g, dp_gbps)
    return {"compute": compute, "ep": ep, "dp": dp, "optimizer": 40 * ne / expert_shard(L) / (hbm_tbps * 1e12)}


def active_ffn(shape: ModelShape) -> float:
    """The MLP width a token passes through, per layer (mean), for the memory-bound kernels: a dense layer's ffn;
    an MoE layer's top-k experts and shared expert, + top-k x hidden for the permutation's copies."""
    if not shape.moe:
        return float(shape.ffn)
    moe = shape.topk * (shape.expert_ffn + shape.hidden) + shape.shared_ffn
    return ((shape.layers - shape.moe_layers) * shape.ffn + shape.moe_layers * moe) / shape.layers
