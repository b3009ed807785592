"""Hugging Face <-> Megatron-core checkpoint conversion for Llama-family models (Llama 2/3/3.1,
Mistral, Qwen2, Qwen3) and their mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): declarative name
tables (`tables`), named transforms (`transforms`), streaming safetensors and torch_dist I/O
(`checkpoint_io`: `safetensors_io`, `mcore_*`), orchestrated by `to_mcore` and `to_hf` (shared parts in
`converter`).

Importing this package is cheap; torch, megatron and transformers load inside the functions."""

from megalaunch.conversion.converter import Report
from megalaunch.conversion.to_hf import mcore_to_hf
from megalaunch.conversion.to_mcore import hf_to_mcore

__all__ = ["Report", "hf_to_mcore", "mcore_to_hf"]
