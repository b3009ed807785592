"""One save per stop, with the real trainer on the local backend (docs/training.md, "The signal lead"):
the stop signal arrives while a slow periodic save is writing (MEGALAUNCH_TEST_SAVE_DELAY_S makes it
6 s; the test delivers SIGUSR2 to every process of the task, as Slurm and the local timer do, once the
save's log line says it is under way). The segment writes exactly that one checkpoint and leaves with it
(`saved` at its iteration, 0 iterations lost, no second save), within the lead; the next segment resumes
there with the same consumed samples and finishes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from megalaunch.config.loader import load_run_recipe
from megalaunch.config.preflight import signal_lead_s
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import checkpoint_iterations
from megalaunch.runtime.task import descendants

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

SAVE_AT, TRAIN_ITERS, GBS = 3, 5, 2
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|")
SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) ")


def _wait[T](fn: Callable[[], T | None], timeout: float, what: str, chain: subprocess.Popen[str]) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := fn()) is not None:
            return value
        assert chain.poll() is None, f"the chain ended before {what}: {chain.communicate()[0][-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _log_says(tmp: Path, job: str, text: str) -> RunPaths | None:
    runs = [p for p in (tmp / "runs").glob("*") if not p.name.startswith(".")]
    if not runs:
        return None
    paths = RunPaths(runs[0])
    log = paths.segment_log(job)
    return paths if log.exists() and text in log.read_text(errors="replace") else None


@pytest.mark.timeout(300)
def test_a_stop_during_a_periodic_save_leaves_with_that_checkpoint(tmp_path: Path) -> None:
    recipe = {
        "include": ["tiny"], "name": "stopsave", "run": {"root": str(tmp_path / "runs")},
        "cluster": {"tasks_per_node": 1, "time": "00:10:00", "python": sys.executable,
                    "env": {"MEGALAUNCH_TEST_SAVE_DELAY_S": "6:periodic", "OMP_NUM_THREADS": "1"}},
        "training": {"train_iters": TRAIN_ITERS, "log_interval": 1, "micro_batch_size": 2,
                     "global_batch_size": GBS, "lr_warmup_iters": 1},
        "checkpoint": {"save_interval": SAVE_AT, "save_time_estimate_s": 30, "keep_last": 5},
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 3},
    }
    path = tmp_path / "stopsave.yaml"
    path.write_text(yaml.safe_dump(recipe))
    chain = subprocess.Popen([sys.executable, "-m", "megalaunch.cli.main", "submit", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        paths = _wait(lambda: _log_says(tmp_path, "local-1", "test hook: this periodic save takes"), 240,
                      "the slow periodic save", chain)
        sent = time.time()
        for pid in descendants(chain.pid):  # every process of the task, as Slurm's --signal does
            os.kill(pid, signal.SIGUSR2)
        out, _ = chain.communicate(timeout=240)
    finally:
        if chain.poll() is None:
            chain.kill()
    assert chain.returncode == 0, out[-3000:]
    first, second = Ledger(paths).segments()
    log = paths.segment_log(first.job_id).read_text(errors="replace")
    assert [int(m.group(1)) for m in SAVED.finditer(log)] == [SAVE_AT], log[-3000:]  # one save, no second
    assert first.outcome == "saved" and first.ended is not None and first.ended["checkpoint_iteration"] == SAVE_AT
    assert [int(m.group(1)) for m in ITERATION.finditer(log)] == list(range(1, SAVE_AT + 1))  # 0 lost
    (decision,) = [e for e in read_jsonl(paths.ledger) if e["event"] == "decision" and e["job_id"] == first.job_id]
    assert (decision["decision"], decision["iteration"], decision.get("during_save")) == ("signal", SAVE_AT, True)
    timeline = read_json(paths.timeline(first.job_id))
    assert isinstance(timeline, dict) and [s[0] for s in timeline["saves"]] == [SAVE_AT]
    # out right after that save (no step, no second save), within the lead (a segment's first save on a
    # CPU spawns its writer: 6 s of hook + 4-15 s here, inside save_time_estimate_s)
    exit_at, save_end = timeline["phases"]["exit"], timeline["saves"][0][2]
    lead = signal_lead_s(load_run_recipe(paths))
    assert timeline["phases"]["signal_received"] >= sent - 0.5 and exit_at - sent < lead, (exit_at - sent, lead)
    assert exit_at - save_end < 2.0, (exit_at, save_end)
    # the next segment resumes exactly there and finishes
    assert second.resumed is not None and second.resumed == {**second.resumed, "iteration": SAVE_AT,
                                                             "consumed_samples": SAVE_AT * GBS}
    log2 = paths.segment_log(second.job_id).read_text(errors="replace")
    its = [(int(m.group(1)), int(m.group(2))) for m in ITERATION.finditer(log2)]
    assert its == [(i, i * GBS) for i in range(SAVE_AT + 1, TRAIN_ITERS + 1)], its
    assert second.outcome == "finished" and checkpoint_iterations(paths) == [SAVE_AT, TRAIN_ITERS]
