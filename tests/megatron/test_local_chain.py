"""The real trainer on the local backend, the way a user runs it (`megalaunch submit`): the tiny recipe on
2 ranks as a chain of >= 3 segments with periodic saves, each stopped by the local timer's stop signal,
which goes to every process of each task as Slurm's does (checkpoint writers included); every segment
ends `saved` at the iteration it acted on the signal, the next resumes there with the same consumed
samples, no iteration is lost or repeated (a signal that comes during a periodic save leaves with that one
checkpoint); a `trigger save` early in the second segment changes none of it.

Timing (sizes derived below): the local timer is exact; lead = save 5 + step 2 + margin 8 = 15 s, and
chain.min_train_time_s = the signal's time caps it there (a slow save cannot raise it and move the signal
earlier). A segment starts its ranks, which train from their first iteration until the signal, SIGNAL_S
after the start; an iteration is the 1.0 s pacing sleep + a step of 20 ms idle, up to 600 ms on a machine
loaded by 3 pytest workers and more. A rank forked from the tests' fork server
(tests/support/forkserver.py) reaches its first iteration 2..9 s after the start there (12 s allowed);
fresh interpreters (MEGALAUNCH_TEST_FORK=0) 7..20 s (30 allowed). The signal comes TRIGGER_S after the
slowest start: the second segment's 3 iterations past its resume point, up to 3 more so that the
trigger does not fall on a periodic save, `trigger save` (0.2 s idle, CLI_S allowed) and the next
iteration's decision fit before it. A segment trains at most MAX_ITERS (the fastest start and steps),
so TRAIN_ITERS = 2 x MAX_ITERS + 1 is never done in 2 segments; typically 3 (forked: ~20 iterations
each, ~90 s of chain), 4 or 5 on a very loaded machine. Every iteration costs both ranks CPU (~0.2 s
together), so few iterations keep the test cheap: the waiting is the pacing sleep's, which costs none."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from tests.support import forkserver

from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import checkpoint_iterations

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

STARTUP_S = (1.5, 12) if forkserver.enabled() else (5, 30)  # a segment's start to its first iteration
ITERATION_S = (1.0, 1.6)
CLI_S = 3
TRIGGER_S = math.ceil((3 + 3 + 1) * ITERATION_S[1] + CLI_S)  # 15
SIGNAL_S = STARTUP_S[1] + TRIGGER_S  # forked 27, fresh 45
LEAD_S = 15
MAX_ITERS = math.ceil((SIGNAL_S - STARTUP_S[0]) / ITERATION_S[0]) + 1  # + the one in flight at the signal
TRAIN_ITERS = 2 * MAX_ITERS + 1  # forked 55, fresh 83
SAVE_INTERVAL = 10
GBS = 8
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|")
SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) ")


def _wait[T](fn: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := fn()) is not None:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _run(tmp: Path) -> RunPaths | None:
    runs = [p for p in (tmp / "runs").glob("*") if not p.name.startswith(".")]
    return RunPaths(runs[0]) if runs and (runs[0] / "state" / "ledger.jsonl").exists() else None


def _second_segment_training(paths: RunPaths) -> str | None:
    """The second segment's job id once it has trained 3 iterations past its resume point, and the next 3
    iterations (where the trigger will be acted on) hold no periodic save: the trigger's own checkpoint."""
    segments = Ledger(paths).segments()
    if len(segments) < 2 or segments[1].resumed is None:
        return None
    iteration = (read_json(paths.progress) or {}).get("iteration") or 0
    start = segments[1].resumed["iteration"]
    periodic_ahead = -iteration % SAVE_INTERVAL  # iterations to the next periodic save (0: this one)
    return segments[1].job_id if iteration >= start + 3 and periodic_ahead not in (1, 2, 3) else None


