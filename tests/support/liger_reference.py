"""Plain-torch stand-ins for liger-kernel's Triton functions and its cross-entropy kernel, with liger's signatures and layouts, so that
megalaunch's wiring of them into Megatron (runtime/model/liger_layers.py) can be tested on the CPU: the layout
changes, the rotary seam, the deferred logits and the masked labels. The kernels themselves are compared
with Megatron's on the GPU (tests/gpu/test_kernels_gpu.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class RopeFunction(torch.autograd.Function):
    """liger's LigerRopeFunction: q [b, heads, s, d], k [b, kv heads, s, d], cos/sin [1, s, d]."""

    @staticmethod
    def forward(ctx: Any, q: Any, k: Any, cos: Any, sin: Any, *rest: Any) -> Any:
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    @staticmethod
    def backward(ctx: Any, dq: Any, dk: Any) -> Any:
        cos, sin = ctx.saved_tensors
        return _rotate(dq, cos, -sin), _rotate(dk, cos, -sin), None, None


def _rotate(t: Any, cos: Any, sin: Any) -> Any:
    c, s = cos.unsqueeze(1).to(t.dtype), sin.unsqueeze(1).to(t.dtype)
    x1, x2 = t.chunk(2, dim=-1)
    return t * c + torch.cat((-x2, x1), dim=-1) * s


class GateUpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Any) -> Any:
        gate, up = y.chunk(2, dim=-1)
        with torch.enable_grad():
            y_ = y.detach().requires_grad_()
            g, u = y_.chunk(2, dim=-1)
            out = F.silu(g) * u
        ctx.save_for_backward(y_, out)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, dc: Any) -> Any:
        y_, out = ctx.saved_tensors
        (dy,) = torch.autograd.grad(out, y_, dc)
        return dy


class CrossEntropyKernel:
    """liger's `liger_cross_entropy_kernel` as megalaunch launches it (`kernel[grid](**args)`, reduction sum,
    no class weights, smoothing or z-loss): each labelled row's loss into loss_ptr, and the logits in X_ptr
    replaced by their gradient (softmax - one-hot; zero for an ignored row)."""

    def __getitem__(self, grid: Any) -> Any:
        return self.run

    @staticmethod
    def run(*, X_ptr: Any, Y_ptr: Any, loss_ptr: Any, ignore_index: int, reduction: str, **unused: Any) -> None:
        assert reduction == "sum"
        logits, keep = X_ptr.float(), Y_ptr != ignore_index
        picked = Y_ptr.clamp(min=0).unsqueeze(1)
        loss_ptr.copy_(torch.where(keep, torch.logsumexp(logits, -1) - logits.gather(1, picked).squeeze(1), loss_ptr))
        grad = torch.softmax(logits, -1).scatter_add(1, picked, -torch.ones_like(picked, dtype=logits.dtype))
        X_ptr.copy_((grad * keep.unsqueeze(1)).to(X_ptr.dtype))


def rms_norm_forward(self: Any, x: Any) -> Any:
    return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.variance_epsilon).to(x.dtype)


def install(monkeypatch: Any) -> None:
    """Point liger's functions, where megalaunch reaches them, at these stand-ins."""
    from liger_kernel.ops import cross_entropy, rope, swiglu
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    monkeypatch.setattr(rope, "LigerRopeFunction", RopeFunction)
    monkeypatch.setattr(swiglu, "LigerFusedGateUpSiLUMulFunction", GateUpFunction)
    monkeypatch.setattr(cross_entropy, "liger_cross_entropy_kernel", CrossEntropyKernel())
    monkeypatch.setattr(LigerRMSNorm, "forward", rms_norm_forward)
