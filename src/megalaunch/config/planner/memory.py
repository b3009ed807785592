"""Per-GPU memory of a training layout, in plain arithmetic (login nodes import no torch/megatron).

What it estimates is the peak of `torch.cuda.max_memory_allocated()` on the most loaded GPU: model
state (bf16 weights, fp32 main gradients, fp32 master weights and Adam moments, sharded over DP x CP
by the distributed optimizer) plus the larger of two transients: the activations of the micro-batches
in flight with the logits and cross entropy of one micro-batch (forward/backward), or the optimizer
step's temporaries. The fit check adds what the allocator does not count (CUDA context, NCCL,
fragmentation: `RESERVED_GIB` + `FRAGMENTATION`) and compares with the GPU's memory.

Activations are counted tensor by tensor for Megatron's local layer spec (what megalaunch trains
without transformer-engine), with no dropout (hidden_dropout 0, as every shipped recipe): per token and
layer, in elements of 2 bytes,
- sharded by SP when on, else whole on every TP rank: the two norms' inputs (the layer's input and the
  attention's bias-dropout-add output) and normalised outputs (the QKV and FC1 linears' inputs): 4 h;
- sharded by TP: the QKV output (q + 2 kv), RoPE's outputs (q + kv; its rotate-half products keep only
  cos and sin), the core attention's output, which is linear_proj's input (q), and the MLP (SwiGLU: FC1's
  output 2 f and FC2's input f, + the unfused SiLU output and up-projection copy 2 f; GELU: 2 f);
- Megatron's local attention (no fused kernel) also keeps the softmax probabilities: 2 bytes x heads
  x sequence per token, unless selective recompute drops them (with SDPA it saves nothing measurable);
- full recompute keeps each layer's input (h) and rebuilds one layer at a time in the backward.
The model state (weights, gradients, optimizer) equals Megatron's own theoretical memory
(megatron/training/theoretical_memory_usage.py, which login nodes cannot import) for every shipped layout:
tests/megatron/test_memory_model.py. Megatron's activation formula assumes TE's kernels and selective
recompute, so the activations are calibrated against measured peaks instead: what is alive at the peak,
tensor by tensor (bench/memory_trace.py; docs/results.md, "The memory model at TP 1": llama3-8b's width, 4 and 8
layers, one H200), gives 1.149 GiB per llama3-8b layer and micro-batch with `training.fused_kernels`
(4 h + 3 f + q + 2 kv + q + kv + q = 1.141; RoPE's cos and sin and the attention's log-sum-exp, 9 MiB, are
left out), 1.587 without (5 f). RoPE's halves and a second copy of the attention's output, counted before,
were never kept (-0.14 GiB a layer at TP 1)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megalaunch.config.planner.gpus import GIB

RESERVED_GIB = 2.5  # CUDA context, cuBLAS workspaces, NCCL buffers: memory the allocator does not count
FRAGMENTATION = 0.05  # the caching allocator's slack over max allocated (reserved - allocated), as a fraction
RECOMPUTES = ("none", "selective", "full")
# training.precision fp8 (runtime/model/fp8_linear.py, either recipe): each transformer linear's weight is kept
# in FP8 row-major and transposed for a step's micro-batches (2 bytes per parameter), and the QKV, FC1 and FC2
# inputs are saved for the backward in FP8 (1 byte; QKV's and FC1's gathered under SP) where bf16 saves them in
# 2 (SP: the local shard). Of that activation difference, `FP8_SAVED_FRACTION` shows at the peak: fitted to
# llama3-1b tensorwise at micro-batches 1-6 on one H200 (0.79-0.83), then predicting llama3-8b's TP 1 and
# TP 2 + SP within 0.2 GiB (docs/results.md). Rowwise's per-row scales (4 bytes a row) are left out.
FP8_SAVED_FRACTION = 0.81


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

    # cached: `megalaunch plan` and `parallel: auto` ask each shape for them thousands of times (per layout)
    @functools.cached_property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @functools.cached_property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @functools.cached_property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def padded_vocab(self, tp: int) -> int:
        step = self.vocab_divisible_by * tp
        return math.ceil(self.vocab / step) * step

    def layer_matmul_params(self) -> int:
        """Parameters of one layer that TP splits (the linears)."""
        return self._matmul_params

    @functools.cached_property
    def _matmul_params(self) -> int:
        h, f = self.hidden, self.ffn
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = (3 if self.swiglu else 2) * h * f
        biases = 0
        if self.bias:
            biases = self.q_size + 2 * self.kv_size + h + (2 * f if self.swiglu else f) + h
        elif self.qkv_bias:
            biases = self.q_size + 2 * self.kv_size
        return attn + mlp + biases

    def layer_norm_params(self) -> int:
        return 2 * self.hidden * (1 if self.norm == "RMSNorm" else 2)

    def total_params(self) -> int:
        emb = self.padded_vocab(1) * self.hidden
        return (self.layers * (self.layer_matmul_params() + self.layer_norm_params()) + emb * (1 if self.tied else 2)
                + self.hidden)


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
    fused_loss: bool = False  # training.kernels: liger: its fused linear cross entropy (TP 1) keeps no logits
    kernels: str = "megatron"  # speed only (config/planner/plan.py): "liger" = training.kernels auto|liger on GPUs
    fp8_recipe: str = "tensorwise"  # with precision fp8: training.fp8_recipe
    sharding: str = "optimizer"  # parallel.data_sharding: optimizer | optimizer_grads | optimizer_grads_params (FSDP)

    @property
    def fp8(self) -> str | None:
        """The FP8 recipe the layers run, or None (not fp8)."""
        return self.fp8_recipe if self.precision == "fp8" else None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        dims = [f"TP {self.tp}", f"PP {self.pp}", *([f"VPP {self.vpp}"] if self.vpp else []),
                *([f"CP {self.cp}"] if self.cp > 1 else []), f"DP {self.dp}"]
        extras = [f"micro-batch {self.micro_batch}", *(["SP"] if self.sequence_parallel else []),
                  *([FSDP_NAMES[self.sharding]] if self.sharding in FSDP_NAMES else []),
                  *([f"recompute {self.recompute}"] if self.recompute != "none" else [])]
        return " x ".join(dims) + ", " + ", ".join(extras)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the most loaded pipeline stage; `total` is the estimated max allocated."""

    params: float
    grads: float
    optimizer: float
    activations: float  # transformer layers, all micro-batches in flight
    logits: float  # embedding, final norm, output layer and cross entropy of one micro-batch
    transient: float  # what the backward's (or the optimizer step's) temporaries add to the loss's peak
    stage: int  # the pipeline stage it describes (0 = first)
    fp8_weights: float = 0.0  # fp8: the linears' weights cast for the step (row-major and transposed)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer + self.fp8_weights

    @property
    def total(self) -> float:
        return self.state + self.activations + self.logits + self.transient

    def needed_gib(self) -> float:
        """What must be free on the GPU: the estimate plus what the allocator does not count."""
        return self.total / GIB * (1 + FRAGMENTATION) + RESERVED_GIB

    def breakdown(self) -> str:
        parts = [("weights", self.params), *([("fp8 weights", self.fp8_weights)] if self.fp8_weights else []),
                 ("grads", self.grads), ("optimizer", self.optimizer),
                 ("activations", self.activations), ("logits", self.logits), ("temporaries", self.transient)]
        return " + ".join(f"{name} {value / GIB:.1f}" for name, value in parts) + \
            f" = {self.total / GIB:.1f} GiB"


