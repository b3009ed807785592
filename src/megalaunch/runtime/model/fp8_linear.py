"""Megatron's local linear layers with FP8 GEMMs (runtime/model/fp8.py): the transformer layers'
ColumnParallelLinear and RowParallelLinear get an `_forward_impl` that does what Megatron's
`linear_with_grad_accumulation_and_async_allreduce` does (the sequence-parallel all-gather of the input and
reduce-scatter of its gradient, the tensor-parallel all-reduce of the input gradient, the weight gradient
accumulated into `main_grad`), with the three GEMMs in FP8. The embedding and the output layer are left alone.
Grouped experts (runtime/model/experts/) get FP8 grouped GEMMs where the node can run them (experts/fp8.py).

A call it does not cover (a frozen weight, deferred embedding gradients, gathered tensor-parallel weights, a
token count that is not a multiple of 16) goes to Megatron's own implementation.

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

from typing import Any

from megalaunch.runtime.model.fp8 import ALIGN, Formats, aligned
from megalaunch.runtime.model.fp8_cast import cast_both

OUTPUT_LAYERS = ("output_layer",)  # the vocabulary projection: its logits stay in the working precision


def _gather(x: Any, group: Any) -> Any:
    """The sequence-parallel input, gathered along the sequence from the tensor-parallel group."""
    import torch
    import torch.distributed as dist

    out = torch.empty((x.shape[0] * group.size(), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _dummy_wgrad(weight: Any, dtype: Any, device: Any) -> Any:
    """Megatron's convention once the gradient is in main_grad: a dummy gradient (zeros where the weight
    asks for it) keeps the backward hooks on the main thread; None where the weight keeps no such flag."""
    import torch

    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.main_grad.shape, dtype=dtype, device=device)


_GENERATION = [0]  # bumped after every optimizer step (any torch optimizer): cached FP8 weights are stale


def weight_cast(weight: Any, fmt: Formats) -> tuple[Any, Any, Any, Any]:
    """The weight in FP8, row-major and transposed, and their inverse scales: cast once per optimizer step and
    kept on the parameter for the step's other micro-batches (an in-place update or a new storage recasts it)."""
    key = (_GENERATION[0], weight.data_ptr(), weight._version, fmt.rowwise)
    cached = getattr(weight, "_megalaunch_fp8", None)
    if cached is not None and cached[0] == key:
        return cached[1]  # type: ignore[no-any-return]
    result = cast_both(weight, fmt.act, triton=fmt.fused, rowwise=fmt.rowwise)
    weight._megalaunch_fp8 = (key, result)
    return result


def _as_b(inv_scale: Any, fmt: Formats) -> Any:
    """`_scaled_mm`'s scale of its second operand: one per column of it (1, N) when rowwise, else the scalar."""
    return inv_scale.reshape(1, -1) if fmt.rowwise else inv_scale


def _optimizer_stepped(*_: Any) -> None:
    _GENERATION[0] += 1


