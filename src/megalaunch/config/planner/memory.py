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
were never kept (-0.14 GiB a layer at TP 1).

Mixture-of-experts models (config/planner/moe.py, with the arithmetic): the routed experts' weights, gradients and
optimizer state per GPU divided over EP x expert TP, their optimizer state over the expert data-parallel group
(world / (ETP x EP x PP)); an MoE layer's MLP activations (router, shared expert, routed tokens and the dispatch
buffers) in place of the dense MLP's; the attention, the norms (QK-norm's over the head size) and dense layers as
above, with the head size `kv_channels` where the model gives it."""

from __future__ import annotations

from dataclasses import dataclass

from megalaunch.config.planner.gpus import GIB
from megalaunch.config.planner.moe import expert_params_per_gpu, expert_shard, moe_mlp_bytes
from megalaunch.config.planner.shape import FSDP_NAMES, Layout, ModelShape

__all__ = ["FSDP_NAMES", "Layout", "MemoryEstimate", "ModelShape", "estimate", "optimizer_shard"]

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




def optimizer_shard(layout: Layout) -> int:
    """Over how many ranks the optimizer state is split (Megatron-FSDP always splits it)."""
    return layout.dp * layout.cp if layout.distributed_optimizer or layout.sharding in FSDP_NAMES else 1


def _bytes_per_param(layout: Layout, shard: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter held by a rank. Megatron-FSDP splits the fp32 main
    gradients too (ZeRO-2) and the weights (ZeRO-3): measured on llama3-8b, TP 1 x DP 4 on H200s, ZeRO-3 held
    34.0 GiB less than the distributed optimizer (73.2 against 107.2), where weights and gradients / 4 predict
    33.7 (docs/results.md). `shard`: optimizer_shard, or the experts' (config/planner/moe.py)."""
    w, g, o = (4.0, 4.0, 8.0) if layout.precision == "fp32" else (2.0, 4.0, 12.0)  # fp32: no master copy
    if layout.sharding in FSDP_NAMES:
        g /= shard
    if layout.sharding == "optimizer_grads_params":
        w /= shard
    return w, g, o / shard