FSDP_NAMES = {"optimizer_grads": "FSDP ZeRO-2", "optimizer_grads_params": "FSDP ZeRO-3"}


def optimizer_shard(layout: Layout) -> int:
    """Over how many ranks the optimizer state is split (Megatron-FSDP always splits it)."""
    return layout.dp * layout.cp if layout.distributed_optimizer or layout.sharding in FSDP_NAMES else 1


def _bytes_per_param(layout: Layout) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter held by a rank. Megatron-FSDP splits the fp32 main
    gradients too (ZeRO-2) and the weights (ZeRO-3): measured on llama3-8b, TP 1 x DP 4 on H200s, ZeRO-3 held
    34.0 GiB less than the distributed optimizer (73.2 against 107.2), where weights and gradients / 4 predict
    33.7 (docs/results.md)."""
    shard = optimizer_shard(layout)
    w, g, o = (4.0, 4.0, 8.0) if layout.precision == "fp32" else (2.0, 4.0, 12.0)  # fp32: no master copy
    if layout.sharding in FSDP_NAMES:
        g /= shard
    if layout.sharding == "optimizer_grads_params":
        w /= shard
    return w, g, o / shard


def stage_params(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Parameters held by one TP rank of pipeline stage `stage`."""
    tp, pp = layout.tp, layout.pp
    per_layer = shape.layer_matmul_params() // tp + shape.layer_norm_params()
    n = shape.layers // pp * per_layer
    emb = shape.padded_vocab(tp) * shape.hidden // tp
    if stage == 0:
        n += emb
    if stage == pp - 1:
        n += shape.hidden  # final norm
        if not shape.tied or pp > 1:  # with PP a tied output layer keeps its own copy on the last stage
            n += emb
    return n


