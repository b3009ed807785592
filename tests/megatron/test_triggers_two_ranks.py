"""Triggers on 2 processes (DP=2, gloo): save, exit and abort are acted on by both ranks at the
same iteration (asserted from each rank's log), with the right checkpoint and outcome."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import Trainer, acted_iterations, last_iteration, ledger, make_run, wait_for

from megalaunch.rundir.triggers import TriggerBox
from megalaunch.runtime.checkpoint.resume import is_complete

pytestmark = pytest.mark.megatron

TWO_RANKS = ("cluster.tasks_per_node=2", "training.micro_batch_size=1", "training.global_batch_size=2",
             "training.train_iters=400", "checkpoint.save_interval=1000")


def _both_acted(t: Trainer, decision: str, count: int = 1) -> list[int]:
    def done() -> list[int] | None:
        its = [acted_iterations(t.log(r), decision) for r in (0, 1)]
        return its[0] if all(len(i) >= count for i in its) else None

    wait_for(done, what=f"both ranks acting on {decision}", trainer=t)
    rank0, rank1 = (acted_iterations(t.log(r), decision) for r in (0, 1))
    assert rank0 == rank1, (rank0, rank1)  # the same iteration on every rank
    return rank0


def test_save_exit_abort_on_two_ranks(tmp_path: Path) -> None:
    paths = make_run(tmp_path, *TWO_RANKS)
    loss_log = tmp_path / "loss.jsonl"
    t = Trainer(paths, world=2, job_id="31", env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    wait_for(lambda: last_iteration(loss_log) >= 3, what="iteration 3", trainer=t)

    TriggerBox(paths).write("save", "test: save and continue")
    (saved_at,) = _both_acted(t, "save")
    assert is_complete(paths, saved_at) and paths.read_tracker() == saved_at
    wait_for(lambda: last_iteration(loss_log) > saved_at + 1, what="training after the save", trainer=t)

    TriggerBox(paths).write("exit", "test: save and stop")
    (exited_at,) = _both_acted(t, "exit")
    assert t.wait() == [0, 0]
    out = t.outcome()
    assert (out["status"], out["iteration"]) == ("exited", exited_at)
    assert exited_at > saved_at and paths.read_tracker() == exited_at and is_complete(paths, exited_at)
    consumed = {(r["verb"], r["consumed_iteration"]) for r in TriggerBox(paths).consumed()}
    assert consumed == {("save", saved_at), ("exit", exited_at)}
    assert not list(paths.triggers.glob("save")) and not list(paths.triggers.glob("exit"))

    # The next segment resumes there; an abort stops both ranks at one iteration, without a save.
    t = Trainer(paths, world=2, job_id="32", env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    wait_for(lambda: last_iteration(loss_log) >= exited_at + 2, what="training after the resume", trainer=t)
    TriggerBox(paths).write("abort", "test: stop now")
    (aborted_at,) = _both_acted(t, "abort")
    assert t.wait() == [0, 0]
    out = t.outcome()
    assert (out["status"], out["iteration"]) == ("aborted", aborted_at)
    assert paths.read_tracker() == exited_at  # nothing saved on abort
    assert [r["iteration"] for r in ledger(paths, "resumed")] == [exited_at]
    decisions = [(r["decision"], r["iteration"]) for r in ledger(paths, "decision")]
    assert decisions == [("save", saved_at), ("exit", exited_at), ("abort", aborted_at)]
