"""The grouped experts in FP8 under `training.precision: fp8`: their three grouped GEMMs (forward, data gradient,
weight gradient) through torch's scaled grouped GEMM (`torch._scaled_grouped_mm`: CUTLASS on sm90 / sm100, FP8 e4m3
operands with float32 row-wise scales, bf16 out, the second operand column-major), quantised on the fly. The master
weights, their gradients and the checkpoint stay as under bf16 (nothing of FP8 is kept or saved).

The recipe is the dense path's `rowwise` one (runtime/model/fp8.py), whatever `training.fp8_recipe` says: e4m3 for
every operand (the kernel takes no e5m2, so tensorwise's e5m2 gradients cannot be had), dynamic scales from the
current amax (no history), one scale per row of each operand along its GEMM's reduction, the amax clamped at EPS,
values clamped at e4m3's largest (no inf), each activation cast once in both layouts by the dense path's Triton
kernels (runtime/model/fp8_cast.py), the FP8 input (not the bf16 one) kept for the weight gradient, the weight cast
once per optimizer step:
- forward  y[T, N]  = x[T, K] @ w[e]^T   x scaled per token, w per (expert, output row);
- dgrad    dx[T, K] = dy[T, N] @ w[e]    dy per token, w per (expert, input column): its transposed copy;
- wgrad    dw[e]    = dy_e^T @ x_e       dy^T per output row, x^T per input column, each over all tokens (the dense
  rowwise recipe's scales, the same for every expert's group), in the 2D x 2D form that groups the reduction.

The kernel wants every group's rows to start at a multiple of 16 (a device assert otherwise) and each GEMM dimension
a multiple of 16. Tokens per expert change every step and live on the GPU, so the experts' rows are laid out again
on the device, without a host sync (`layout`): each expert's group padded with zero rows to a multiple of 16 and
to at least 16 (an empty expert's wgrad then sums zeros instead of leaving its output unwritten), into a buffer
whose size is known from the shapes alone (T + 16 E, rounded up to 16); the last group runs to its end, so every row
belongs to a group. One scatter in (`pad`) and one gather out (`unpad`) per expert layer; padded rows are zeros in
both directions, so they add nothing to any gradient.

On the CPU (tests) the kernel is emulated in fp32 after the same operands pass torch's meta checks of
`_scaled_grouped_mm` (shapes, strides, dtypes, scale shapes). Heavy imports inside functions."""

from __future__ import annotations

from typing import Any, NamedTuple

from megalaunch.runtime.model.fp8 import ALIGN, EPS
from megalaunch.runtime.model.fp8_cast import cast_both

ROWS = 16  # _scaled_grouped_mm: every group's rows start at a multiple of 16 (FP8: 16 bytes)
OFF_ENV = "MEGALAUNCH_FP8_EXPERTS"  # "off": the grouped experts stay bf16 under precision fp8; "on": FP8 also when fine
# Where FP8 experts were measured faster than bf16 ones (one H200, forward + backward of one expert layer,
# tests/gpu/test_fp8_experts.py): Mixtral's experts (hidden 4096 x ffn 14336) x1.16, moe-3b's fine-grained ones
# (2048 x 768, 64 experts) x0.40 (the padding scatter, the casts and per-expert scales cost more than the GEMMs
# save at a few hundred rows per expert). Below this many elements per expert matrix they stay bf16 unless forced.
COARSE_ELEMENTS = 4096 * 4096


class Layout(NamedTuple):
    """Where each of the T expert-sorted rows goes in the padded buffer, and the buffer's group ends."""

    dest: Any   # [T] int64: the padded row of each row
    offs: Any   # [E] int32: cumulative padded group ends, multiples of 16, the last = rows
    rows: int   # the buffer's rows: T + 16 E rounded up to 16 (no host sync: shapes only)


