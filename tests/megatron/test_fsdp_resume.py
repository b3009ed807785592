"""Sharded data parallelism (`parallel.data_sharding`, Megatron-FSDP) on the CPU, two ranks: it saves the
fsdp_dtensor format (which Megatron 0.19.2 cannot save for a SwiGLU model with torch's Adam: the fixes in
runtime/loop/fsdp_patches.py), a checkpoint is complete by megalaunch's check, and a chain stopped twice by
SIGUSR2 gives the same loss at every iteration as an uninterrupted run, with both layouts of it (ZeRO-2, ZeRO-3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from harness import Trainer, last_iteration, ledger, losses, make_run, wait_for

from megalaunch.runtime.checkpoint.completeness import incomplete_reason
from megalaunch.runtime.checkpoint.resume import iter_dir

pytestmark = pytest.mark.megatron

ITERS = 12


def _sets(sharding: str) -> tuple[str, ...]:
    return (f"training.train_iters={ITERS}", "checkpoint.save_interval=4", "checkpoint.keep_last=50",
            "training.lr_warmup_iters=2", "training.global_batch_size=4", f"parallel.data_sharding={sharding}")


def _segment(paths, job_id: str, loss_log: Path, stop_after: int | None) -> Trainer:
    start = last_iteration(loss_log)
    t = Trainer(paths, world=2, job_id=job_id, env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    if stop_after is not None:
        wait_for(lambda: last_iteration(loss_log) >= start + stop_after, what=f"{stop_after} iterations", trainer=t)
        t.signal()
    assert t.wait() == [0, 0], t.log()[-3000:] + t.log(1)[-2000:]
    return t


@pytest.mark.parametrize("sharding", ["optimizer_grads_params", "optimizer_grads"])
def test_fsdp_signal_resume_matches_uninterrupted_run(tmp_path: Path, sharding: str) -> None:
    straight = make_run(tmp_path / "a", *_sets(sharding), name="straight")
    ref_log = tmp_path / "straight.jsonl"
    t = _segment(straight, "100", ref_log, None)
    assert t.outcome()["status"] == "finished"
    assert "in fsdp_dtensor format" in t.log()  # Megatron's save line: the Megatron-FSDP path ran
    saved = sorted(p.name for p in straight.checkpoints.glob("iter_*"))
    assert saved == [f"iter_{i:07d}" for i in range(4, ITERS + 1, 4)], saved
    for it in range(4, ITERS + 1, 4):
        d = iter_dir(straight, it)
        assert not (d / "metadata.json").exists() and (d / ".metadata").is_file(), sorted(d.iterdir())  # fsdp_dtensor
        assert incomplete_reason(d) is None and incomplete_reason(d, full=False) is None

    chain = make_run(tmp_path / "b", *_sets(sharding), name="chain")
    log = tmp_path / "chain.jsonl"
    stops = []
    for job, stop_after in (("201", 3), ("202", 3), ("203", None)):
        out = _segment(chain, job, log, stop_after).outcome()
        assert out["status"] == ("finished" if stop_after is None else "saved"), out
        if stop_after is not None:
            stops.append(out["iteration"])
    assert [(r["job_id"], r["iteration"]) for r in ledger(chain, "resumed")] == [("202", stops[0]), ("203", stops[1])]
    ref, got = losses(ref_log), losses(log)
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= 1e-6, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=1e-6)}
