"""liger-kernel's Triton kernels in Megatron's local layers (`training.kernels: liger`; runtime/model/kernels.py
decides which ops). Each replacement keeps Megatron's parameters and their names, so checkpoints do not
depend on the choice:

- RMSNorm: `LigerRMSNorm` (parameter `weight`, like torch's) built where Megatron's torch norm would be,
  with the weights marked `sequence_parallel` as megalaunch's own sequence-parallel norm does (norms.py);
- RoPE: Megatron's single-QKV rotary seam (`fused_single_qkv_rope`, which otherwise needs
  transformer-engine) filled with liger's rotation of q and k in one kernel;
- SwiGLU: an MLP whose activation is liger's fused gate-up SiLU x up over fc1's output;
- output layer + cross entropy: a GPTModel whose loss comes from liger's fused linear cross entropy,
  chunk by chunk, never materialising the [tokens x vocabulary] logits (TP 1 only: the vocabulary whole).

Heavy imports happen inside functions: importing this module is cheap. Classes are built once, lazily."""

from __future__ import annotations

import functools
from typing import Any

IGNORE_INDEX = -100  # liger's default: a label the loss skips (where the loss mask is 0)


@functools.cache
def norm_class() -> type:
    """LigerRMSNorm where Megatron's local spec puts its torch norm (a `__new__` factory, like norms.py's)."""

    class LigerNorm:
        def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                    zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> Any:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm

            if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
                raise ValueError("training.kernels: liger's norm is RMSNorm without zero-centred gamma")
            # fp32 inside, like torch's fused RMSNorm; in_place=False: the upstream gradient stays intact
            norm = LigerRMSNorm(hidden_size, eps=eps, casting_mode="gemma", in_place=False)
            for param in norm.parameters():
                param.sequence_parallel = bool(config.sequence_parallel)
            return norm

    return LigerNorm


def rope_qkv(mixed_qkv: Any, q_pos_emb: Any, k_pos_emb: Any, split: list[int]) -> tuple[Any, Any, Any]:
    """Megatron's `apply_fused_qkv_rotary_pos_emb`: [s, b, groups, (heads/group + 2) x d] -> rotated q
    [s, b, heads, d], rotated k and v [s, b, groups, d]; freqs are Megatron's [s, 1, 1, d] (rotate-half)."""
    import torch
    from liger_kernel.ops.rope import LigerRopeFunction

    s, b, groups, _ = mixed_qkv.shape
    d = split[1]
    query, key, value = torch.split(mixed_qkv, split, dim=3)
    query = query.reshape(s, b, -1, d)
    # liger's layout is [batch, heads, seq, d] over [batch, seq, heads, d] memory: [s, b] is one batch of
    # s x b rows, each row's angle that of its position s (cos/sin repeated over b)
    cos, sin = (_angles(q_pos_emb, b, f) for f in (torch.cos, torch.sin))
    q, k = (t.contiguous().view(1, s * b, -1, d).transpose(1, 2) for t in (query, key))
    if k_pos_emb is not q_pos_emb and not torch.equal(k_pos_emb, q_pos_emb):
        raise ValueError("training.kernels: liger's rotary embedding needs the same angles for q and k")
    q, k = LigerRopeFunction.apply(q, k, cos, sin)
    return q.transpose(1, 2).view(s, b, -1, d), k.transpose(1, 2).view(s, b, groups, d), value


def _angles(freqs: Any, b: int, fn: Any) -> Any:
    s, d = freqs.shape[0], freqs.shape[-1]
    return fn(freqs.reshape(s, 1, d).float()).expand(s, b, d).reshape(1, s * b, d)


def install_rope() -> None:
    """Point Megatron's single-QKV rotary seam at `rope_qkv` (models with `fused_single_qkv_rope` only)."""
    from megatron.core.transformer import attention

    attention.apply_fused_qkv_rotary_pos_emb = rope_qkv
    attention.HAVE_FUSED_QKV_ROPE = True


