"""Which layers are mixture-of-experts (`model.moe_first_dense_layers`, `model.moe_layer_freq` -> Megatron's
`moe_layer_freq`): the model megalaunch builds on the local spec (runtime/model/model.py) has a dense MLP in
the dense layers and the MoE layer (with the experts class chosen) in the others, on every pipeline stage.
Given one layer spec, Megatron built every layer as an MoE layer whatever `moe_layer_freq` said (found by the
conversion of Qwen-MoE models with dense layers)."""

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
import json, torch
from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.model import transformer_config
from megalaunch.runtime.model.model import decoder_spec, layer_spec, moe_pattern
from megalaunch.runtime.model.standalone import megatron_parallel_state
from megatron.core.models.gpt import GPTModel

model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                    seq_length=16, max_position_embeddings=16, normalization="RMSNorm", num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=32)
out = {}
with megatron_parallel_state():
    for name, freq in (("first-dense", [0, 1, 1, 1]), ("every-2nd", 2), ("all", 1)):
        cfg = transformer_config(model, moe_layer_freq=freq)
        for experts in ("sequential", "grouped"):
            layer = layer_spec(cfg, experts=experts)
            dense = layer_spec(cfg, experts=experts, dense=True) if moe_pattern(cfg) is not None else None
            gpt = GPTModel(config=cfg, transformer_layer_spec=decoder_spec(cfg, layer, None, dense), vocab_size=128,
                           max_sequence_length=16)
            kinds = [type(l.mlp).__name__ for l in gpt.decoder.layers]
            tokens = torch.randint(0, 128, (2, 16))
            logits = gpt(tokens, torch.arange(16).expand(2, 16), None)
            experts_cls = sorted({type(l.mlp.experts).__name__ for l in gpt.decoder.layers if hasattr(l.mlp, "experts")})
            dense_ffn = sorted({l.mlp.linear_fc2.weight.shape[1] for l in gpt.decoder.layers if type(l.mlp).__name__ == "MLP"})
            out[f"{name}-{experts}"] = {"kinds": kinds, "experts": experts_cls, "dense_ffn": dense_ffn,
                                        "finite": bool(torch.isfinite(logits).all())}
print(json.dumps(out))
"""


def test_dense_layers_are_dense_and_the_others_moe_on_the_local_spec() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    want = {"first-dense": ["MLP", "MoELayer", "MoELayer", "MoELayer"],
            "every-2nd": ["MoELayer", "MLP", "MoELayer", "MLP"], "all": ["MoELayer"] * 4}
    for name, kinds in want.items():
        for experts, cls in (("sequential", "SequentialMLP"), ("grouped", "GroupedExperts")):
            got = r[f"{name}-{experts}"]
            assert got["kinds"] == kinds and got["experts"] == [cls] and got["finite"], (name, experts, got)
            assert got["dense_ffn"] == ([96] if "MLP" in kinds else []), got  # the dense layers' own ffn size
