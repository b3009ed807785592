"""The experts' grouped GEMM: `x[T, K]` (the tokens of every local expert, sorted by expert) times each expert's
weight, stored as Megatron's linear layers store theirs (`w[E, N, K]`, out x in), in one call of torch's grouped
GEMM with `offs` (int32 cumulative group ends) and no host sync. Its backward is written here (torch's own
autograd of `grouped_mm` fails on the CPU): dx = grouped_mm(dy, w), dw[e] = dy_e^T x_e (grouped_mm's 2D x 2D
form, grouping the reduction axis).

Where torch has no grouped GEMM for the operands (older torch, strides not 16-byte aligned), each group is
computed on its own (`loop`): correct, with the host sync the grouped call avoids.

Heavy imports (torch) happen inside functions: importing this module is cheap."""

from __future__ import annotations

from typing import Any

ALIGN_BYTES = 16  # grouped_mm (CUTLASS on the GPU, and the CPU kernel) wants every non-unit stride 16-byte aligned


def grouped_mm_fn() -> Any:
    """torch's grouped GEMM (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`), or None."""
    import torch

    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _aligned(*tensors: Any) -> bool:
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % ALIGN_BYTES or any(s != 1 and (s * size) % ALIGN_BYTES for s in t.stride()):
            return False
    return True


def shapes_fit(hidden: int, ffn: int, dtype: Any) -> bool:
    """Whether the experts' operands (rows of `hidden` and of `ffn` and twice `ffn` values) have the aligned
    strides grouped_mm needs, for this dtype."""
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    return all((n * size) % ALIGN_BYTES == 0 for n in (hidden, ffn))


def _sizes(offs: Any) -> list[int]:
    ends = offs.tolist()  # the loop's host sync
    return [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _mm(a: Any, b: Any, offs: Any, grouped: bool) -> Any:
    """a[T, K] @ b[E, K, N] per group of rows: [T, N]."""
    fn = grouped_mm_fn() if grouped else None
    if fn is not None and _aligned(a, b):
        return fn(a, b, offs=offs)
    import torch

    parts = [chunk @ b[e] for e, chunk in enumerate(torch.split(a, _sizes(offs)))]
    return torch.cat(parts) if parts else a.new_empty((0, b.shape[-1]))


def _wgrad(dy: Any, x: Any, offs: Any, grouped: bool) -> Any:
    """dy[T, N]^T @ x[T, K] per group of rows: [E, N, K] (zeros for an empty group)."""
    import torch

    fn = grouped_mm_fn() if grouped else None
    dyt = dy.t()
    if fn is not None and x.shape[0] > 0 and _aligned(dyt, x):
        return fn(dyt, x, offs=offs)
    out = torch.zeros((offs.shape[0], dy.shape[1], x.shape[1]), dtype=dy.dtype, device=dy.device)
    start = 0
    for e, n in enumerate(_sizes(offs)):
        if n:
            out[e] = dyt[:, start:start + n] @ x[start:start + n]
        start += n
    return out


def _function() -> Any:
    import torch

    class GroupedGemm(torch.autograd.Function):
        """y[T, N] = x[T, K] @ w[e]^T for the rows of group e (w: [E, N, K])."""

        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, offs: Any, grouped: bool) -> Any:
            ctx.save_for_backward(x, w, offs)
            ctx.grouped = grouped
            return _mm(x, w.transpose(1, 2), offs, grouped)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            x, w, offs = ctx.saved_tensors
            dy = dy.contiguous()
            dx = _mm(dy, w, offs, ctx.grouped) if ctx.needs_input_grad[0] else None
            dw = _wgrad(dy, x, offs, ctx.grouped) if ctx.needs_input_grad[1] else None
            return dx, dw, None, None

    return GroupedGemm


_FUNCTION: list[Any] = []


def gmm(x: Any, w: Any, offs: Any, grouped: bool = True) -> Any:
    """x[T, K] @ w[e]^T for each group of rows (`offs`: int32 cumulative group ends, one per expert of `w`
    [E, N, K]), differentiable in x and w. `grouped=False` computes the groups one by one (the reference)."""
    if not _FUNCTION:
        _FUNCTION.append(_function())
    if x.data_ptr() % ALIGN_BYTES:
        x = x.clone()  # a fresh allocation is aligned; a view into another tensor may not be
    return _FUNCTION[0].apply(x.contiguous(), w, offs, grouped)
