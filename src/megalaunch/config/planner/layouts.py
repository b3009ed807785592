"""Every layout Megatron accepts for a model on a number of GPUs: what `megalaunch plan` ranks
(config/planner/plan.py). Standard library only."""

from __future__ import annotations

import itertools

from megalaunch.config.planner.memory import RECOMPUTES, Layout, ModelShape


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_splits(shape: ModelShape, tp: int) -> bool:
    """TP divides the heads, the KV heads and the MLPs it splits (the dense one where there are dense layers,
    the shared expert)."""
    dense = shape.layers > shape.moe_layers
    return not (shape.heads % tp or shape.kv_heads % tp or (dense and shape.ffn % tp) or shape.shared_ffn % tp)


def expert_parallel(shape: ModelShape, tp: int, cp: int, dp: int) -> list[int]:
    """EP sizes for an MoE model, at expert TP 1: the divisors of the experts that divide DP x CP (preflight's
    rule, config/topology.py); [1] for a dense one."""
    if not shape.moe:
        return [1]
    return [e for e in _divisors(shape.experts) if (cp * dp) % e == 0]


def layouts(shape: ModelShape, *, world: int, gpus_per_node: int, global_batch: int, attention: str = "sdpa",
            precision: str = "bf16", distributed_optimizer: bool = True, fused: bool = False,
            fused_loss: bool = False, kernels: str = "megatron", fp8_recipe: str = "tensorwise",
            fsdp: bool = True, grouped_experts: bool = False) -> list[Layout]:
    """Every layout Megatron accepts for this model on `world` GPUs: TP within a node dividing the heads,
    the KV heads and the MLP; PP dividing the layers; VPP for PP > 1; CP (not with torch SDPA); the
    micro-batch dividing the batch per DP rank; SP on or off with TP (MoE: on, Megatron's MoE layer needs it);
    each recompute mode; with `fsdp`, Megatron-FSDP's ZeRO-3 beside the distributed optimizer where there is no
    PP and DP x CP > 1 (dense models); for MoE, each EP (`expert_parallel`) at expert TP 1."""
    out = []
    for tp in _divisors(min(gpus_per_node, world)):
        if not _tp_splits(shape, tp):
            continue
        for pp in _divisors(world // tp):
            if shape.layers % pp:
                continue
            for cp in _divisors(world // (tp * pp)):
                if cp > 1 and (attention == "sdpa" or shape.seq % (2 * cp)):
                    continue
                dp = world // (tp * pp * cp)
                if global_batch % dp:
                    continue
                for mb in (1, 2, 4, 8, 16):
                    if (global_batch // dp) % mb:
                        continue
                    m = global_batch // (dp * mb)
                    vpps: list[int | None] = [None]
                    if pp > 1:
                        vpps += [v for v in range(2, 9) if shape.layers % (pp * v) == 0 and m % pp == 0]
                    shardings = ("optimizer", "optimizer_grads_params") if fsdp and pp == 1 and dp * cp > 1 \
                        and not shape.moe else ("optimizer",)
                    sps = (True,) if shape.moe and tp > 1 else ((False, True) if tp > 1 else (False,))
                    for vpp, sp, rc, sh, ep in itertools.product(vpps, sps, RECOMPUTES, shardings,
                                                                 expert_parallel(shape, tp, cp, dp)):
                        out.append(Layout(tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, micro_batch=mb, num_microbatches=m,
                                          recompute=rc, sequence_parallel=sp, distributed_optimizer=distributed_optimizer,
                                          precision=precision, attention=attention, fused=fused, fused_loss=fused_loss,
                                          kernels=kernels, fp8_recipe=fp8_recipe, sharding=sh, ep=ep,
                                          etp=1 if shape.moe else None, grouped_experts=grouped_experts and shape.moe))
    return out