def stage_params(shape: ModelShape, layout: Layout, stage: int) -> int:
    """Parameters held by one TP rank of pipeline stage `stage`, the routed experts left out (moe.py)."""
    tp, pp = layout.tp, layout.pp
    dense, moe = shape.stage_layers(pp, stage)
    norms = shape.layer_norm_params()
    n = dense * ((shape.attn_params + shape.mlp_params(shape.ffn)) // tp + norms)
    n += moe * (shape.moe_tp_params // tp + shape.router_params + norms)
    emb = shape.padded_vocab(tp) * shape.hidden // tp
    if stage == 0:
        n += emb
    if stage == pp - 1:
        n += shape.hidden  # final norm
        if not shape.tied or pp > 1:  # with PP a tied output layer keeps its own copy on the last stage
            n += emb
    return n


def layer_activation_bytes(shape: ModelShape, layout: Layout, moe: bool = False) -> tuple[float, float]:
    """(bytes one layer keeps for its backward, bytes it holds while it runs) per micro-batch on one GPU; `moe`:
    an MoE layer's, its MLP part moe.py's `moe_mlp_bytes`."""
    tokens = layout.micro_batch * shape.seq / layout.cp
    t = layout.tp
    sp = layout.sequence_parallel and t > 1
    rep = shape.hidden * 4 / (t if sp else 1)
    q, kv = shape.q_size, shape.kv_size
    mlp = 0 if moe else ((3 if layout.fused else 5) if shape.swiglu else 2) * shape.ffn
    sharded = ((q + 2 * kv) + (q + kv) + q + qk_norm_copy(shape) + mlp) / t
    full = (rep + sharded) * 2 * tokens + (moe_mlp_bytes(shape, layout) if moe else 0.0)
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
                                               - (0 if moe else shape.ffn) / t)
    return full, running


def qk_norm_copy(shape: ModelShape) -> int:
    """Elements per token the query norm (`qk_layernorm`) keeps beyond the terms above: with grouped KV heads
    Megatron reshapes the queries out of the QKV output into a copy (attention.py, get_query_key_value_tensors),
    which the norm saves for its backward; the keys stay views of the QKV output. Without the norm the copy only
    feeds RoPE, which keeps none. moe-3b (16 heads, 4 KV heads) on one H200: with it the estimate is 0.2-0.7 %
    under the peaks measured at micro-batches 4-16, without it 1.1-2.6 % (docs/results.md, "Mixture-of-experts")."""
    return shape.q_size if shape.qk_norm and shape.kv_heads < shape.heads and not shape.mla else 0


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
    dense_layers, moe_layers = shape.stage_layers(layout.pp, stage)
    ne = expert_params_per_gpu(shape, layout, moe_layers)  # the routed experts' (0 for a dense model)
    wb, gb, ob = _bytes_per_param(layout, optimizer_shard(layout))
    wbe, gbe, obe = _bytes_per_param(layout, expert_shard(layout))
    tokens = layout.micro_batch * shape.seq / layout.cp
    per_layer, running = layer_activation_bytes(shape, layout)
    layers = shape.layers // layout.pp
    acts = per_layer * dense_layers * in_flight(layout, stage)
    layer_weights = shape.layer_matmul_params() / layout.tp  # of the largest layer, per GPU
    if shape.moe:
        per_moe, running_moe = layer_activation_bytes(shape, layout, moe=True)
        acts += per_moe * moe_layers * in_flight(layout, stage)
        running = max(running if dense_layers else 0.0, running_moe if moe_layers else 0.0)
        layer_weights = max((shape.attn_params + shape.mlp_params(shape.ffn)) / layout.tp if dense_layers else 0.0,
                            shape.moe_tp_params / layout.tp + shape.router_params
                            + expert_params_per_gpu(shape, layout, 1) if moe_layers else 0.0)
    sp = layout.sequence_parallel and layout.tp > 1
    if stage == 0:  # embedding output (bf16) of each micro-batch in flight
        acts += 2 * shape.hidden * tokens / (layout.tp if sp else 1) * in_flight(layout, stage)
    logits = loss_bytes(shape, layout, tokens) if stage == layout.pp - 1 else 0.0
    # The backward's working set: one layer's activation gradients plus a layer's weight gradient (bf16,
    # before it is added into the fp32 main grads); with full recompute, the layer rebuilt for its backward.
    grad_work = running * 0.5 + 2 * layer_weights
    if layout.sharding in FSDP_NAMES:  # a layer's fp32 gradients before their reduce-scatter
        grad_work += 4 * layer_weights
    if layout.sharding == "optimizer_grads_params":  # two layers' weights gathered (the one in use, the next)
        grad_work += 2 * 2 * layer_weights
    if layout.recompute == "full":
        grad_work += running
    # The optimizer step (torch AdamW, foreach): one fp32 temporary per parameter of its shard (the second
    # moment's square root): measured 4.02-4.04 bytes per parameter on one H200 (llama3-8b's width, 4 and 8
    # layers, seq 4096, where the step is the peak; 5 bytes overestimated those by 4 %).
    step_work = 4.0 * (n / optimizer_shard(layout) + ne / expert_shard(layout))
    # The loss peaks before the layers' backward begins and is freed by then: the peak is the larger of the two
    # (measured: no layer's gradient is alive at the peak of any case of docs/results.md "The memory model at TP 1").
    transient = max(0.0, grad_work - logits)
    if step_work > acts + logits + transient:  # the step runs after the activations are freed
        transient, acts, logits = step_work, 0.0, 0.0
    fp8_weights = 2.0 * (layers * shape.layer_matmul_params() / layout.tp + ne) if layout.fp8 else 0.0
    return MemoryEstimate(params=wb * n + wbe * ne, grads=gb * n + gbe * ne, optimizer=ob * n + obe * ne,
                          activations=acts, logits=logits,
                          transient=transient, stage=stage, fp8_weights=fp8_weights)


def loss_bytes(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """The output layer and the loss of one micro-batch at their peak (last stage): the final norm's output
    (the output layer's input; its input is the last layer's output), the bf16 logits, the fp32 copy Megatron's
    cross entropy makes and, torch.compile'd (`training.fused_kernels`, bf16), the exponentials it then
    cannot write over that copy: 2 + 4 + 4 bytes per logit, 2 + 4 unfused. Measured on one H200, llama3-8b's
    width at TP 1: 2004 + 4008 + 4008 MiB alive at the peak (8192 tokens), 6012 MiB unfused; at micro-batch
    2, twice that (docs/results.md, "The memory model at TP 1"). 6 bytes for the fused loss were 3.9 GiB short at
    TP 1 (the 8B), which the activations' overcount hid. liger's fused loss at TP 1 (`layout.fused_loss`: where the
    job computes it, fit.liger_loss; `training.kernels` auto or liger on GPUs): fused_loss_bytes."""
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
