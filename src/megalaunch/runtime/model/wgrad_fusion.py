"""Megatron's gradient-accumulation fusion without apex: each linear layer's weight gradient computed straight
into its fp32 `main_grad` by one cuBLAS matmul (torch.addmm with an fp32 output, torch >= 2.8 on CUDA), in
place of a bf16 weight gradient and a separate fp32 add per layer and micro-batch.

Megatron's local layers take this path only when apex's `fused_weight_gradient_mlp_cuda` extension imports;
the launcher renders `--no-gradient-accumulation-fusion` for them. `training.kernels: auto|liger` turn it on
in the job (runtime/model/kernels.py decides, where the GPU and torch are known): `install()` registers a module of
that name whose two functions are torch's, and the flag is dropped. Measured on an H100 (docs/results.md):
the fp32 adds were 4 % of llama3-8b's step (TP 2 + SP) and 2 % of llama3-1b's.

Importing this module is cheap: torch is imported inside the functions."""

from __future__ import annotations

import sys
import types
from typing import Any

MODULE = "fused_weight_gradient_mlp_cuda"  # apex's extension, the name Megatron imports
FLAG = "--no-gradient-accumulation-fusion"


def supported() -> str | None:
    """Why this node cannot take the fusion from torch, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not _torch_has_out_dtype():
        return f"torch {torch.__version__} has no fp32-output matmul of bf16 inputs (2.8 and later do)"
    if not fp32_output_matmul(torch.cuda.current_device()):
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        return f"compute capability {cap}: the fp32-output matmul of 16-bit inputs needs 8.0 or later"
    return None


def _torch_has_out_dtype() -> bool:
    import torch

    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 8)


def fp32_output_matmul(device: Any) -> bool:
    """Whether `torch.addmm(..., out_dtype=torch.float32)` of 16-bit inputs runs on this CUDA device (torch
    >= 2.8, Ampere and later); the fused loss's weight gradient takes it too (runtime/model/liger_layers.py)."""
    import torch

    return _torch_has_out_dtype() and torch.cuda.get_device_capability(device)[0] >= 8


def _rows(t: Any) -> Any:
    return t.reshape(-1, t.shape[-1])


def wgrad_gemm_accum_fp32(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """main_grad [out, in] += grad_output[..., out]^T @ total_input[..., in], accumulated in fp32."""
    import torch

    x, dy = _rows(total_input), _rows(grad_output)
    if x.dtype == torch.float32:
        main_grad.addmm_(dy.t(), x)
    else:
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)


def wgrad_gemm_accum_fp16(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """The same into a 16-bit main_grad (Megatron's bf16/fp16 gradient buffers)."""
    main_grad.addmm_(_rows(grad_output).t(), _rows(total_input))


def install() -> bool:
    """Register the module under apex's name (unless apex's own is importable); patch Megatron's modules that
    already looked for it. Returns whether megalaunch's module is the one in use."""
    module = sys.modules.get(MODULE)
    if module is None:
        try:
            __import__(MODULE)
            return False  # apex's real extension: Megatron uses it already
        except ImportError:
            module = types.ModuleType(MODULE)
            module.__megalaunch__ = True  # type: ignore[attr-defined]
            module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32  # type: ignore[attr-defined]
            module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16  # type: ignore[attr-defined]
            sys.modules[MODULE] = module
    elif not getattr(module, "__megalaunch__", False):
        return False
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is not None:  # imported before: its availability test already failed
        setattr(layers, MODULE, module)  # attributes mypy cannot see on the module
        setattr(layers, "_grad_accum_fusion_available", True)  # noqa: B010
    return True


def enable(argv: list[str]) -> list[str]:
    """Megatron's arguments with the fusion on (the flag the launcher rendered for the local layers dropped)."""
    install()
    return [a for a in argv if a != FLAG]
