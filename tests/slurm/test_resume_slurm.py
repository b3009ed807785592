"""`megalaunch resume` on a real Slurm cluster (issue 15, items 3 and 4): a finished run is refused
without a job reaching the queue; `resume --set training.train_iters=N` records the change and the
chain trains on to the new target."""

from __future__ import annotations

from pathlib import Path

from cluster import queue_ids, run_as, wait_for
from launch import MEGALAUNCH, REPO, counter_recipe, ledger, run_dir_of, submitted_ids

TARGET = 30


def megalaunch(user: str | None, *args: str, cwd: Path):
    """This checkout's megalaunch (the installed one may be another's), in the jobs it submits too."""
    env = {"XDG_STATE_HOME": str(cwd / ".state-root"), "PYTHONPATH": str(REPO / "src")}
    return run_as(user, [MEGALAUNCH, *args], env, cwd=cwd, timeout=120)


def _chain_stopped(run: Path, count: int) -> bool:
    return sum(e["event"] == "chain_stopped" for e in ledger(run)) >= count and not queue_ids(name=run.name)


def test_finished_run_is_refused_before_the_queue_and_set_trains_further(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "resumecheck", training={"train_iters": TARGET, "lr_warmup_iters": 1},
                            checkpoint={"save_interval": 10})
    proc = megalaunch(None, "submit", str(recipe), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: _chain_stopped(run, 1), 240, interval=1, what="the chain to reach its target")
    jobs = submitted_ids(run)

    refused = megalaunch(None, "resume", str(run), cwd=slurm_tmp)
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "already reached its target" in refused.stderr and "--set training.train_iters=N" in refused.stderr
    assert submitted_ids(run) == jobs and not queue_ids(name=run.name)  # nothing reached Slurm

    more = megalaunch(None, "resume", str(run), "--set", f"training.train_iters={2 * TARGET}", cwd=slurm_tmp)
    assert more.returncode == 0, more.stderr
    assert f"training.train_iters: {TARGET} -> {2 * TARGET}" in more.stdout
    (change,) = [e for e in ledger(run) if e["event"] == "settings_changed"]
    assert change["changes"] == [{"key": "training.train_iters", "old": TARGET, "new": 2 * TARGET}]
    assert change["user"] == "root"
    wait_for(lambda: _chain_stopped(run, 2), 240, interval=1, what="the resumed chain to reach the new target")
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(2 * TARGET)
    assert len(submitted_ids(run)) > len(jobs)
