"""Tensorwise FP8 casts in two passes over a 2-D tensor, each operand in both layouts at once: one kernel
takes the amax (an atomic max per block), a second writes the scaled values row-major and transposed (the
layout the other GEMM of the pair needs: `_scaled_mm` wants its second operand column-major). A linear layer
then casts each of its input, weight and output gradient once per micro-batch, not once per GEMM, and keeps the
FP8 input (not the bf16 one) for its weight gradient.

The kernels are Triton's (CUDA; Triton's interpreter runs them on the CPU for the tests); `cast_both_torch` is
the same computation in torch ops, which the CPU path uses. Measured against torch.compile'd casts in
docs/results.md ("FP8 without transformer-engine").

Heavy imports (torch, triton) happen inside functions: importing this module is cheap."""

from __future__ import annotations

from typing import Any

from megalaunch.runtime.model.fp8 import EPS, quantize

_KERNELS: dict[str, Any] = {}
AMAX_BLOCK = 4096
TILE = 64  # the cast kernel's square tile: a transposed store stays within one tile


def cast_both_torch(t: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """(t scaled into `dtype`, its transpose as a contiguous tensor, the inverse scale), in torch ops."""
    q, inv = quantize(t, dtype, rowwise=False)
    return q, q.t().contiguous(), inv


def _kernels() -> tuple[Any, Any]:
    if not _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))

        @triton.jit
        def cast_kernel(x_ptr, q_ptr, qt_ptr, amax_ptr, inv_ptr, rows, cols,  # type: ignore[no-untyped-def]
                        FMAX: tl.constexpr, EPS: tl.constexpr, T: tl.constexpr):
            r = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
            c = tl.program_id(1).to(tl.int64) * T + tl.arange(0, T)
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            x = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
            scale = FMAX / tl.maximum(tl.load(amax_ptr), EPS)
            y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + r[:, None] * cols + c[None, :], y, mask=mask)
            tl.store(qt_ptr + c[None, :] * rows + r[:, None], y, mask=mask)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(inv_ptr, 1.0 / scale)

        # (no annotations on the kernels' arguments: Triton reads them, and `Any` is not one of its types)
        _KERNELS["amax"], _KERNELS["cast"] = amax_kernel, cast_kernel
    return _KERNELS["amax"], _KERNELS["cast"]


def cast_both_triton(t: Any, dtype: Any) -> tuple[Any, Any, Any]:
    """cast_both_torch's result from the two Triton kernels (`t`: 2-D; made contiguous first)."""
    import torch
    import triton

    amax_kernel, cast_kernel = _kernels()
    t = t.contiguous()
    rows, cols = t.shape
    amax = torch.zeros(1, dtype=torch.float32, device=t.device)
    inv = torch.empty((), dtype=torch.float32, device=t.device)
    q = torch.empty((rows, cols), dtype=dtype, device=t.device)
    qt = torch.empty((cols, rows), dtype=dtype, device=t.device)
    amax_kernel[(triton.cdiv(t.numel(), AMAX_BLOCK),)](t, amax, t.numel(), BLOCK=AMAX_BLOCK)
    cast_kernel[(triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))](
        t, q, qt, amax, inv, rows, cols, FMAX=float(torch.finfo(dtype).max), EPS=EPS, T=TILE)
    return q, qt, inv


def cast_both(t: Any, dtype: Any, *, triton: bool) -> tuple[Any, Any, Any]:
    return (cast_both_triton if triton else cast_both_torch)(t, dtype)
