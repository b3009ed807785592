"""`training.kernels: liger` wired into Megatron's model (runtime/model/liger_layers.py), on the CPU: liger's Triton
kernels need CUDA, so plain-torch stand-ins with their signatures and layouts take their place
(tests/support/liger_reference.py). What is proven here is megalaunch's part: the same parameter names (a
checkpoint loads whichever library computed it), the rotary seam, the deferred logits and the masked labels
give the unfused model's loss and gradients, tied and untied. The kernels themselves: tests/gpu/test_kernels_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import forkserver

# find_spec, not importorskip: importing liger imports Triton (~3.4 CPU-s in every worker's collection)
pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, torch, pytest
from support import liger_reference
from megalaunch.config.schema import ModelConfig
from megalaunch.conversion.model import build_gpt_model
from megalaunch.runtime.model.standalone import megatron_parallel_state
from megalaunch.runtime.model.kernels import OPS

interpreted = sys.argv[1] == "interpreted"
if interpreted:  # liger's own kernels, run by Triton's interpreter; its norm kernel is beyond the interpreter
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    pytest.MonkeyPatch().setattr(LigerRMSNorm, "forward", liger_reference.rms_norm_forward)
else:
    liger_reference.install(pytest.MonkeyPatch())
calls = {"rope": 0}
from megalaunch.runtime.model import liger_layers
rope_qkv = liger_layers.rope_qkv
def counted(*args):
    calls["rope"] += 1
    return rope_qkv(*args)
liger_layers.rope_qkv = counted
out = {}
for tied in (True, False):
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                        seq_length=32, max_position_embeddings=32, make_vocab_size_divisible_by=64,
                        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                        untie_embeddings_and_output_weights=not tied)
    with megatron_parallel_state():
        a = build_gpt_model(model, vocab_size=200)
        b = build_gpt_model(model, vocab_size=200, liger_ops=frozenset(OPS))
        kinds = sorted({type(m).__name__ for m in b.modules()} - {type(m).__name__ for m in a.modules()})
        keys = sorted(a.state_dict()) == sorted(b.state_dict())
        sharded = sorted(a.sharded_state_dict()) == sorted(b.sharded_state_dict())
        b.load_state_dict(a.state_dict())
        tokens, labels = torch.randint(0, 200, (3, 32)), torch.randint(0, 200, (3, 32))
        pos, mask = torch.arange(32).expand(3, 32), (torch.rand(3, 32) > 0.2).float()
        logits = a(tokens, pos, None)  # the unfused reference: logits, then cross entropy
        la = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        ta = (la * mask).sum()
        ta.backward()
        lb = b(tokens, pos, None, labels=labels.masked_fill(mask == 0, -100))  # as step.forward_step does
        tb = (lb * mask).sum()
        tb.backward()
        ga, gb = dict(a.named_parameters()), dict(b.named_parameters())
        b.eval()
        with torch.no_grad():
            logits_diff = (a(tokens, pos, None) - b(tokens, pos, None)).abs().max().item()
        out[str(tied)] = {"kinds": kinds, "keys": keys, "sharded": sharded, "loss": [ta.item(), tb.item()],
                          "grad_diff": max((ga[k].grad - gb[k].grad).abs().max().item() for k in ga),
                          "grad_scale": max(ga[k].grad.abs().max().item() for k in ga),
                          "logits_diff": logits_diff, "shape": list(lb.shape)}
out["rope_calls"] = calls["rope"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("kernels", ["reference", "interpreted"])
def test_liger_wiring_matches_megatron(kernels: str) -> None:
    """fp32 on the CPU: loss to 1e-6 relative, every gradient to 1e-5 of the largest, logits (no labels:
    Megatron's output layer) to 1e-5; the rotary seam ran in every layer's forward. `reference`: plain-torch
    stand-ins for liger's four functions; `interpreted`: liger's own Triton kernels for RoPE, SwiGLU and the
    fused linear cross entropy, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "1" if kernels == "interpreted" else "0"}
    # Triton reads TRITON_INTERPRET when it is imported, and the fork server has imported it already
    python = sys.executable if kernels == "interpreted" else forkserver.python()
    p = subprocess.run([python, "-c", SCRIPT, kernels], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for tied in ("True", "False"):
        t = r[tied]
        assert t["kinds"] == ["LigerLossGPTModel", "LigerRMSNorm", "LigerSwiGLUMLP"], t
        assert t["keys"] and t["sharded"], "a checkpoint must not depend on the kernel choice"
        assert t["shape"] == [3, 32]
        assert abs(t["loss"][0] - t["loss"][1]) <= 1e-6 * abs(t["loss"][0]), t
        assert t["grad_diff"] <= 1e-5 * t["grad_scale"], t
        assert t["logits_diff"] <= 1e-5, t
    assert r["rope_calls"] == 2 * 2 * 2  # 2 layers x (training, eval) x (tied, untied)