def layer_activation_bytes(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """(bytes one layer keeps for its backward, bytes it holds while it runs) per micro-batch on one GPU."""
    tokens = layout.micro_batch * shape.seq / layout.cp
    t = layout.tp
    sp = layout.sequence_parallel and t > 1
    rep = shape.hidden * 4 / (t if sp else 1)
    q, kv = shape.q_size, shape.kv_size
    mlp = ((3 if layout.fused else 5) if shape.swiglu else 2) * shape.ffn
    sharded = ((q + 2 * kv) + (q + kv) + q + mlp) / t
    full = (rep + sharded) * 2 * tokens
    running = full
    if layout.attention == "local":  # softmax probabilities, [b, heads/t, s, s] in bf16 (causal: all stored)
        probs = 2 * layout.micro_batch * (shape.heads / t) * (shape.seq / layout.cp) * shape.seq / layout.cp
        full += probs if layout.recompute == "none" else 0.0
        running = full + probs
    if layout.recompute == "full":
        kept = shape.hidden / (t if sp else 1) * 2 * tokens  # the layer's input only
        return kept, running
    if layout.fp8:  # QKV's and FC1's inputs in FP8 (gathered under SP), FC2's input in FP8
        full += FP8_SAVED_FRACTION * tokens * (2 * (shape.hidden - 2 * shape.hidden / (t if sp else 1))
                                               - shape.ffn / t)
    return full, running


def in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations pipeline stage `stage` holds at once (1F1B schedules). Interleaved:
    stage r runs (p - r - 1) * 2 + (v - 1) * p forwards of model chunks (1/v of its layers each) before its
    first backward (Megatron's get_pp_rank_microbatches), so even the last stage holds nearly p
    micro-batches' worth (measured: 89.6 GiB on the last stage against 85.1 on the first, VPP 8)."""
    pp, m, v = layout.pp, layout.num_microbatches, layout.vpp
    if pp == 1:
        return 1.0
    if v:  # interleaved: Megatron's warm-up forwards of model chunks (schedules.py), + the one in its steady state
        chunks = min((pp - stage - 1) * 2 + (v - 1) * pp + 1, m * v)
        return chunks / v
    return float(min(pp - stage, m))


def estimate_stage(shape: ModelShape, layout: Layout, stage: int) -> MemoryEstimate:
    n = stage_params(shape, layout, stage)
    wb, gb, ob = _bytes_per_param(layout)
    tokens = layout.micro_batch * shape.seq / layout.cp
    per_layer, running = layer_activation_bytes(shape, layout)
    layers = shape.layers // layout.pp
    acts = per_layer * layers * in_flight(layout, stage)
    sp = layout.sequence_parallel and layout.tp > 1
    if stage == 0:  # embedding output (bf16) of each micro-batch in flight
        acts += 2 * shape.hidden * tokens / (layout.tp if sp else 1) * in_flight(layout, stage)
    logits = loss_bytes(shape, layout, tokens) if stage == layout.pp - 1 else 0.0
    # The backward's working set: one layer's activation gradients plus a layer's weight gradient (bf16,
    # before it is added into the fp32 main grads); with full recompute, the layer rebuilt for its backward.
    grad_work = running * 0.5 + 2 * shape.layer_matmul_params() / layout.tp
    if layout.sharding in FSDP_NAMES:  # a layer's fp32 gradients before their reduce-scatter
        grad_work += 4 * shape.layer_matmul_params() / layout.tp
    if layout.sharding == "optimizer_grads_params":  # two layers' weights gathered (the one in use, the next)
        grad_work += 2 * 2 * shape.layer_matmul_params() / layout.tp
    if layout.recompute == "full":
        grad_work += running
    # The optimizer step (torch AdamW, foreach): one fp32 temporary per parameter of its shard (the second
    # moment's square root): measured 4.02-4.04 bytes per parameter on one H200 (llama3-8b's width, 4 and 8
    # layers, seq 4096, where the step is the peak; 5 bytes overestimated those by 4 %).
    step_work = 4.0 * n / optimizer_shard(layout)
    # The loss peaks before the layers' backward begins and is freed by then: the peak is the larger of the two
    # (measured: no layer's gradient is alive at the peak of any case of docs/results.md "The memory model at TP 1").
    transient = max(0.0, grad_work - logits)
    if step_work > acts + logits + transient:  # the step runs after the activations are freed
        transient, acts, logits = step_work, 0.0, 0.0
    fp8_weights = 2.0 * layers * shape.layer_matmul_params() / layout.tp if layout.fp8 else 0.0
    return MemoryEstimate(params=wb * n, grads=gb * n, optimizer=ob * n, activations=acts, logits=logits,
                          transient=transient, stage=stage, fp8_weights=fp8_weights)


def loss_bytes(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """The output layer and the loss of one micro-batch at their peak (last stage): the final norm's output
    (the output layer's input; its input is the last layer's output), the bf16 logits, the fp32 copy Megatron's
    cross entropy makes and, torch.compile'd (`training.fused_kernels`, bf16), the exponentials it then
    cannot write over that copy: 2 + 4 + 4 bytes per logit, 2 + 4 unfused. Measured on one H200, llama3-8b's
    width at TP 1: 2004 + 4008 + 4008 MiB alive at the peak (8192 tokens), 6012 MiB unfused; at micro-batch
    2, twice that (docs/results.md, "The memory model at TP 1"). 6 bytes for the fused loss were 3.9 GiB short at
    TP 1 (the 8B), which the activations' overcount hid. liger's fused loss (TP 1): fused_loss_bytes."""
    if layout.fused_loss and layout.tp == 1:
        return fused_loss_bytes(shape, tokens)
    sp = layout.sequence_parallel and layout.tp > 1
    per_logit = 10 if layout.fused and layout.precision in ("bf16", "fp8") else 6
    vocab = shape.padded_vocab(layout.tp) / layout.tp
    return tokens * (2 * shape.hidden / (layout.tp if sp else 1) + per_logit * vocab)


def fused_loss_bytes(shape: ModelShape, tokens: float) -> float:
    """megalaunch's fused linear cross entropy (runtime/model/liger_layers.py) at its peak, the start of its
    backward: the input's gradient, computed in the forward and kept (2 h per token), and the weight's gradient,
    summed in fp32 (vocabulary x h x 4) and cast to bf16 there (x 2 more); no [tokens x vocabulary] tensor.
    Its forward holds the 4-byte sum, the input and its gradient (2 h each), an fp32 loss per token and one
    chunk of CHUNK_ROWS rows of bf16 logits: the larger only for a narrow model. Measured on one H200 (llama3-8b's
    width, TP 1): 2004 + 1002 + 64 MiB alive at the peak (8192 tokens), + 64 at micro-batch 2; the whole model's
    estimate within 0.7 % of every peak measured with it, llama3-1b and 8B (docs/results.md, "The memory model at
    TP 1")."""
    from megalaunch.runtime.model.liger_layers import CHUNK_ROWS

    vocab, h = shape.padded_vocab(1), shape.hidden
    backward = 6 * vocab * h + 2 * h * tokens
    forward = 4 * vocab * h + tokens * (4 * h + 4) + 2 * min(CHUNK_ROWS, tokens) * vocab
    return max(backward, forward)


def estimate(shape: ModelShape, layout: Layout) -> MemoryEstimate:
    """The estimate of the most loaded pipeline stage (first and last differ: embedding, logits, in-flight)."""
    stages = {0, layout.pp - 1}
    return max((estimate_stage(shape, layout, s) for s in stages), key=lambda e: e.total)
