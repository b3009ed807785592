"""A checkpoint exported without a Hugging Face config keeps the norm epsilon it trained with: Megatron stores
`--norm-epsilon` as `args.layernorm_epsilon` (issue #49: every such export said 1e-5, Qwen's is 1e-6)."""

from __future__ import annotations

from argparse import Namespace

import pytest

pytest.importorskip("torch")
from megalaunch.conversion.to_hf import model_from_megatron_args

ARGS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=64,
            max_position_embeddings=64, swiglu=True, add_bias_linear=False)


@pytest.mark.parametrize(("stored", "expected"), [({"layernorm_epsilon": 1e-6}, 1e-6), ({}, 1e-5)])
def test_the_exported_norm_epsilon_is_the_trained_one(stored: dict[str, float], expected: float) -> None:
    assert model_from_megatron_args(Namespace(**ARGS, **stored)).norm_epsilon == expected