@functools.cache
def mlp_class() -> type:
    """Megatron's MLP with liger's fused SwiGLU between fc1 and fc2 (dense, gated; else Megatron's)."""
    import torch.nn.functional as F
    from megatron.core.transformer.mlp import MLP

    class LigerSwiGLUMLP(MLP):
        def forward(self, hidden_states: Any, per_token_scale: Any = None, **kwargs: Any) -> Any:
            if per_token_scale is not None or not self.config.gated_linear_unit or self.activation_func is not F.silu:
                return super().forward(hidden_states, per_token_scale, **kwargs)
            intermediate, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                intermediate = intermediate + bias
            return self.linear_fc2(swiglu(intermediate))

    return LigerSwiGLUMLP


def swiglu(y: Any) -> Any:
    """silu(gate) x up over [..., 2 x ffn] (gate first, as Megatron's fc1 lays it out) in liger's one kernel;
    2-D for the kernel, whose backward gives the gradient in its own [rows, 2 x ffn] shape."""
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    out = LigerFusedGateUpSiLUMulFunction.apply(y.reshape(-1, y.shape[-1]))
    return out.view(*y.shape[:-1], y.shape[-1] // 2)


def with_liger_mlp(mlp: Any) -> Any:
    """A layer spec's `mlp` entry with liger's MLP for Megatron's (a ModuleSpec, or the partial of
    `MLP.as_mlp_submodule` that Megatron 0.19's local spec holds); anything else is left as it is."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    cls = mlp_class()
    if isinstance(mlp, functools.partial) and getattr(mlp.func, "__self__", None) is MLP:
        return functools.partial(getattr(cls, mlp.func.__name__), *mlp.args, **mlp.keywords)
    if isinstance(mlp, ModuleSpec) and mlp.module is MLP:
        mlp.module = cls
    return mlp


@functools.cache
def gpt_model_class() -> type:
    """GPTModel whose training loss is liger's fused linear cross entropy (no logits tensor). With labels,
    `forward` returns [b, s] whose masked sum is the summed loss (what step.loss_func computes): each
    counted token carries the mean, so the gradient is liger's, computed in the forward pass."""
    from megatron.core.models.gpt import GPTModel

    class LigerLossGPTModel(GPTModel):
        _fuse_loss = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if getattr(self, "output_layer", None) is not None:
                _defer_output(self)

        def forward(self, *args: Any, labels: Any = None, **kwargs: Any) -> Any:
            self._fuse_loss = labels is not None and self.training
            try:
                return super().forward(*args, labels=labels, **kwargs)
            finally:
                self._fuse_loss = False

        def compute_language_model_loss(self, labels: Any, logits: Any) -> Any:
            if not isinstance(logits, _Deferred):
                return super().compute_language_model_loss(labels, logits)
            return fused_loss(logits.hidden, logits.weight, labels)

    return LigerLossGPTModel


class _Deferred:
    """The output layer's input and weight, for the loss to multiply chunk by chunk."""

    def __init__(self, hidden: Any, weight: Any) -> None:
        self.hidden, self.weight = hidden, weight

    def transpose(self, *dims: Any) -> Any:  # only a bug would read these as logits
        raise RuntimeError("liger's fused loss deferred the logits; nothing may read them")


def _defer_output(model: Any) -> None:
    layer = model.output_layer
    plain = layer.forward

    def forward(hidden: Any, weight: Any = None, runtime_gather_output: Any = None) -> Any:
        if not model._fuse_loss:
            return plain(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
        return _Deferred(hidden, layer.weight if weight is None else weight), None

    layer.forward = forward
    model._scale_logits = lambda logits: logits if isinstance(logits, _Deferred) else type(model)._scale_logits(
        model, logits)


def fused_loss(hidden: Any, weight: Any, labels: Any) -> Any:
    """[b, s] losses from hidden [s, b, h], weight [vocab, h] and labels [b, s] (IGNORE_INDEX skipped)."""
    s, b, h = hidden.shape
    flat_labels = labels.transpose(0, 1).reshape(-1)  # [s*b], the rows' order of hidden
    function: Any = linear_ce_function()
    total = function.apply(hidden.reshape(s * b, h), weight, flat_labels.contiguous(), CHUNK_ROWS)
    counted = (labels != IGNORE_INDEX).float()
    return counted * (total.float() / counted.sum().clamp(min=1.0))


CHUNK_ROWS = 1024  # rows of logits per chunk: liger's default (logits no bigger than the input) makes
                   # 32-64-row matmuls for a 128k vocabulary, far from the GPU's speed (bench/kernels.py)


@functools.cache
def linear_ce_function() -> type:
    """The output layer's matmul and the cross entropy, summed over the rows not labelled IGNORE_INDEX,
    `chunk` rows of logits at a time: liger's cross-entropy kernel turns each chunk's logits into their
    gradient in place, and both matmul gradients are taken from it in the forward pass.

    megalaunch's loop around liger's kernel, not liger's LigerFusedLinearCrossEntropyFunction: that one
    waits for the GPU twice per call (the count of labelled rows, `.item()`, and `torch.equal` on the
    incoming gradient), which stalls the CPU's queue of kernels once per micro-batch (bench/kernels.py
    measured it slower than Megatron's at micro-batch 2). The weight's gradient adds up in fp32 on Ampere+ GPUs."""
    import torch
    from liger_kernel.ops import cross_entropy

    from megalaunch.runtime.model.wgrad_fusion import fp32_output_matmul

    class LinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, target: Any, chunk: int) -> Any:
            rows, vocab = x.shape[0], weight.shape[0]
            losses = torch.zeros(rows, dtype=torch.float32, device=x.device)
            grad_x = torch.empty_like(x)
            fp32_sum = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and fp32_output_matmul(x.device)
            grad_w = (torch.zeros(weight.shape, dtype=torch.float32 if fp32_sum else weight.dtype, device=x.device)
                      if weight.requires_grad else None)
            logits = torch.empty(min(chunk, rows), vocab, dtype=x.dtype, device=x.device)
            for start in range(0, rows, chunk):
                end = min(start + chunk, rows)
                part, rows_x = logits[: end - start], x[start:end]
                torch.mm(rows_x, weight.t(), out=part)
                ce_rows(cross_entropy, part, target[start:end], losses[start:end])  # part: its gradient now
                torch.mm(part, weight, out=grad_x[start:end])
                if grad_w is not None and fp32_sum:
                    torch.addmm(grad_w, part.t(), rows_x, out_dtype=torch.float32, out=grad_w)
                elif grad_w is not None:
                    grad_w.addmm_(part.t(), rows_x)
            ctx.save_for_backward(grad_x, grad_w)
            return losses.sum()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            grad_x, grad_w = ctx.saved_tensors  # scaled on the GPU: no test of grad == 1 (a host sync)
            return grad_x.mul_(grad.to(grad_x.dtype)), None if grad_w is None else grad_w.mul_(grad).to(grad_x.dtype), None, None

    return LinearCrossEntropy


def ce_rows(module: Any, logits: Any, target: Any, losses: Any) -> None:
    """liger's cross-entropy kernel over [rows, vocab] logits: each labelled row's loss into `losses`, and
    its logits replaced by their gradient (softmax - one-hot; zero for an IGNORE_INDEX row), reduction sum."""
    import triton

    vocab = logits.shape[1]
    module.liger_cross_entropy_kernel[(logits.shape[0],)](
        X_ptr=logits, X_stride=logits.stride(-2), Y_ptr=target, Y_stride=target.stride(-1), weight_ptr=None,
        loss_ptr=losses, z_loss_ptr=None, loss_stride=losses.stride(-1), token_accuracy_ptr=None,
        token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=vocab, n_non_ignore=1,
        sum_non_ignore_weight=1, weight_sum=0.0, ignore_index=IGNORE_INDEX, lse_square_scale=0.0, label_smoothing=0.0,
        reduction="sum", softcap=None, RETURN_Z_LOSS=False, RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
        HAS_WEIGHT=False, HAS_SOFTCAPPING=False, HAS_GRADIENTS=True,
        BLOCK_SIZE=min(module.MAX_FUSED_SIZE, triton.next_power_of_2(vocab)), num_warps=32)
