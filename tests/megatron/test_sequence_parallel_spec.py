"""The layer and block specs with sequence parallelism on Megatron's local layers (CPU; the
training parity is tests/gpu/test_sequence_parallel_gpu.py): Megatron's torch norm, which refuses
sequence parallelism, is replaced everywhere, and the replacement marks its weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = r"""
import json
from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.model import transformer_config
from megalaunch.runtime.model.model import decoder_spec, layer_spec
from megalaunch.runtime.model.norms import sequence_parallel_norm_class, spec_uses
from megalaunch.runtime.model.standalone import megatron_parallel_state
from megatron.core.transformer.torch_norm import WrappedTorchNorm

model = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    seq_length=32, max_position_embeddings=32, normalization="RMSNorm")
out = {}
with megatron_parallel_state():
    for sp in (False, True):
        cfg = transformer_config(model, tensor_model_parallel_size=2, sequence_parallel=sp)
        for attention in ("local", "sdpa"):
            layer = layer_spec(cfg, attention=attention, normalization="RMSNorm", qk_layernorm=True)
            block = decoder_spec(cfg, layer)
            norm = sequence_parallel_norm_class()
            out[f"{sp}-{attention}"] = {
                "torch_norm": spec_uses(block, WrappedTorchNorm), "sp_norm": spec_uses(block, norm),
                "block": type(block).__name__, "layers": len(getattr(block, "layer_specs", []) or []),
            }
    built = sequence_parallel_norm_class()(config=cfg, hidden_size=64, eps=1e-5)
    out["built"] = {"type": type(built).__name__, "marked": [getattr(p, "sequence_parallel", None) for p in built.parameters()]}
print(json.dumps(out))
"""


def test_sequence_parallel_spec_replaces_the_torch_norm_everywhere() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for attention in ("local", "sdpa"):
        off, on = r[f"False-{attention}"], r[f"True-{attention}"]
        assert off == {"torch_norm": True, "sp_norm": False, "block": "ModuleSpec", "layers": 0}  # unchanged
        assert on == {"torch_norm": False, "sp_norm": True, "block": "TransformerBlockSubmodules", "layers": 3}
    assert r["built"] == {"type": "RMSNorm", "marked": [True]}
