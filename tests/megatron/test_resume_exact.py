"""Resume is exact, not just "it loaded": the tiny recipe stopped twice by SIGUSR2 and resumed gives
the same loss at every iteration as an uninterrupted run (CPU fp32, relative difference <= 1e-6) and
the same weights and optimizer state (Adam moments and step) at the end. The signal goes to every
process of each rank, as Slurm sends it. Also: W&B offline keeps
one run id across the segments, with steps that only go forward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from harness import Trainer, checkpoint_state, last_iteration, ledger, losses, make_run, wait_for

from megalaunch.runtime.checkpoint.resume import iter_dir

pytestmark = pytest.mark.megatron

ITERS = 24
# Periodic saves every 2 iterations, as real runs save: the signal save of each segment then comes
# after the segment's first save started the checkpoint writer's processes, which get the signal too.
SETS = (f"training.train_iters={ITERS}", "checkpoint.save_interval=2", "checkpoint.keep_last=50", "training.lr_warmup_iters=2", "parallel.use_distributed_optimizer=true")


def _segment(paths, job_id: str, loss_log: Path, stop_after: int | None) -> Trainer:
    """One segment; with `stop_after`, SIGUSR2 once it has trained that many iterations."""
    start = last_iteration(loss_log)
    t = Trainer(paths, job_id=job_id, env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    if stop_after is not None:
        wait_for(lambda: last_iteration(loss_log) >= start + stop_after, what=f"{stop_after} iterations",
                 trainer=t)
        t.signal()
    assert t.wait() == [0], t.log()[-3000:]
    # a synchronous save writes from this process's threads: no queue server was spawned (it imported
    # torch and outlived the trainer, runtime/loop/megatron_patches.in_process_write_results)
    assert "left-over process" not in t.log(), t.log()[-2000:]
    return t


def test_signal_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    straight = make_run(tmp_path / "a", *SETS, name="straight")
    ref_log = tmp_path / "straight.jsonl"
    t = _segment(straight, "100", ref_log, None)
    assert t.outcome()["status"] == "finished"

    chain = make_run(tmp_path / "b", *SETS, "logging.wandb_project=megalaunch-test", name="chain")
    log = tmp_path / "chain.jsonl"
    stops = []
    for job, stop_after in (("201", 3), ("202", 3), ("203", None)):
        t = _segment(chain, job, log, stop_after)
        out = t.outcome()
        if stop_after is None:
            assert out["status"] == "finished", out
        else:
            assert out["status"] == "saved", out
            stops.append(out["iteration"])
            assert chain.read_tracker() == out["iteration"]  # saved at the iteration it stopped
    # each stopped segment saved periodically before its signal save (>= 3 iterations per segment)
    assert all(iter_dir(chain, it).is_dir() for it in range(2, ITERS + 1, 2)), sorted(chain.checkpoints.iterdir())
    resumed = [(r["job_id"], r["iteration"]) for r in ledger(chain, "resumed")]
    assert resumed == [("202", stops[0]), ("203", stops[1])]
    consumed = [r["consumed_samples"] for r in ledger(chain, "resumed")]
    assert consumed == [2 * s for s in stops]  # global batch 2: consumed samples continue exactly
    # each resumed segment read the checkpoint it loaded ahead (runtime/checkpoint/readahead.py), the whole of it
    ahead = [(r["job_id"], r["directory"], r["read_bytes"] == r["bytes"] > 0) for r in ledger(chain, "readahead")]
    assert ahead == [("202", iter_dir(chain, stops[0]).name, True), ("203", iter_dir(chain, stops[1]).name, True)]

    ref, got = losses(ref_log), losses(log)
    assert sorted(ref) == sorted(got) == list(range(1, ITERS + 1))
    worst = max(abs(got[i] - ref[i]) / abs(ref[i]) for i in ref)
    assert worst <= 1e-6, {i: (ref[i], got[i]) for i in ref if not math.isclose(ref[i], got[i], rel_tol=1e-6)}

    a, b = checkpoint_state(iter_dir(straight, ITERS)), checkpoint_state(iter_dir(chain, ITERS))
    assert a.keys() == b.keys()
    assert a["optimizer.step"] == b["optimizer.step"] == ITERS  # Adam's step survived two resumes
    compared = 0
    for key in a:
        if key.startswith(("optimizer.", "embedding", "decoder", "output_layer")) and key != "optimizer.step":
            compared += 1
            assert (a[key] - b[key]).abs().max().item() <= 1e-6 * max(1.0, a[key].abs().max().item()), key
    assert compared > 10 and any(".exp_avg_sq" in k for k in a)  # weights and Adam moments

    _check_wandb(chain, stops)


def _check_wandb(paths, stops: list[int]) -> None:
    from megalaunch.rundir.files import read_json

    state = read_json(paths.state / "wandb.json")
    runs = sorted((paths.root / "wandb").glob("offline-run-*"))
    assert len(runs) == 3, runs
    assert {r.name.split("-")[3] for r in runs} == {state["id"]}  # offline-run-DATE_TIME-ID[-N]: one id
    steps = [s for r in runs for s in _history_steps(r)]
    assert steps == sorted(steps) and len(steps) == len(set(steps)), steps
    assert steps[-1] == ITERS and state["last_step"] == ITERS
    for r in runs:  # every segment logs its start-up phases once, with its first metrics
        keys = _history_keys(r)
        assert {"segment/startup_s", "segment/imports_s", "segment/checkpoint_load_s", "loss"} <= keys, keys


def _history_keys(run_dir: Path) -> set[str]:
    return {k for keys in _records(run_dir, "keys") for k in keys}


def _history_steps(run_dir: Path) -> list[int]:
    return list(_records(run_dir, "step"))


def _records(run_dir: Path, what: str) -> list:
    """The step of every history record in an offline run's .wandb file (a leveldb-style log of
    protobuf records after a 7-byte header; wandb 0.31 has no Python reader for it any more)."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, steps = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding up to the next block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a complete record
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            if rec.WhichOneof("record_type") == "history":
                steps.append(int(rec.history.step.num) if what == "step" else
                             {item.key or "/".join(item.nested_key) for item in rec.history.item})
    return steps
