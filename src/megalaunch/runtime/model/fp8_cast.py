"""FP8 casts in two passes over a 2-D tensor, each operand in both layouts at once: one kernel takes the amax
(an atomic max per block), a second writes the scaled values row-major and transposed (the layout the other
GEMM of the pair needs: `_scaled_mm` wants its second operand column-major). A linear layer then casts each of
its input, weight and output gradient once per micro-batch, not once per GEMM, and keeps the FP8 input (not the
bf16 one) for its weight gradient.
- tensorwise: one amax, one scale for both layouts;
- rowwise: the scales run along each GEMM's reduction, so the row-major layout is scaled per row and the
  transposed one per column of the tensor: the amax kernel takes both vectors in one read (atomic maxima per
  row and per column of each tile), the cast kernel applies each to its layout.

The kernels are Triton's (CUDA: the CPU tests compile them to PTX, tests/gpu/test_fp8_gpu.py compares them with
torch bit for bit on a GPU); `cast_both_torch` is the same computation in torch ops, which the CPU path uses. Measured against torch.compile'd casts in
docs/results.md ("FP8 without transformer-engine").

Heavy imports (torch, triton) happen inside functions: importing this module is cheap."""

from __future__ import annotations

from typing import Any

from megalaunch.runtime.model.fp8 import EPS, quantize

_KERNELS: dict[str, Any] = {}
AMAX_BLOCK = 4096
TILE = 64  # the cast kernel's square tile: a transposed store stays within one tile


def cast_both_torch(t: Any, dtype: Any, rowwise: bool = False) -> tuple[Any, Any, Any, Any]:
    """(t scaled into `dtype`, its transpose as a contiguous tensor, the inverse scale of each), in torch ops.
    Tensorwise: one scalar for both; rowwise: (rows, 1) and (cols, 1), each along its layout's rows."""
    if rowwise:
        q, inv = quantize(t, dtype, rowwise=True)
        qt, inv_t = quantize(t.t(), dtype, rowwise=True)
        return q, qt, inv, inv_t
    q, inv = quantize(t, dtype, rowwise=False)
    return q, q.t().contiguous(), inv, inv


def _kernels() -> tuple[Any, Any]:
    """Tensorwise: the amax of the whole tensor (an atomic max per block), then both layouts with one scale."""
    if "amax" not in _KERNELS:
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
            scale = tl.math.div_rn(FMAX, tl.maximum(tl.load(amax_ptr), EPS))
            y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + r[:, None] * cols + c[None, :], y, mask=mask)
            tl.store(qt_ptr + c[None, :] * rows + r[:, None], y, mask=mask)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(inv_ptr, tl.math.div_rn(1.0, scale))

        # (no annotations on the kernels' arguments: Triton reads them, and `Any` is not one of its types.
        # Divisions are IEEE (div_rn): Triton's `/` is div.full.f32, approximate, and a scale 1-2 ulp off torch's
        # moved a few e4m3 values across a rounding boundary on an H200.)
        _KERNELS.update(amax=amax_kernel, cast=cast_kernel)
    return _KERNELS["amax"], _KERNELS["cast"]


def _rowwise_kernels() -> tuple[Any, Any]:
    """Rowwise: the amax of every row and every column in one read, then each layout cast with its own scales
    (the row-major one per row, the transposed one per column of the tensor). Divisions as in _kernels."""
    if "amax_rc" not in _KERNELS:
        import triton
        import triton.language as tl

        @triton.jit
        def amax_rc_kernel(x_ptr, ramax_ptr, camax_ptr, rows, cols, T: tl.constexpr):  # type: ignore[no-untyped-def]
            r = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
            c = tl.program_id(1).to(tl.int64) * T + tl.arange(0, T)
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            a = tl.abs(tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32))
            tl.atomic_max(ramax_ptr + r, tl.max(a, axis=1), mask=r < rows)
            tl.atomic_max(camax_ptr + c, tl.max(a, axis=0), mask=c < cols)

        @triton.jit
        def cast_rc_kernel(x_ptr, q_ptr, qt_ptr, ramax_ptr, camax_ptr, rinv_ptr, cinv_ptr,  # type: ignore[no-untyped-def]
                           rows, cols, FMAX: tl.constexpr, EPS: tl.constexpr, T: tl.constexpr):
            r = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
            c = tl.program_id(1).to(tl.int64) * T + tl.arange(0, T)
            mask = (r[:, None] < rows) & (c[None, :] < cols)
            x = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)
            rscale = tl.math.div_rn(FMAX, tl.maximum(tl.load(ramax_ptr + r, mask=r < rows, other=1.0), EPS))
            cscale = tl.math.div_rn(FMAX, tl.maximum(tl.load(camax_ptr + c, mask=c < cols, other=1.0), EPS))
            y = tl.minimum(tl.maximum(x * rscale[:, None], -FMAX), FMAX).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + r[:, None] * cols + c[None, :], y, mask=mask)
            yt = tl.minimum(tl.maximum(x * cscale[None, :], -FMAX), FMAX).to(qt_ptr.dtype.element_ty)
            tl.store(qt_ptr + c[None, :] * rows + r[:, None], yt, mask=mask)
            if tl.program_id(1) == 0:
                tl.store(rinv_ptr + r, tl.math.div_rn(1.0, rscale), mask=r < rows)
            if tl.program_id(0) == 0:
                tl.store(cinv_ptr + c, tl.math.div_rn(1.0, cscale), mask=c < cols)

        _KERNELS.update(amax_rc=amax_rc_kernel, cast_rc=cast_rc_kernel)
    return _KERNELS["amax_rc"], _KERNELS["cast_rc"]


def cast_both_triton(t: Any, dtype: Any, rowwise: bool = False) -> tuple[Any, Any, Any, Any]:
    """cast_both_torch's result from the two Triton kernels (`t`: 2-D; made contiguous first)."""
    import torch
    import triton

    t = t.contiguous()
    rows, cols = t.shape
    q = torch.empty((rows, cols), dtype=dtype, device=t.device)
    qt = torch.empty((cols, rows), dtype=dtype, device=t.device)
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
    fmax = float(torch.finfo(dtype).max)
    if rowwise:
        amax_rc, cast_rc = _rowwise_kernels()
        ramax = torch.zeros(rows, dtype=torch.float32, device=t.device)
        camax = torch.zeros(cols, dtype=torch.float32, device=t.device)
        rinv = torch.empty((rows, 1), dtype=torch.float32, device=t.device)
        cinv = torch.empty((cols, 1), dtype=torch.float32, device=t.device)
        amax_rc[grid](t, ramax, camax, rows, cols, T=TILE)
        cast_rc[grid](t, q, qt, ramax, camax, rinv, cinv, rows, cols, FMAX=fmax, EPS=EPS, T=TILE)
        return q, qt, rinv, cinv
    amax_kernel, cast_kernel = _kernels()
    amax = torch.zeros(1, dtype=torch.float32, device=t.device)
    inv = torch.empty((), dtype=torch.float32, device=t.device)
    amax_kernel[(triton.cdiv(t.numel(), AMAX_BLOCK),)](t, amax, t.numel(), BLOCK=AMAX_BLOCK)
    cast_kernel[grid](t, q, qt, amax, inv, rows, cols, FMAX=fmax, EPS=EPS, T=TILE)
    return q, qt, inv, inv


def cast_both(t: Any, dtype: Any, *, triton: bool, rowwise: bool = False) -> tuple[Any, Any, Any, Any]:
    """(q, its transpose, q's inverse scale, the transpose's): see cast_both_torch."""
    return (cast_both_triton if triton else cast_both_torch)(t, dtype, rowwise)
