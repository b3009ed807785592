"""Sequence parallelism without transformer-engine or apex (run on the device; needs 2 GPUs).

Megatron's local layers use its torch norm, which refuses sequence parallelism; megalaunch's
sequence-parallel torch norm (runtime/model/model.py) marks the norm weights so that Megatron all-reduces
their gradients over the tensor-parallel group. Trained with the real trainer on 2 GPUs, TP 2 with
sequence parallelism must give the losses of TP 2 without it (fp32: only the reduction order
differs). A norm whose gradients were not all-reduced would train each rank's copy of the norm
weights on half of the sequence, and the losses would drift apart.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_sequence_parallel_gpu.py -s"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from harness import Trainer, losses, make_run  # noqa: E402

pytestmark = pytest.mark.gpu

TP2 = ("cluster.gpus_per_node=2", "cluster.tasks_per_node=2", "parallel.tensor_model_parallel_size=2",
       "training.precision=fp32", "training.attention=sdpa", "training.train_iters=40",
       "training.global_batch_size=4", "training.micro_batch_size=2", "model.seq_length=64",
       "training.lr=3e-3", "training.lr_warmup_iters=2", "checkpoint.save_interval=1000")


def _train(root: Path, sp: bool) -> tuple[dict[int, float], str]:
    paths = make_run(root, *TP2, f"parallel.sequence_parallel={str(sp).lower()}", name=f"sp-{sp}")
    log = root / "loss.jsonl"
    t = Trainer(paths, world=2, job_id="1", env={"MEGALAUNCH_LOSS_LOG": str(log), "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert t.wait(timeout=600) == [0, 0], t.log()[-4000:]
    assert t.outcome()["status"] == "finished"
    return losses(log), t.log()


def test_sequence_parallel_trains_like_plain_tensor_parallel(tmp_path: Path) -> None:
    plain, _ = _train(tmp_path / "plain", sp=False)
    sp, log = _train(tmp_path / "sp", sp=True)
    assert "sequence parallel with megalaunch's torch norm" in log
    assert sorted(plain) == sorted(sp) == list(range(1, 41))
    worst = max(abs(plain[i] - sp[i]) / abs(plain[i]) for i in plain)
    print(f"\n[TP2 sequence parallel vs not, fp32, {torch.cuda.get_device_name()}] loss {plain[1]:.4f} -> "
          f"{plain[40]:.4f}; max relative loss difference {worst:.2e}")
    assert plain[40] < plain[1] - 0.5  # it learns
    assert worst < 1e-5  # measured 1.0e-07 on an H100; 2.7e-04 with the norm weights left unmarked