@pytest.mark.timeout(900)
def test_local_chain_with_periodic_saves_saves_on_every_signal(tmp_path: Path) -> None:
    recipe = {
        "include": ["tiny"], "name": "localchain", "run": {"root": str(tmp_path / "runs")},
        "cluster": {"tasks_per_node": 2, "time": "00:{:02d}:{:02d}".format(*divmod(SIGNAL_S + LEAD_S, 60)),
                    "python": forkserver.python(),
                    "env": {"MEGALAUNCH_TEST_STEP_SLEEP_S": str(ITERATION_S[0]), "OMP_NUM_THREADS": "1"}},
        "training": {"train_iters": TRAIN_ITERS, "log_interval": 1},
        "checkpoint": {"save_interval": SAVE_INTERVAL, "save_time_estimate_s": 5, "keep_last": 50},
        "chain": {"step_time_estimate_s": 2, "signal_margin_s": 8, "min_train_time_s": SIGNAL_S},
    }
    path = tmp_path / "localchain.yaml"
    path.write_text(yaml.safe_dump(recipe))
    chain = subprocess.Popen([sys.executable, "-m", "megalaunch.cli.main", "submit", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        paths = _wait(lambda: _run(tmp_path), 120, "the run directory")
        # a `trigger save` early in the second segment, before that segment's periodic saves and signal
        second = _wait(lambda: _second_segment_training(paths), 300, "the second segment to train")
        trigger = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "trigger", "save", str(paths.root)],
                                 capture_output=True, text=True, timeout=60)
        assert trigger.returncode == 0, trigger.stderr
        out, _ = chain.communicate(timeout=840)
    finally:
        if chain.poll() is None:
            chain.kill()
    assert chain.returncode == 0, out[-3000:]
    segments = Ledger(paths).segments()
    events = read_jsonl(paths.ledger)
    stops = {e["job_id"]: e["iteration"] for e in events if e["event"] == "decision" and e["decision"] == "signal"}
    (triggered,) = [e for e in events if e["event"] == "decision" and e["decision"] == "save"]
    assert triggered["job_id"] == second and triggered["triggers"] == ["save"], triggered
    assert len(segments) >= 3, [s.ended for s in segments]
    assert [s.outcome for s in segments] == ["saved"] * (len(segments) - 1) + ["finished"], [s.ended for s in segments]
    previous = 0
    saved: dict[str, list[int]] = {}
    for s in segments:
        log = paths.segment_log(s.job_id).read_text(errors="replace")
        its = [(int(m.group(1)), int(m.group(2))) for m in ITERATION.finditer(log)]
        last = s is segments[-1]
        stop = TRAIN_ITERS if last else stops[s.job_id]
        assert [i for i, _ in its] == list(range(previous + 1, stop + 1)), (s.job_id, its[:2], its[-2:], previous)
        assert all(samples == i * GBS for i, samples in its), s.job_id
        assert s.start_iteration == (previous or None), (s.job_id, s.start_iteration, previous)
        # a periodic save due inside the signal window is skipped (the stop save takes its place)
        skipped = {e["iteration"] for e in events if e["event"] == "save_skipped" and e["job_id"] == s.job_id}
        periodic = [i for i in range(previous + 1, stop) if i % SAVE_INTERVAL == 0 and i not in skipped]
        # the triggered save; when it fell on the stop iteration (the signal came during it, so late in a
        # slow segment), that one checkpoint was the stop save too and nothing was saved twice
        extra = [triggered["iteration"]] if s.job_id == second and triggered["iteration"] != stop else []
        if s.job_id == second and triggered["iteration"] == stop:
            (late,) = [e for e in events if e["event"] == "decision" and e["decision"] == "signal" and e["job_id"] == second]
            assert late.get("during_save") is True, late
        saved[s.job_id] = [int(m.group(1)) for m in SAVED.finditer(log)]
        assert saved[s.job_id] == [*sorted({*periodic, *extra}), stop], s.job_id
        assert "Broken pipe" not in log and "Traceback" not in log, log[-3000:]
        assert s.ended is not None and s.ended["checkpoint_iteration"] == stop, s.ended
        previous = stop
    # some segment saved before its signal and then wrote the stop save too: the writer process its first
    # save started survived the signal (a signal during a save instead leaves with that one checkpoint)
    assert any(len(saved[s.job_id]) >= 2 for s in segments[:-1]), saved
    assert paths.read_tracker() == TRAIN_ITERS
    skipped = {e["iteration"] for e in events if e["event"] == "save_skipped"}
    assert set(stops.values()) | (set(range(SAVE_INTERVAL, TRAIN_ITERS + 1, SAVE_INTERVAL)) - skipped) | {
        TRAIN_ITERS, triggered["iteration"]} == set(checkpoint_iterations(paths))
    # the supervisors recorded every rank of every segment, all clean exits
    for s in segments:
        records = sorted(paths.tasks(s.job_id).glob("rank-*.json"))
        assert len(records) == 2, s.job_id
