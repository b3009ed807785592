"""The numbers the planner's memory and speed models depend on: the model (`ModelShape`) and how one training step
runs on the GPUs (`Layout`). Standard library only (login nodes).

A mixture-of-experts model (`experts` > 0) has two kinds of layer, by `moe_pattern` (1: MoE): a dense layer is
attention + the dense MLP (`ffn`); an MoE layer is attention + a router (hidden x experts, whole on every TP
rank, as Megatron keeps it), the shared expert (`shared_ffn`, TP-split like a dense MLP) and `experts` routed
experts of `expert_ffn` each, split over EP x expert TP (`Layout.ep`, `Layout.etp`). The head size is
`kv_channels` when given (Qwen3: 128 where hidden / heads is 64), and QK-norm adds a norm over the head size to
the queries and to the keys. Multi-latent attention (`mla`) has its own projections, counted as Megatron counts them
(its latent norms among the attention's parameters)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

FSDP_NAMES = {"optimizer_grads": "FSDP ZeRO-2", "optimizer_grads_params": "FSDP ZeRO-3"}


@dataclass(frozen=True)
class ModelShape:
    """The model, in the numbers memory and FLOPs depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int  # the tokenizer's vocabulary (Megatron pads it)
    seq: int
    swiglu: bool = True
    tied: bool = False  # embeddings shared with the output layer
    norm: str = "RMSNorm"
    bias: bool = False
    qkv_bias: bool = False
    vocab_divisible_by: int = 128
    kv_channels: int | None = None  # the head size, when not hidden / heads
    qk_norm: bool = False  # a norm over the head size on the queries and on the keys
    experts: int = 0  # routed experts per MoE layer (0: a dense model)
    topk: int = 0  # experts each token is routed to
    expert_ffn: int = 0  # each routed expert's MLP width
    shared_ffn: int = 0  # the shared expert's width (0: none)
    shared_gate: bool = False  # a gate (hidden -> 1) on the shared expert
    moe_pattern: tuple[int, ...] = ()  # per layer: 1 MoE, 0 dense
    capacity: float | None = None  # the experts' capacity factor (None: dropless)
    dispatcher: str = "alltoall"  # alltoall | allgather
    mla: tuple[int, int, int, int, int] | None = None  # multi-latent attention: q latent (0: none), kv latent,
    #                                                    qk nope, qk rope, v head sizes (config/model/mla.py)

    # cached: `megalaunch plan` and `parallel: auto` ask each shape for them thousands of times (per layout)
    @functools.cached_property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @functools.cached_property
    def q_size(self) -> int:
        if self.mla:  # each head's query (and key): nope + rope
            return self.heads * (self.mla[2] + self.mla[3])
        return self.heads * self.head_dim

    @functools.cached_property
    def kv_size(self) -> int:
        if self.mla:  # keys (q_size wide) and values (heads x v) as two "kv" of their mean width
            return (self.q_size + self.heads * self.mla[4]) // 2
        return self.kv_heads * self.head_dim

    @functools.cached_property
    def attn_width(self) -> float:
        """The core attention's width per token for the FLOP count (QK^T over q_size, PV over the values):
        Megatron's `heads x (qk + rope) / 2 + heads x v / 2` for MLA, q_size otherwise."""
        return (self.q_size + self.heads * self.mla[4]) / 2 if self.mla else float(self.q_size)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @functools.cached_property
    def moe_layers(self) -> int:
        return sum(self.moe_pattern) if self.moe else 0

    def padded_vocab(self, tp: int) -> int:
        step = self.vocab_divisible_by * tp
        return math.ceil(self.vocab / step) * step

    def mlp_params(self, ffn: int) -> int:
        """One MLP of width `ffn` (SwiGLU: gate and up, then down), with its biases where the model has them."""
        biases = ((2 * ffn if self.swiglu else ffn) + self.hidden) if self.bias else 0
        return (3 if self.swiglu else 2) * self.hidden * ffn + biases

    @functools.cached_property
    def attn_params(self) -> int:
        if self.mla:  # Megatron's count (theoretical_memory_usage, num_floating_point_operations): the latent norms too
            ql, kl, nope, rope, v = self.mla
            q = ql * (self.hidden + self.q_size + 1) if ql else self.hidden * self.q_size
            return q + kl * (self.hidden + self.heads * (nope + v) + 1) + self.hidden * rope + self.heads * v * self.hidden
        h, q, kv = self.hidden, self.q_size, self.kv_size
        biases = (q + 2 * kv + (h if self.bias else 0)) if self.bias or self.qkv_bias else 0
        return h * (q + 2 * kv) + q * h + biases

    def layer_matmul_params(self) -> int:
        """Parameters of a dense layer that TP splits (the linears); of an MoE model, the mean over its layers of
        the TP-split part (attention, dense MLP or shared expert), experts and router left out."""
        return self._matmul_params

    @functools.cached_property
    def _matmul_params(self) -> int:
        if not self.moe:
            return self.attn_params + self.mlp_params(self.ffn)
        dense = self.layers - self.moe_layers
        return (dense * (self.attn_params + self.mlp_params(self.ffn)) + self.moe_layers * self.moe_tp_params) \
            // self.layers

    @functools.cached_property
    def moe_tp_params(self) -> int:
        """An MoE layer's parameters that TP splits: attention and the shared expert."""
        return self.attn_params + (self.mlp_params(self.shared_ffn) if self.shared_ffn else 0)

    @functools.cached_property
    def router_params(self) -> int:
        """An MoE layer's router (and shared-expert gate): whole on every TP rank."""
        return self.hidden * self.experts + (self.hidden if self.shared_gate else 0)

    @functools.cached_property
    def expert_params(self) -> int:
        """One MoE layer's routed experts, all of them."""
        return self.experts * (3 if self.swiglu else 2) * self.hidden * self.expert_ffn

    @functools.cached_property
    def active_matmul_params(self) -> float:
        """The linears' parameters one token passes through, per layer (mean): what Megatron's FLOP count
        multiplies (top-k routed experts and the shared expert in MoE layers; no router, no norms)."""
        if not self.moe:
            return float(self._matmul_params)
        dense = self.layers - self.moe_layers
        moe_mlp = self.topk * self.mlp_params(self.expert_ffn) + (self.mlp_params(self.shared_ffn)
                                                                  if self.shared_ffn else 0)
        return self.attn_params + (dense * self.mlp_params(self.ffn) + self.moe_layers * moe_mlp) / self.layers

    def layer_norm_params(self) -> int:
        per = 1 if self.norm == "RMSNorm" else 2
        if self.mla:  # the latent norms are in attn_params, as Megatron counts them
            return 2 * self.hidden * per
        return 2 * self.hidden * per + (2 * self.head_dim * per if self.qk_norm else 0)

    def total_params(self) -> int:
        emb = self.padded_vocab(1) * self.hidden
        dense = self.layers - self.moe_layers
        layers = dense * (self.attn_params + self.mlp_params(self.ffn)) + self.moe_layers * (
            self.moe_tp_params + self.router_params + self.expert_params)
        return layers + self.layers * self.layer_norm_params() + emb * (1 if self.tied else 2) + self.hidden

    def stage_layers(self, pp: int, stage: int) -> tuple[int, int]:
        """(dense layers, MoE layers) of pipeline stage `stage` (Megatron splits the layers evenly, in order)."""
        per = self.layers // pp
        moe = sum(self.moe_pattern[stage * per:(stage + 1) * per]) if self.moe else 0
        return per - moe, moe