def padded_rows(tokens: int, experts: int) -> int:
    return -(-(tokens + ROWS * experts) // ROWS) * ROWS


def layout(tokens_per_expert: Any, tokens: int) -> Layout:
    """The padded layout of `tokens` rows sorted by expert (`tokens_per_expert`: [E], on the rows' device), in
    device ops only (no `.tolist()`, no `.item()`)."""
    import torch

    counts = tokens_per_expert.to(torch.int64)
    rows = padded_rows(tokens, counts.shape[0])
    sizes = ((counts + ROWS - 1) // ROWS * ROWS).clamp(min=ROWS)
    pend = sizes.cumsum(0)
    end = counts.cumsum(0)
    shift = (pend - sizes) - (end - counts)  # each group's padded start minus its start
    token = torch.arange(tokens, device=counts.device)
    group = torch.searchsorted(end, token, right=True)  # the expert of each row (empty experts skipped)
    offs = torch.cat([pend[:-1], pend.new_full((1,), rows)]).to(torch.int32)
    return Layout(token + shift[group], offs, rows)


def pad(t: Any, lay: Layout) -> Any:
    """`t` ([T, ...]) in the padded layout, zeros between the groups (differentiable: its gradient is a gather)."""
    return t.new_zeros((lay.rows, *t.shape[1:])).index_copy(0, lay.dest, t)


def unpad(t: Any, lay: Layout) -> Any:
    return t.index_select(0, lay.dest)


def refusal(module: Any, capability: tuple[int, int] | None = None) -> str | None:
    """Why these grouped experts cannot take FP8 grouped GEMMs on this node (None: they can)."""
    import os

    import torch

    choice = os.environ.get(OFF_ENV, "").strip().lower()
    if choice in ("off", "0", "false", "no"):
        return f"{OFF_ENV}=off"
    w1, w2 = getattr(module, "weight1", None), getattr(module, "weight2", None)
    if w1 is None or w2 is None:
        return "no 3D expert weights"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return "this torch has no _scaled_grouped_mm"
    if w1.device.type != "cuda" and capability is None:
        return "torch's scaled grouped GEMM is CUDA-only"
    cap = capability or tuple(torch.cuda.get_device_capability(w1.device))
    if not (cap == (9, 0) or cap[0] == 10):
        return f"compute capability {cap[0]}.{cap[1]}: torch's scaled grouped GEMM runs on 9.0 and 10.x"
    if w1.dtype != torch.bfloat16:
        return f"weights in {w1.dtype}: the scaled grouped GEMM writes bf16 only"
    if not getattr(module, "grouped", True):
        return "torch's grouped GEMM cannot take these experts (see runtime/model/experts/gmm.py)"
    dims = (*w1.shape[1:], *w2.shape[1:])
    if any(d % ALIGN for d in dims):
        return f"expert dimensions {'x'.join(map(str, dims))}: FP8 grouped GEMMs need multiples of {ALIGN}"
    elements = int(w2.shape[1]) * int(w2.shape[2])
    if elements < COARSE_ELEMENTS and choice not in ("on", "1", "true", "yes"):
        return (f"fine-grained experts ({w2.shape[1]} x {w2.shape[2]} per expert, under {COARSE_ELEMENTS:,}): FP8 was "
                f"slower than bf16 there (x0.40 at moe-3b's shape on an H200); {OFF_ENV}=on forces it")
    return None


# --- the weights, cast once per optimizer step ------------------------------------------------------------------

_STEP = [0]  # bumped after every optimizer step (any torch optimizer): cached FP8 weights are stale
_HOOKED: list[bool] = []


def _stepped(*_: Any) -> None:
    _STEP[0] += 1


def rowwise_last(t: Any) -> tuple[Any, Any]:
    """`t` ([E, R, C], any strides) in e4m3 as a contiguous tensor with one scale per row along its last dimension,
    and the inverse scales [E, R] (runtime/model/fp8.py's `quantize`, row by row of each expert)."""
    import torch

    e4m3 = torch.float8_e4m3fn
    fmax = torch.finfo(e4m3).max
    amax = t.abs().float().amax(dim=-1, keepdim=True)
    scale = torch.full_like(amax, fmax).div_(amax.clamp(min=EPS))
    q = (t.float() * scale).clamp(-fmax, fmax).to(e4m3).contiguous()
    return q, scale.reciprocal().squeeze(-1).contiguous()


def weight_cast(w: Any) -> tuple[Any, Any, Any, Any]:
    """(w [E, N, K] scaled per row, its inverse scales [E, N], w^T [E, K, N] scaled per row, its [E, K]): cast once
    per optimizer step and kept on the parameter for the step's other micro-batches."""
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_stepped)
        _HOOKED.append(True)
    key = (_STEP[0], w.data_ptr(), w._version)
    cached = getattr(w, "_megalaunch_fp8_experts", None)
    if cached is not None and cached[0] == key:
        return cached[1]  # type: ignore[no-any-return]
    result = (*rowwise_last(w.detach()), *rowwise_last(w.detach().transpose(1, 2)))
    w._megalaunch_fp8_experts = (key, result)
    return result


# --- the kernel -------------------------------------------------------------------------------------------------

def _meta_check(a: Any, b: Any, sa: Any, sb: Any, offs: Any) -> None:
    """torch's own checks of `_scaled_grouped_mm` on meta copies (same shapes, strides and dtypes)."""
    import torch

    ma, mb, msa, msb, moffs = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                               for t in (a, b, sa, sb, offs))
    torch._scaled_grouped_mm(ma, mb, msa, msb, offs=moffs, out_dtype=torch.bfloat16)


