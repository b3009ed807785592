"""Issue 23 in the job, with Megatron's own saves on the CPU (the tiny recipe, one rank):

- A filesystem that fills during a run: the run root on a 16 MB tmpfs, submitted on the local backend
  as a user would; after the first checkpoint the test fills the filesystem from outside, leaving less
  than one checkpoint. The next periodic save is skipped and recorded and training goes on; then
  `trigger exit` asks for a stop save that does not fit: the segment ends `storage_full`, the chain
  stops after that one segment, no node is suspected, no unfinished `iter_*` is left, and `status`
  names the filesystem and the fix.
- `keep_last` means what it says across a resume: sampled while two segments run, the checkpoint
  directory never holds more than keep_last + 1 (the complete ones plus the one being written), the
  checkpoint the second segment resumed from included.

Timing (a quiet 2-core machine): start-up of one rank 5..15 s; an iteration is the 0.25 s pacing
sleep + ~50 ms, so the 10 iterations between two saves leave the test ~3 s to fill the disk after the
first checkpoint, far more than the ~0.1 s it takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import Trainer, ledger, make_run, wait_for
from tests.support import forkserver
from tests.support.tmpfs import fill, mounted_tmpfs

from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import checkpoint_iterations, is_complete

pytestmark = pytest.mark.megatron

MB = 10**6
CLI = [sys.executable, "-m", "megalaunch.cli.main"]


def _run_dir(runs: Path) -> RunPaths | None:
    found = [p for p in runs.glob("*") if not p.name.startswith(".")] if runs.is_dir() else []
    return RunPaths(found[0]) if found and (found[0] / "state" / "ledger.jsonl").exists() else None


def _event(paths: RunPaths, name: str) -> dict[str, Any] | None:
    return next((e for e in read_jsonl(paths.ledger) if e.get("event") == name), None)


@pytest.mark.timeout(300)
def test_a_filesystem_that_fills_during_a_run(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "fs", "16m") as fs:
        recipe = {
            "include": ["tiny"], "name": "full", "run": {"root": str(fs / "runs")},
            "cluster": {"tasks_per_node": 1, "time": "00:10:00", "python": forkserver.python(),
                        "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.25", "OMP_NUM_THREADS": "1"}},
            "training": {"train_iters": 1000, "log_interval": 1, "micro_batch_size": 2, "global_batch_size": 2},
            "checkpoint": {"save_interval": 10, "keep_last": 2},
        }
        (tmp_path / "full.yaml").write_text(yaml.safe_dump(recipe))
        chain = subprocess.Popen([*CLI, "submit", str(tmp_path / "full.yaml")], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        try:
            paths = wait_for(lambda: _run_dir(fs / "runs"), 60, "the run directory")
            first = wait_for(paths.read_tracker, 120, "the first checkpoint")
            fill(fs, MB // 2)  # from outside the run: less than one checkpoint (1.8 MB) left
            skipped = wait_for(lambda: _event(paths, "save_skipped"), 60, "a skipped save")
            wait_for(lambda: ((read_json(paths.progress) or {}).get("iteration") or 0) >= skipped["iteration"] + 2,
                     60, "training to go on after the skipped save")
            trigger = subprocess.run([*CLI, "trigger", "exit", str(paths.root)], capture_output=True, text=True,
                                     timeout=60)
            assert trigger.returncode == 0, trigger.stderr
            out, _ = chain.communicate(timeout=120)
        finally:
            if chain.poll() is None:
                chain.kill()
        assert skipped["iteration"] == first + 10 and skipped["kind"] == "periodic", (first, skipped)
        assert skipped["filesystem"] == "tmpfs" and skipped["free_bytes"] < MB < skipped["need_bytes"], skipped
        (ended,) = ledger(paths, "ended")  # one segment, and the chain stopped after it
        assert ended["outcome"] == "storage_full", ended
        assert ledger(paths, "node_suspected") == [] and ledger(paths, "guard") == []
        (stopped,) = ledger(paths, "chain_stopped")
        assert stopped["reason"].startswith("storage full, no retry can fix it: filesystem tmpfs"), stopped
        outcome = read_json(paths.outcome)
        assert outcome["status"] == "storage_full" and "no room for the stop save at iteration" in outcome["reason"]
        assert outcome["need_bytes"] == skipped["need_bytes"] and outcome["filesystem"] == "tmpfs"
        # no unfinished save left: every checkpoint directory is complete, the newest is the first one
        assert checkpoint_iterations(paths) == [first] and is_complete(paths, first)
        log = paths.segment_log(ended["job_id"]).read_text(errors="replace")
        assert f"periodic save at iteration {first + 10} skipped: not enough free space: filesystem tmpfs" in log, log[-3000:]
        status = subprocess.run([*CLI, "status", str(paths.root)], capture_output=True, text=True, timeout=60)
        assert "storage full" in status.stdout and f"filesystem tmpfs ({fs}, tmpfs)" in status.stdout, status.stdout
        assert f"megalaunch resume {paths.root}" in status.stdout
        last_skip = ledger(paths, "save_skipped")[-1]  # a loaded machine may skip another before the exit acts
        assert f"warning: the periodic save at iteration {last_skip['iteration']} was skipped" in status.stdout, \
            status.stdout
        assert chain.returncode is not None, out[-3000:]


class Sampler:
    """The checkpoint directories seen on disk while a segment runs (polled, as `ls` would see them)."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self.most: list[int] = []

    def sample(self) -> None:
        present = checkpoint_iterations(self.paths)
        if len(present) > len(self.most):
            self.most = present

    def until(self, predicate: Any, trainer: Trainer, what: str) -> Any:
        def probe() -> Any:
            self.sample()
            return predicate()
        return wait_for(probe, 120, what, trainer=trainer)


def test_keep_last_holds_across_a_resume(tmp_path: Path) -> None:
    keep_last = 1
    paths = make_run(tmp_path, "training.train_iters=60", "checkpoint.save_interval=2",
                     f"checkpoint.keep_last={keep_last}", "training.lr_warmup_iters=2")
    sampler = Sampler(paths)
    env = {"MEGALAUNCH_TEST_STEP_SLEEP_S": "0.1"}
    for job in ("1", "2"):
        t = Trainer(paths, job_id=job, env=env)
        start = paths.read_tracker() or 0
        sampler.until(lambda s=start: (paths.read_tracker() or 0) >= s + 6, t, f"three saves in segment {job}")
        t.signal()
        sampler.until(lambda t=t: all(p.poll() is not None for p in t.procs), t, f"segment {job} to end")
        assert t.wait() == [0] and t.outcome()["status"] == "saved", t.log()[-3000:]
    (resumed,) = ledger(paths, "resumed")
    assert len(sampler.most) <= keep_last + 1, sampler.most  # the complete one + the one being written
    assert checkpoint_iterations(paths) == [paths.read_tracker()]  # retention after the stop save too
    deleted = [e["iteration"] for e in ledger(paths, "checkpoint_deleted")]
    assert resumed["iteration"] in deleted  # the checkpoint resumed from went once a newer one was complete