@dataclass(frozen=True)
class Layout:
    """How one training step runs on the GPUs."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: int | None = None
    micro_batch: int = 1
    num_microbatches: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    precision: str = "bf16"
    attention: str = "sdpa"  # local keeps seq x seq probabilities; sdpa/te/flash do not
    fused: bool = False  # training.fused_kernels: 4 h + 3 f per token and layer kept, not 6 h + 4 f
    fused_loss: bool = False  # liger's fused linear cross entropy (TP 1; fit.liger_loss: kernels auto|liger): no logits
    kernels: str = "megatron"  # speed only (config/planner/plan.py): "liger" = training.kernels auto|liger on GPUs
    fp8_recipe: str = "tensorwise"  # with precision fp8: training.fp8_recipe
    sharding: str = "optimizer"  # parallel.data_sharding: optimizer | optimizer_grads | optimizer_grads_params (FSDP)
    ep: int = 1  # MoE: expert parallelism (experts split over EP ranks)
    etp: int | None = None  # MoE: expert TP (None: a dense model)
    grouped_experts: bool = False  # MoE: megalaunch's grouped experts and fused dispatch (fit.grouped_experts)

    @property
    def fp8(self) -> str | None:
        """The FP8 recipe the layers run, or None (not fp8)."""
        return self.fp8_recipe if self.precision == "fp8" else None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Megatron's expert data-parallel size: world / (expert TP x EP x PP)."""
        return max(1, self.tp * self.cp * self.dp // ((self.etp or 1) * self.ep))

    def describe(self) -> str:
        dims = [f"TP {self.tp}", f"PP {self.pp}", *([f"VPP {self.vpp}"] if self.vpp else []),
                *([f"CP {self.cp}"] if self.cp > 1 else []), f"DP {self.dp}",
                *([f"EP {self.ep}"] if self.etp is not None else []),
                *([f"ETP {self.etp}"] if self.etp and self.etp > 1 else [])]
        extras = [f"micro-batch {self.micro_batch}", *(["SP"] if self.sequence_parallel else []),
                  *([FSDP_NAMES[self.sharding]] if self.sharding in FSDP_NAMES else []),
                  *([f"recompute {self.recompute}"] if self.recompute != "none" else [])]
        return " x ".join(dims) + ", " + ", ".join(extras)
