"""A short training run in Megatron's own loop (distributed data parallel, the optimizer, the loss function of
runtime/loop/step.py) with liger-kernel's RoPE, SwiGLU and fused linear cross entropy against Megatron's kernels, on
the CPU: Triton's interpreter (TRITON_INTERPRET=1) runs liger's own kernels there, slowly, in fp32 (its norm
kernel needs more than the interpreter has: a plain-torch stand-in takes its place, tests/support/liger_reference.py).
The losses of the 3 iterations must agree within 1e-5 relative (measured: ~1e-7); an interpreted iteration costs
~6 CPU-s here at 32 tokens a sequence, so 3, not more. Megatron's side has no Triton kernel: it is forked from the tests' fork server
(tests/support/forkserver.py) where that is on (~16 -> ~3 CPU-s); liger's needs a fresh interpreter
(TRITON_INTERPRET is read when Triton is imported, which the server has done). The same on the GPU, with the
norm and in bf16: tests/gpu/test_kernels_gpu.py."""

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
import json, os, sys
from pathlib import Path


# 32 tokens a sequence, not the tiny recipe's 64: the interpreter runs one Triton program per row, so an
# iteration costs ~2x less; RoPE, SwiGLU and the fused loss see the same code at any length.
SHORT = ("model.seq_length=32", "model.max_position_embeddings=32")


def main():
    from harness import make_run
    from megalaunch.runtime.model import cpu_compat
    from megalaunch.runtime.loop import megatron_patches as mp
    from megalaunch.runtime.loop import step

    mode, root = sys.argv[1], Path(sys.argv[2])
    paths = make_run(root, "training.train_iters=3", "training.lr_warmup_iters=1", "checkpoint.save_interval=1000",
                     "training.attention=sdpa", "training.lr=3e-3", *SHORT, name=mode)
    cpu_compat.enable()
    for patch in (mp.skip_unused_fusion_warmup, mp.null_tokenizer_without_transformers, mp.skip_helper_compilation,
                  mp.fix_optimizer_step):
        patch()
    ops = frozenset()
    if mode == "liger":
        import pytest
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from support import liger_reference

        pytest.MonkeyPatch().setattr(LigerRMSNorm, "forward", liger_reference.rms_norm_forward)
        ops = frozenset({"rmsnorm", "rope", "swiglu", "linear_ce"})
    losses, plain = [], step.loss_func

    def loss_func(mask, output):
        loss, tokens, report = plain(mask, output)
        losses.append((loss / tokens).item())
        return loss, tokens, report

    step.loss_func = loss_func
    try:  # the trainer's own entry refuses liger on the CPU: the model and the loop are what is tested here
        step.run_pretrain(step.megatron_argv(paths), attention="sdpa", session=None, liger_ops=ops)
    except SystemExit:
        pass
    print("LOSSES " + json.dumps(losses))


if __name__ == "__main__":  # the data loader's workers import this file again
    main()
"""


def _losses(mode: str, tmp_path: Path) -> list[float]:
    from megalaunch.runtime.rank.dist_env import free_port

    script = tmp_path / f"train_{mode}.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}:{ROOT / 'tests' / 'megatron'}",
           "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    python = sys.executable if mode == "liger" else forkserver.python()
    p = subprocess.run([python, str(script), mode, str(tmp_path / mode)], capture_output=True, text=True,
                       env=env, timeout=600)
    lines = [line for line in p.stdout.splitlines() if line.startswith("LOSSES ")]
    assert p.returncode == 0 and lines, (p.stdout + p.stderr)[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def test_training_with_liger_kernels_matches_megatron_s(tmp_path: Path) -> None:
    plain, fused = _losses("megatron", tmp_path), _losses("liger", tmp_path)
    assert len(plain) == len(fused) == 3
    worst = max(abs(a - b) / abs(a) for a, b in zip(plain, fused, strict=True))
    print(f"\n[tiny model, fp32, CPU, Triton interpreter] loss {plain[0]:.4f} -> {plain[-1]:.4f}; "
          f"liger vs megatron: max relative loss difference {worst:.2e}")
    assert plain[-1] < plain[0]  # it learns
    assert worst < 1e-5
