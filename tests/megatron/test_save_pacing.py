"""Save pacing with Megatron's real asynchronous save (its persistent writer, on a CPU through
MEGALAUNCH_TEST_CPU_ASYNC_SAVE), the tiny model on one rank (runtime/stop/save_pacing.py, issue #50). The
write in flight is held by the test (MEGALAUNCH_TEST_WRITE_GATE: the writer waits until a file exists), so
"still writing" is a state the test controls, not a duration it guesses:

- a periodic save due while the previous one is held is deferred and training goes on (the iterations
  after it are trained while the write is held: blocked, they never would be); once the write completes,
  the owed save is taken at the next step, and that checkpoint holds exactly its iteration's state;
- a stop signal while a periodic save is held leaves with that save (no second write): the segment ends
  `saved`, the tracker at that save, and the next segment resumes there and trains the same iterations to
  the same losses as the segment that was stopped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness import Trainer, checkpoint_state, ledger, losses, make_run, wait_for

from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import checkpoint_iterations, iter_dir

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

GBS = 2  # harness.FAST: global batch 2
ASYNC = ["megatron_args.async_save=true", "megatron_args.use_persistent_ckpt_worker=true",
         "megatron_args.async_strategy=mcore", "checkpoint.keep_last=0", "checkpoint.save_time_estimate_s=300"]
SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) ")


def _env(gate: Path, loss_log: Path) -> dict[str, str]:
    return {"MEGALAUNCH_TEST_CPU_ASYNC_SAVE": "1", "MEGALAUNCH_TEST_WRITE_GATE": str(gate),
            "MEGALAUNCH_LOSS_LOG": str(loss_log)}


def _iteration(paths: RunPaths) -> int:
    return int((read_json(paths.progress) or {}).get("iteration", 0))


@pytest.mark.timeout(300)
def test_a_periodic_save_due_during_a_write_is_deferred_not_blocked(tmp_path: Path) -> None:
    paths = make_run(tmp_path, "training.train_iters=14", "checkpoint.save_interval=3", *ASYNC)
    gate = tmp_path / "gate"
    t = Trainer(paths, env=_env(gate, tmp_path / "loss.jsonl"))
    try:
        deferred = wait_for(lambda: ledger(paths, "save_deferred"), 240, "a deferred periodic save", t)[0]
        # the write of 3 is held, yet training goes on past the save due at 6 (a blocked save would stop it)
        wait_for(lambda: _iteration(paths) >= 8, 120, "iterations after the deferred save", t)
        assert ledger(paths, "deferred_save_taken") == [] and not paths.tracker.exists()  # 3 is still writing
        gate.touch()
        assert t.wait() == [0], t.log()[-3000:]
    finally:
        t.kill()
    assert (deferred["iteration"], deferred["kind"], deferred["writing"]) == (6, "periodic", 3)
    taken = ledger(paths, "deferred_save_taken")[0]
    assert (taken["due"], taken["by"], taken["waited"]) == (6, "periodic", False) and taken["iteration"] > 8, taken
    assert t.outcome()["status"] == "finished"
    saved = [int(m.group(1)) for m in SAVED.finditer(t.log())]
    assert saved[:2] == [3, taken["iteration"]] and saved[-1] == 14, saved
    assert 6 not in saved  # deferred, never written late under its own number
    late = checkpoint_state(iter_dir(paths, taken["iteration"]))
    assert late["iteration"] == late["optimizer.step"] == taken["iteration"]  # the state of the step it was taken at


@pytest.mark.timeout(400)
def test_a_stop_during_a_write_leaves_with_it_and_resumes_exactly(tmp_path: Path) -> None:
    paths = make_run(tmp_path, "training.train_iters=9", "training.lr_warmup_iters=1", "checkpoint.save_interval=3", *ASYNC)
    gate, first_log = tmp_path / "gate", tmp_path / "loss1.jsonl"
    t = Trainer(paths, job_id="1", env=_env(gate, first_log))
    try:
        wait_for(lambda: _iteration(paths) >= 5, 240, "iterations after the save at 3", t)
        t.signal()  # SIGUSR2 to every process of the rank, the checkpoint writer included
        wait_for(lambda: "Finalizing them synchronously now" in t.log(), 120, "the stop waiting for the write", t)
        gate.touch()
        assert t.wait() == [0], t.log()[-3000:]
    finally:
        t.kill()
    out = t.outcome()
    stopped_at = out["iteration"]
    assert out["status"] == "saved" and stopped_at > 3, out
    (replaced,) = ledger(paths, "stop_save_replaced")
    assert (replaced["iteration"], replaced["checkpoint"], replaced["iterations_lost"]) == (stopped_at, 3, stopped_at - 3)
    (decision,) = ledger(paths, "decision")
    assert (decision["decision"], decision["iteration"], decision["checkpoint"]) == ("signal", stopped_at, 3)
    assert [int(m.group(1)) for m in SAVED.finditer(t.log())] == [3]  # one write: no stop save after it
    assert checkpoint_iterations(paths) == [3] and paths.tracker.read_text().strip() == "3"
    # the next segment resumes from 3 and trains 4.. to the same losses as the stopped one did
    second_log = tmp_path / "loss2.jsonl"
    t2 = Trainer(paths, job_id="2", env=_env(gate, second_log))
    assert t2.wait() == [0], t2.log()[-3000:]
    assert t2.outcome()["status"] == "finished"
    (resumed,) = [r for r in ledger(paths, "resumed") if r["job_id"] == "2"]
    assert (resumed["iteration"], resumed["consumed_samples"]) == (3, 3 * GBS)
    first, second = losses(first_log), losses(second_log)
    assert sorted(second) == list(range(4, 10))
    redone = range(4, stopped_at + 1)
    assert [first[i] for i in redone] == pytest.approx([second[i] for i in redone], rel=1e-6)
