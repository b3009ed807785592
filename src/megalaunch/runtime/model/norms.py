"""megalaunch's norms in Megatron's layer and block specs: a torch norm that works with sequence
parallelism (Megatron's own refuses it), putting a norm in place of Megatron's torch norm throughout a
spec (`with_norm`), and finding which of megalaunch's norms a spec uses (`custom_norm`, `spec_uses`).

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from megatron.core.transformer.spec_utils import ModuleSpec


_SP_NORM: list[type] = []


def sequence_parallel_norm_class() -> type:
    """Torch LayerNorm/RMSNorm for Megatron's local layers that works with sequence parallelism.

    Megatron's `WrappedTorchNorm` refuses sequence parallelism, and its local spec always uses it for
    RMSNorm (apex has none), so without transformer-engine a Llama with `sequence_parallel: true`
    could not be built. What sequence parallelism needs from a norm is what TE's and apex's norms do:
    mark the weights `sequence_parallel`, so that Megatron all-reduces their gradients over the
    tensor-parallel group (each rank saw only its slice of the sequence; finalize_model_grads.py).
    The forward is the same torch module either way."""
    if _SP_NORM:
        return _SP_NORM[0]
    import torch

    class SequenceParallelTorchNorm:
        def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                    zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> Any:
            if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
                raise ValueError("zero-centred gamma, persist_layer_norm and memory_efficient_layer_norm need "
                                 "transformer-engine or apex; the torch norm has none of them")
            if config.normalization == "LayerNorm":
                norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
            elif config.normalization == "RMSNorm":
                norm = torch.nn.RMSNorm(hidden_size, eps=eps)
            else:
                raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm")
            for param in norm.parameters():
                param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
            return norm

    _SP_NORM.append(SequenceParallelTorchNorm)
    return SequenceParallelTorchNorm


def _torch_norm() -> type:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def with_norm(spec: Any, norm: type) -> Any:
    """The spec with Megatron's torch norm replaced by `norm` wherever it appears (layer norms, the
    q/k norms), in place on a copy the caller made."""
    import dataclasses
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    old = _torch_norm()

    def swap(obj: Any) -> Any:
        if obj is old:
            return norm
        if isinstance(obj, ModuleSpec):
            obj.module, obj.submodules = swap(obj.module), swap(obj.submodules)
            return obj
        if isinstance(obj, functools.partial):
            return functools.partial(swap(obj.func), *map(swap, obj.args),
                                     **{k: swap(v) for k, v in obj.keywords.items()})
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                object.__setattr__(obj, f.name, swap(getattr(obj, f.name)))
            return obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(swap(x) for x in obj)
        return obj

    return swap(spec)


def spec_uses(spec: Any, module: type) -> bool:
    """Whether `module` appears anywhere in a layer or block spec (submodules, lists of layer specs)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is module:
        return True
    if isinstance(spec, ModuleSpec):
        return spec_uses(spec.module, module) or spec_uses(spec.submodules, module)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return any(spec_uses(getattr(spec, f.name), module) for f in dataclasses.fields(spec))
    if isinstance(spec, (list, tuple)):
        return any(spec_uses(x, module) for x in spec)
    return False


def custom_norm(layer: ModuleSpec) -> type | None:
    """megalaunch's norm in this layer spec (the sequence-parallel torch norm, liger's), if any."""
    import sys

    candidates = [sequence_parallel_norm_class()]
    if "megalaunch.runtime.model.liger_layers" in sys.modules:  # only a spec built with liger's ops can hold it
        candidates.append(sys.modules["megalaunch.runtime.model.liger_layers"].norm_class())
    return next((c for c in candidates if spec_uses(layer, c)), None)
