"""`training.precision: fp8` without transformer-engine: the transformer layers' linear GEMMs (forward, data
gradient, weight gradient) through `torch._scaled_mm` with dynamic scaling, the casts and amax reductions fused
on the GPU (Triton kernels, runtime/model/fp8_cast.py). Master weights, gradients, optimizer state and the
checkpoint are as under bf16 (no scaling state is kept: a bf16 run resumes an fp8 run's checkpoint and the other
way round); attention, norms, the embedding and the output layer with its loss stay in the working precision.
Mixture-of-experts layers: the grouped experts' grouped GEMMs in FP8 too (runtime/model/experts/fp8.py: torch's
scaled grouped GEMM, this file's `rowwise` recipe whatever the recipe says, as the kernel takes e4m3 only); the router
stays fp32, SequentialMLP's experts bf16.

Recipes (`training.fp8_recipe`):
- `tensorwise`: one scale per tensor; e4m3 for activations and weights, e5m2 for gradients (the "hybrid" format);
- `rowwise`:    one scale per row of each GEMM operand along its reduction dimension (so an operand's two layouts
  have different scales); e4m3 throughout (torch's rowwise kernel takes e4m3 only), the finer scale giving the
  range e5m2 would.
Either way each operand is cast once, in both layouts its two GEMMs need, the weight once per optimizer step.

Every GEMM is written as `a @ b.T` with both operands contiguous along the reduction dimension, which is what
`_scaled_mm` takes (its second operand column-major); a transposed operand is transposed inside its fused cast.
A GEMM whose dimensions are not multiples of 16 runs in the working precision (Megatron's own path).

Standard library only at module level (the launcher reads RECIPES); torch is imported inside the functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megalaunch.runtime.rank.failures import ConfigFailure, flag_value

RECIPES = ("tensorwise", "rowwise")
ALIGN = 16  # _scaled_mm: every dimension a multiple of 16
EPS = 1e-12  # an all-zero operand: amax clamped here, its scale finite
BF16_FIX = "--set training.precision=bf16"


@dataclass(frozen=True)
class Fp8Choice:
    """Which FP8 path this node runs, and why (the ledger's `fp8` event)."""

    recipe: str | None                  # training.fp8_recipe, None: precision is not fp8
    path: str                           # off | torch_scaled_mm | transformer_engine
    why: str
    fused_casts: bool = False           # Triton casts (GPU); eager torch ops on the CPU

    @property
    def ours(self) -> bool:
        return self.path == "torch_scaled_mm"

    def ledger(self) -> dict[str, object]:
        return {"recipe": self.recipe, "path": self.path, "why": self.why, "fused_casts": self.fused_casts}


def resolve_fp8(recipe: str | None, argv: list[str], *, cpu: bool, capability: tuple[int, int] | None = None,
                has_scaled_mm: bool = True) -> Fp8Choice:
    """The FP8 path for this node. Raises ConfigFailure where fp8 was asked for and cannot run (before Megatron
    starts: the chain stops after one segment with outcome config_error and this fix)."""
    if recipe is None:
        return Fp8Choice(None, "off", "training.precision is not fp8")
    if recipe not in RECIPES:
        raise ConfigFailure(f"training.fp8_recipe: {recipe!r} is not one of {', '.join(RECIPES)}",
                            "--set training.fp8_recipe=tensorwise")
    if flag_value(argv, "--fp8-format"):
        return Fp8Choice(recipe, "transformer_engine", f"transformer_impl: transformer_engine: TE's own FP8 "
                         f"(--fp8-format {flag_value(argv, '--fp8-format')} --fp8-recipe {flag_value(argv, '--fp8-recipe')})")
    if not has_scaled_mm:
        raise ConfigFailure("training.precision: fp8 needs torch._scaled_mm, which this torch lacks (2.4 and later "
                            "have it)", f"upgrade torch in the job's environment, or {BF16_FIX}")
    if cpu:
        return Fp8Choice(recipe, "torch_scaled_mm", "no GPU: torch._scaled_mm's CPU kernels, eager casts")
    if capability is None or capability < (8, 9):
        cap = ".".join(map(str, capability)) if capability else "unknown"
        raise ConfigFailure(f"training.precision: fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, "
                            f"Hopper, Blackwell); this GPU's is {cap}", BF16_FIX)
    return Fp8Choice(recipe, "torch_scaled_mm", f"torch._scaled_mm on compute capability "
                     f"{'.'.join(map(str, capability))}, fused casts (Triton)",
                     fused_casts=True)


def node_fp8(recipe: str | None, argv: list[str], *, cpu: bool) -> Fp8Choice:
    """resolve_fp8 with this node's torch and GPU."""
    import torch

    capability = None if cpu or not torch.cuda.is_available() else torch.cuda.get_device_capability()
    return resolve_fp8(recipe, argv, cpu=cpu, capability=capability, has_scaled_mm=hasattr(torch, "_scaled_mm"))


# --- the casts --------------------------------------------------------------------------------------------------

def quantize(t: Any, dtype: Any, rowwise: bool) -> tuple[Any, Any]:
    """`t` (2-D, any strides) scaled into fp8 `dtype` as a contiguous tensor, and the inverse scale that
    `_scaled_mm` multiplies back: one scalar (tensorwise) or one per row, shape (rows, 1). The scale maps the
    amax onto the format's largest value; values are clamped there (no inf), an all-zero tensor stays zero."""
    import torch

    fmax = torch.finfo(dtype).max
    a = t.abs().float()
    amax = a.amax(dim=1, keepdim=True) if rowwise else a.amax()
    # One IEEE division, as the Triton casts do (`fmax / tensor` would be reciprocal-then-multiply: two roundings)
    scale = torch.full_like(amax, fmax).div_(amax.clamp(min=EPS))
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype).contiguous()
    return q, scale.reciprocal()


@dataclass(frozen=True)
class Formats:
    """The recipe's operand formats and kernels."""

    rowwise: bool
    act: Any      # activations and weights
    grad: Any     # output gradients
    fused: bool

    @classmethod
    def of(cls, recipe: str, fused: bool) -> Formats:
        import torch

        rowwise = recipe == "rowwise"
        return cls(rowwise, torch.float8_e4m3fn, torch.float8_e4m3fn if rowwise else torch.float8_e5m2, fused)

    def wgrad_dtype(self, main_grad: Any, working: Any) -> Any:
        """The weight gradient's product type: fp32 straight into an fp32 main_grad (tensorwise; torch's
        rowwise kernel writes bf16 only), else the working precision."""
        import torch

        fp32 = main_grad is not None and main_grad.dtype == torch.float32 and not self.rowwise
        return torch.float32 if fp32 or working == torch.float32 else working


def aligned(*dims: int) -> bool:
    return all(d % ALIGN == 0 for d in dims)
