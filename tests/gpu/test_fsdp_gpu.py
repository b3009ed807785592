"""Sharded data parallelism on GPUs (`parallel.data_sharding: optimizer_grads_params`, Megatron-FSDP, two GPUs;
skipped with fewer): the tiny recipe in bf16 and in fp8, stopped twice by SIGUSR2 and resumed at the iteration
it stopped, with the losses of an uninterrupted run; its checkpoints are fsdp_dtensor, complete by megalaunch's
check. The 8B's speed is bench/fp8.py's (docs/results.md, "Sharded data parallelism").

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_fsdp_gpu.py -s"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from harness import ledger, losses, make_run  # noqa: E402
from test_train_gpu import _segments  # noqa: E402

from megalaunch.runtime.checkpoint.completeness import incomplete_reason  # noqa: E402

pytestmark = pytest.mark.gpu

GPU2 = ("cluster.gpus_per_node=2", "cluster.tasks_per_node=2", "parallel.use_distributed_optimizer=true",
        "parallel.data_sharding=optimizer_grads_params", "training.attention=sdpa", "training.global_batch_size=8",
        "training.micro_batch_size=2")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fsdp_signal_resume(tmp_path: Path, precision: str) -> None:
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs FP8 tensor cores")
    sets = (*GPU2, f"training.precision={precision}", "training.train_iters=40", "checkpoint.save_interval=1000",
            "checkpoint.keep_last=50",
            "training.lr_warmup_iters=2")
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "chain.jsonl"
    straight = make_run(tmp_path / "a", *sets, name="straight")
    (ref,) = _segments(straight, ref_log, (None,), 100, world=2)
    chain = make_run(tmp_path / "b", *sets, name="chain")
    outs = _segments(chain, log, (10, 10, None), 200, world=2)
    assert ref["status"] == outs[-1]["status"] == "finished"
    stops = [o["iteration"] for o in outs[:2]]
    assert [r["iteration"] for r in ledger(chain, "resumed")] == stops
    for it in stops:
        d = chain.checkpoints / f"iter_{it:07d}"
        assert (d / ".metadata").is_file() and not (d / "metadata.json").exists() and incomplete_reason(d) is None
    size = sum(f.stat().st_size for f in (chain.checkpoints / f"iter_{stops[0]:07d}").iterdir())
    a, b = losses(ref_log), losses(log)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    worst = max(abs(a[i] - b[i]) / abs(a[i]) for i in a)
    print(f"\n[tiny fsdp {precision}] stops at {stops}; checkpoint {size} bytes; "
          f"max relative loss difference vs uninterrupted: {worst:.2e}")
    assert worst < 2e-2  # as bf16's (tests/gpu/test_train_gpu.py): GPU kernels need not be bit-reproducible
