"""The model builder and the SDPA core attention: same weights, same logits as Megatron's local
attention (GQA, causal), on the CPU. Runs in a subprocess: it switches on cpu_compat for the process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tests.support import forkserver

pytestmark = pytest.mark.megatron

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = r"""
import json, torch
from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.model import build_gpt_model
from megalaunch.runtime.model.attention import sdpa_attention_class
from megalaunch.runtime.model.standalone import megatron_parallel_state

model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    seq_length=32, max_position_embeddings=32, make_vocab_size_divisible_by=64)
with megatron_parallel_state():
    local = build_gpt_model(model, vocab_size=200)
    sdpa = build_gpt_model(model, vocab_size=200, attention="sdpa")
    sdpa.load_state_dict(local.state_dict())
    kinds = {type(m).__name__ for m in sdpa.modules()}
    tokens = torch.randint(0, 200, (3, 32))
    pos = torch.arange(32).expand(3, 32)
    with torch.no_grad():
        a = local(tokens, pos, None)
        b = sdpa(tokens, pos, None)
    print(json.dumps({"shape": list(a.shape), "diff": (a - b).abs().max().item(), "scale": a.abs().max().item(),
                      "sdpa": sdpa_attention_class().__name__ in kinds,
                      "keys": sorted(local.state_dict()) == sorted(sdpa.state_dict()),
                      "first_key": sorted(local.state_dict())[0]}))
"""


@pytest.mark.parametrize("backends", [None, "math", "cudnn_attention,math"])
def test_sdpa_matches_local_attention(backends: str | None) -> None:
    """Also with torch's backends reordered by MEGALAUNCH_SDPA_BACKENDS (torch skips one that cannot
    take the inputs: cuDNN's on a CPU)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    env.pop("MEGALAUNCH_SDPA_BACKENDS", None)
    if backends:
        env["MEGALAUNCH_SDPA_BACKENDS"] = backends
    p = subprocess.run([forkserver.python(), "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["shape"] == [3, 32, 256]  # batch, sequence, vocabulary padded to a multiple of 64
    assert r["sdpa"] and r["keys"]  # same checkpoint layout: attention choice is not a checkpoint change
    assert r["diff"] <= 1e-5 * max(1.0, r["scale"]), r


def test_an_unknown_sdpa_backend_is_refused_with_the_valid_names() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "MEGALAUNCH_SDPA_BACKENDS": "cudnn,math"}
    p = subprocess.run([forkserver.python(), "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0
    assert "ValueError: MEGALAUNCH_SDPA_BACKENDS='cudnn,math': valid names are" in p.stderr
    assert "cudnn_attention" in p.stderr.splitlines()[-1]


def test_the_backend_order_reaches_the_attention_call() -> None:
    """cuDNN's attention alone cannot run on a CPU: the forward fails, so the order was applied there."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "MEGALAUNCH_SDPA_BACKENDS": "cudnn_attention"}
    p = subprocess.run([forkserver.python(), "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0 and "No viable backend for scaled_dot_product_attention" in p.stderr, p.stderr[-2000:]