def _forward(ctx: Any, x: Any, weight: Any, bias: Any, fmt: Formats, fusion: bool, allreduce_dgrad: bool,
             sequence_parallel: bool, tp_group: Any) -> Any:
    import torch

    ctx.main_grad = weight.main_grad if fusion and hasattr(weight, "main_grad") else None
    ctx.fmt, ctx.fusion, ctx.use_bias = fmt, fusion, bias is not None
    ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = allreduce_dgrad, sequence_parallel, tp_group
    ctx.x_meta = (x.shape, x.dtype, x.device)
    total = _gather(x, tp_group) if sequence_parallel else x
    ctx.total_shape = total.shape
    rows = total.reshape(-1, total.shape[-1])
    # each operand cast once, in both layouts (rowwise: each scaled along its own GEMM's reduction); the FP8
    # input, not the bf16 one, kept for the weight gradient
    xq, xqt, sx, sxt = cast_both(rows, fmt.act, triton=fmt.fused, rowwise=fmt.rowwise)
    wq, wqt, sw, swt = weight_cast(weight, fmt)
    ctx.save_for_backward(weight, xqt, sxt, wqt, swt)
    out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=_as_b(sw, fmt), out_dtype=x.dtype)
    out = out.view(*total.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


def _backward(ctx: Any, grad_output: Any) -> Any:
    import torch
    import torch.distributed as dist

    fmt = ctx.fmt
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    weight, xqt, sxt, wqt, swt = ctx.saved_tensors
    dyq, dyqt, sdy, sdyt = cast_both(dy, fmt.grad, triton=fmt.fused, rowwise=fmt.rowwise)
    grad_input = torch._scaled_mm(dyq, wqt.t(), scale_a=sdy, scale_b=_as_b(swt, fmt), out_dtype=grad_output.dtype)
    grad_input = grad_input.view(ctx.total_shape)
    shape, dtype, device = ctx.x_meta
    handle = None
    if ctx.allreduce_dgrad:
        handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
    if ctx.sequence_parallel:
        sub = torch.empty(shape, dtype=dtype, device=device)
        handle = dist.reduce_scatter_tensor(sub, grad_input, group=ctx.tp_group, async_op=True)
        grad_input = sub
    main_grad = ctx.main_grad
    # the weight gradient while the input gradient's collective runs
    wgrad = torch._scaled_mm(dyqt, xqt.t(), scale_a=sdyt, scale_b=_as_b(sxt, fmt),
                             out_dtype=fmt.wgrad_dtype(main_grad, dtype))
    if ctx.fusion and main_grad is not None:
        weight.main_grad = main_grad
        main_grad.add_(wgrad)
        grad_weight = _dummy_wgrad(weight, dtype, device)
    else:
        grad_weight = wgrad.to(weight.dtype)
    grad_bias = dy.sum(dim=0) if ctx.use_bias else None
    if handle is not None:
        handle.wait()
    return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _function() -> Any:
    """The autograd function (built once torch is imported)."""
    import torch

    class Fp8Linear(torch.autograd.Function):
        forward = staticmethod(_forward)
        backward = staticmethod(_backward)

    return Fp8Linear


_FUNCTION: list[Any] = []


def forward_impl(fmt: Formats, original: Any) -> Any:
    """A layer's `_forward_impl`: FP8 where the call is covered, `original` (Megatron's) where not."""
    if not _FUNCTION:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _FUNCTION.append(_function())
        register_optimizer_step_post_hook(_optimizer_stepped)  # once, with the function
    fn = _FUNCTION[0]

    def impl(input: Any, weight: Any, bias: Any = None, gradient_accumulation_fusion: bool = False,
             allreduce_dgrad: bool = False, sequence_parallel: bool = False, grad_output_buffer: Any = None,
             wgrad_deferral_limit: Any = None, tp_group: Any = None, gtp_remat_size: int = 1, **extra: Any) -> Any:
        tokens = input.numel() // input.shape[-1] * (tp_group.size() if sequence_parallel else 1)
        if (not weight.requires_grad or grad_output_buffer is not None or gtp_remat_size > 1 or extra
                or not aligned(tokens)):
            return original(input=input, weight=weight, bias=bias,
                            gradient_accumulation_fusion=gradient_accumulation_fusion,
                            allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                            grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                            tp_group=tp_group, gtp_remat_size=gtp_remat_size, **extra)
        return fn.apply(input, weight, bias, fmt, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                        tp_group)

    return impl


def _experts(module: Any, label: str, fmt: Formats, done: list[str], kept: dict[str, str]) -> None:
    """Grouped experts take FP8 grouped GEMMs where this node can run them (runtime/model/experts/fp8.py: the
    rowwise recipe, e4m3, whatever the dense layers' recipe), else stay on torch's bf16 grouped GEMM."""
    from megalaunch.runtime.model.experts import fp8 as experts_fp8

    why = experts_fp8.refusal(module)
    if why is None:
        module.fp8_format = fmt
        done.append(label)
    else:
        kept[label] = f"grouped experts: torch's bf16 grouped GEMM ({why})"


def install(model: Any, fmt: Formats) -> tuple[list[str], dict[str, str]]:
    """Give the transformer layers' linear layers of `model` (a module, or Megatron's list of model chunks)
    FP8 GEMMs. Returns the layers converted and, for the rest, why each stayed in the working precision."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    done: list[str] = []
    kept: dict[str, str] = {}
    chunks = model if isinstance(model, list) else [model]
    for i, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            label = f"{i}.{name}" if len(chunks) > 1 else name
            if getattr(module, "megalaunch_grouped_experts", False):  # runtime/model/experts/grouped.py
                _experts(module, label, fmt, done, kept)
                continue
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if name.rsplit(".", 1)[-1] in OUTPUT_LAYERS:
                kept[label] = "the output layer: logits and loss stay in the working precision"
            elif module.weight is None or not aligned(*module.weight.shape):
                shape = "no weight" if module.weight is None else "x".join(map(str, module.weight.shape))
                kept[label] = f"weight {shape}: FP8 GEMMs need multiples of {ALIGN}"
            else:
                module._forward_impl = forward_impl(fmt, module._forward_impl)
                done.append(label)
    return done, kept
