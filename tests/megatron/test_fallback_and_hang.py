"""A truncated newest checkpoint -> resume from the previous one, recorded in the ledger; a rank
stuck in a step -> every rank's stacks dumped, outcome `hung`, within hang_timeout plus one check."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Trainer, ledger, losses, make_run

from megalaunch.rundir.files import read_json
from megalaunch.runtime.checkpoint.resume import iter_dir
from megalaunch.runtime.health.watchdog import EXIT_HUNG

pytestmark = pytest.mark.megatron


def test_truncated_newest_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    paths = make_run(tmp_path, "training.train_iters=10", "checkpoint.save_interval=5", "training.lr_warmup_iters=1")
    loss_log = tmp_path / "loss.jsonl"
    t = Trainer(paths, job_id="41", env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    assert t.wait() == [0] and t.outcome()["status"] == "finished"
    first = losses(loss_log)
    shard = next(iter_dir(paths, 10).glob("*.distcp"))
    with open(shard, "r+b") as f:  # a save cut short by a full disk or a killed writer
        f.truncate(shard.stat().st_size // 2)

    t = Trainer(paths, job_id="42", env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    assert t.wait() == [0], t.log()[-2000:]
    assert t.outcome()["status"] == "finished" and t.outcome()["resumed_from"] == 5
    (fallback,) = ledger(paths, "resume_fallback")
    assert fallback["to"] == 5 and fallback["job_id"] == "42"
    assert fallback["rejected"][0]["iteration"] == 10 and "truncated shard" in fallback["rejected"][0]["reason"]
    # moved aside, then deleted by the retention after the next save (the ledger keeps the reason)
    assert not (paths.checkpoints / "iter_0000010.incomplete-42").exists()
    (gone,) = ledger(paths, "incomplete_checkpoint_deleted")
    assert gone["directory"] == "iter_0000010.incomplete-42" and gone["job_id"] == "42"
    assert [r["iteration"] for r in ledger(paths, "resumed")] == [5]
    assert losses(loss_log) == first  # iterations 6-10 retrained exactly
    assert paths.read_tracker() == 10


def test_stuck_rank_dumps_stacks_and_ends_hung(tmp_path: Path) -> None:
    timeout = 20.0
    paths = make_run(tmp_path, "cluster.tasks_per_node=2", "training.micro_batch_size=1",
                     "training.global_batch_size=2", "training.train_iters=100", f"chain.hang_timeout_s={timeout}")
    t = Trainer(paths, world=2, job_id="51", env={"MEGALAUNCH_TEST_HANG": "4:1"})  # rank 1 stops in iteration 4
    codes = t.wait(timeout=240)
    assert codes == [EXIT_HUNG, EXIT_HUNG], (codes, t.log(0)[-2000:], t.log(1)[-2000:])
    out = t.outcome()
    assert out["status"] == "hung" and out["iteration"] == 3
    last_progress = read_json(paths.progress)["time"]
    check_s = min(30.0, max(0.5, timeout / 10))
    assert timeout <= out["time"] - last_progress <= timeout + check_s + 5  # + 5 s for a loaded machine
    stacks = {r: (paths.debug / f"stacks-job51-rank{r}.txt").read_text() for r in (0, 1)}
    assert "maybe_hang" in stacks[1]  # the stuck rank, inside the test hook
    assert "all_reduce" in stacks[0] or "train_step" in stacks[0]  # the other, waiting in a collective
    assert ledger(paths, "hung")
