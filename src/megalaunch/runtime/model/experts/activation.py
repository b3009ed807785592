"""The experts' SwiGLU times the routing probabilities as one fused function on the GPU: forward
`silu(gate) * up * probs` and a backward that writes the gate and up gradients into one buffer (the unfused path's
autograd of `chunk` concatenates them: `cat` was ~6 % of a fine-grained MoE step on an H200, docs/results.md) and
the probabilities' gradient by one reduction; computed in fp32, rounded once. torch.compile fuses each direction
into one or two kernels.

Used by GroupedExperts (runtime/model/experts/grouped.py) for Megatron's plain SwiGLU (silu, no clamp, no linear
offset) on CUDA tensors; everything else, and `MEGALAUNCH_MOE_FUSED=off`, takes MLP's unfused arithmetic
(`grouped.glu`). Heavy imports (torch) happen inside functions: importing this module is cheap."""

from __future__ import annotations

import os
from typing import Any

_FUNCTION: list[Any] = []


def fusion_on() -> bool:
    """`MEGALAUNCH_MOE_FUSED=off` turns the fused expert paths (this and experts/permute.py) off, for comparisons."""
    return os.environ.get("MEGALAUNCH_MOE_FUSED", "on").strip().lower() not in ("off", "0", "false", "no")


def applies(h: Any, config: Any) -> bool:
    import torch.nn.functional as F

    return bool(h.is_cuda and config.gated_linear_unit and config.activation_func is F.silu
                and getattr(config, "activation_func_clamp_value", None) is None
                and not getattr(config, "glu_linear_offset", 0.0) and fusion_on())


def _kernels(dynamic: bool | None = None) -> tuple[Any, Any]:
    """The compiled forward and backward. `dynamic` is torch.compile's: None (used) compiles for the first call's row
    count, then for any row count once it changes (EP > 1: an EP rank receives a different count each micro-batch),
    the width always fixed; True makes the width symbolic too. On an H200, forward + backward (bench/moe_ops.py):
    moe-3b's 524k rows of ffn 768 2.73 ms static, 2.88 with the rows marked dynamic, 7.11 with dynamic=True; a
    Mixtral-like 16k rows of 14336 1.59 ms static, 3.93 with the rows marked dynamic."""
    import torch
    import torch.nn.functional as F

    def wide(t: Any) -> Any:  # bf16 / fp16 computed in fp32; fp32 and fp64 as they are
        return t.float() if t.element_size() < 4 else t

    def forward(h: Any, probs: Any) -> Any:
        gate, up = wide(h).chunk(2, dim=-1)
        return (F.silu(gate) * up * wide(probs).unsqueeze(-1)).to(h.dtype)

    def backward(grad: Any, h: Any, probs: Any) -> tuple[Any, Any]:
        gate, up = wide(h).chunk(2, dim=-1)
        g = wide(grad)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        dprobs = (silu * up * g).sum(-1)
        gp = g * wide(probs).unsqueeze(-1)
        dgate = gp * up * sig * (1.0 + gate * (1.0 - sig))
        return torch.cat([dgate, gp * silu], dim=-1).to(h.dtype), dprobs.to(probs.dtype)

    return torch.compile(forward, dynamic=dynamic), torch.compile(backward, dynamic=dynamic)


def _function() -> Any:
    import torch

    fwd, bwd = _kernels()

    class SwiGLUProbs(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: Any, probs: Any) -> Any:
            ctx.save_for_backward(h, probs)
            return fwd(h, probs)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, Any]:
            h, probs = ctx.saved_tensors
            return bwd(grad.contiguous(), h, probs)

    return SwiGLUProbs


def swiglu_probs(h: Any, probs: Any) -> Any:
    """silu(gate) * up * probs for h = [gate | up] ([rows, 2 F]) and probs [rows]: [rows, F] in h's dtype."""
    if not _FUNCTION:
        _FUNCTION.append(_function())
    return _FUNCTION[0].apply(h, probs)