def _emulated(a: Any, b: Any, sa: Any, sb: Any, offs: Any) -> Any:
    """What the kernel computes, in fp32 per group (the CPU's stand-in; rows after the last group stay zero)."""
    import torch

    ends = offs.tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    if b.dim() == 3:  # 2D x 3D: groups of rows of a; sa per row of a, sb [E, N] per column of b[e]
        out = torch.zeros(a.shape[0], b.shape[-1])
        for e, (s, t) in enumerate(spans):
            out[s:t] = (a[s:t].float() * sa[s:t, None]) @ (b[e].float() * sb[e][None, :])
        return out.to(torch.bfloat16)
    n, k = a.shape[0], b.shape[1]  # 2D x 2D: groups of the reduction; sa [E * N], sb [E * K], group-major
    out = torch.zeros(len(spans), n, k)
    for e, (s, t) in enumerate(spans):
        out[e] = (a[:, s:t].float() * sa[e * n:(e + 1) * n, None]) @ (b[s:t].float() * sb[e * k:(e + 1) * k][None, :])
    return out.to(torch.bfloat16)


def scaled_gmm(a: Any, b: Any, sa: Any, sb: Any, offs: Any) -> Any:
    """torch._scaled_grouped_mm(a, b, sa, sb, offs) with a bf16 result (emulated off CUDA)."""
    import torch

    if a.device.type == "cuda":
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    if hasattr(torch, "_scaled_grouped_mm"):
        _meta_check(a, b, sa, sb, offs)
    return _emulated(a, b, sa, sb, offs)


def _forward(ctx: Any, x: Any, w: Any, offs: Any, fused: bool) -> Any:
    import torch

    e4m3 = torch.float8_e4m3fn
    xq, xqt, sx, sxt = cast_both(x, e4m3, triton=fused, rowwise=True)  # [rows, K] per row, [K, rows] per column
    wq, sw, wqt, swt = weight_cast(w)
    ctx.save_for_backward(xqt, sxt, wqt, swt, offs)
    ctx.fused, ctx.wdtype = fused, w.dtype
    return scaled_gmm(xq, wq.transpose(1, 2), sx.reshape(-1), sw, offs)


def _backward(ctx: Any, dy: Any) -> Any:
    import torch

    xqt, sxt, wqt, swt, offs = ctx.saved_tensors
    experts = wqt.shape[0]
    dyq, dyqt, sdy, sdyt = cast_both(dy.contiguous(), torch.float8_e4m3fn, triton=ctx.fused, rowwise=True)
    dx = scaled_gmm(dyq, wqt.transpose(1, 2), sdy.reshape(-1), swt, offs) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:  # [E, N, K]; the column scales of every group are the same (over all tokens)
        dw = scaled_gmm(dyqt, xqt.t(), sdyt.reshape(-1).repeat(experts), sxt.reshape(-1).repeat(experts), offs)
        dw = dw.to(ctx.wdtype)
    return dx, dw, None, None


def _function() -> Any:
    import torch

    class Fp8GroupedGemm(torch.autograd.Function):
        """y[rows, N] = x[rows, K] @ w[e]^T for the rows of group e, in FP8 (x: the padded layout)."""

        forward = staticmethod(_forward)
        backward = staticmethod(_backward)

    return Fp8GroupedGemm


_FUNCTION: list[Any] = []


def fp8_gmm(x: Any, w: Any, offs: Any, fused: bool) -> Any:
    """x[rows, K] @ w[e]^T per group of rows in FP8, differentiable in x and w (`x` in the padded layout: `offs`
    multiples of 16, the last = rows; `fused`: the Triton casts, else torch's)."""
    if not _FUNCTION:
        _FUNCTION.append(_function())
    return _FUNCTION[0].apply(x.contiguous(), w, offs, fused)
