"""training.fused_kernels: Megatron's torch.compile'd SwiGLU and bias-dropout-add, which need neither
transformer-engine nor apex, train the same model to the same losses as the unfused local layers (on the
CPU here, in fp32; the fused cross entropy is bf16-only, so GPU runs cover it: tests/gpu resumes exactly
with it, and the speed and memory the fusions save on H200s are in docs/results.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness import Trainer, losses, make_run

pytestmark = pytest.mark.megatron


def train(tmp_path: Path, fused: str) -> tuple[dict[int, float], str]:
    sets = [f"training.fused_kernels={fused}", "training.train_iters=3", "training.lr_warmup_iters=1",
            "checkpoint.save_interval=1000"]
    paths = make_run(tmp_path / fused, *sets, name=f"fused-{fused}")
    loss_log = tmp_path / f"loss-{fused}.jsonl"
    trainer = Trainer(paths, env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    assert trainer.wait(timeout=600) == [0], trainer.log()[-3000:]
    assert trainer.outcome()["status"] == "finished", trainer.log()[-3000:]
    return losses(loss_log), trainer.log()


def megatron_arg(log: str, name: str) -> str:
    """A value from the argument table Megatron prints at start-up (`  name ..... value`)."""
    m = re.search(rf"^\s*{name} \.+ (\S+)$", log, re.M)
    assert m, f"{name} not in Megatron's argument table"
    return m.group(1)


def test_fused_kernels_train_to_the_same_losses(tmp_path: Path) -> None:
    fused, fused_log = train(tmp_path, "true")
    plain, plain_log = train(tmp_path, "false")
    assert sorted(fused) == sorted(plain) == [1, 2, 3]
    for it in plain:  # same initialisation and data: only the kernels differ (float rounding)
        assert fused[it] == pytest.approx(plain[it], rel=1e-4), (it, fused, plain)
    for name in ("bias_swiglu_fusion", "bias_dropout_fusion"):
        assert (megatron_arg(fused_log, name), megatron_arg(plain_log, name)) == ("True", "False"), name
    # The fused cross entropy returns a bf16 gradient: only bf16 training (a GPU) gets it.
    assert megatron_arg(fused_log, "cross_entropy_loss_fusion") == "False"
