"""`megalaunch report` on the real trainer: the tiny recipe on 2 CPU ranks as a local chain of at least
two segments (each stopped by the local timer's signal, then finished), reported through the CLI
as a user runs it. Every segment's components, measured by the trainer's timeline, add up to its wall
time (job begin -> job end in the ledger) within 1 s; one timeline bar per segment; valid figures.

Timing (sizes derived below): lead = save 5 + step 2 + margin 8 = 15 s (the local timer is exact;
chain.min_train_time_s = the signal's time caps the lead there), so the signal comes SIGNAL_S after a
segment starts. The ranks are forked from the tests' fork server (tests/support/forkserver.py): their
first iteration ends 2..9 s after the start on a machine loaded by 3 pytest workers and more (12 s
allowed; fresh interpreters, MEGALAUNCH_TEST_FORK=0: 7..20 s, 30 allowed), and the signal comes a few
iterations after the slowest start. An iteration is the 1.0 s pacing sleep + a step of 20 ms idle, up
to 600 ms loaded, so a segment trains at most MAX_ITERS (the fastest start and steps): TRAIN_ITERS =
MAX_ITERS + 1 takes 2 segments (3 on a very loaded machine), ~35 s of chain forked. Few iterations keep
it cheap: each costs both ranks CPU, the pacing sleep none."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.support import forkserver
from tests.unit.test_report import FIGURES, assert_png, parse

from megalaunch.launcher.accounting.goodput import COMPONENTS
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

STARTUP_S = (1.5, 12) if forkserver.enabled() else (5, 30)  # a segment's start to its first iteration
ITERATION_S = (1.0, 1.6)
SIGNAL_S = STARTUP_S[1] + 6  # forked 18, fresh 36
LEAD_S = 15
MAX_ITERS = math.ceil((SIGNAL_S - STARTUP_S[0]) / ITERATION_S[0]) + 1  # + the one in flight at the signal
TRAIN_ITERS = MAX_ITERS + 1  # forked 19, fresh 33


@pytest.mark.timeout(300)
def test_report_of_a_tiny_chain(tmp_path: Path) -> None:
    recipe = {
        "include": ["tiny"], "name": "reptiny", "run": {"root": str(tmp_path / "runs")},
        "cluster": {"tasks_per_node": 2, "time": "00:{:02d}:{:02d}".format(*divmod(SIGNAL_S + LEAD_S, 60)),
                    "python": forkserver.python(),
                    "env": {"OMP_NUM_THREADS": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": str(ITERATION_S[0])}},
        "training": {"train_iters": TRAIN_ITERS, "log_interval": 5},
        "checkpoint": {"save_interval": 20, "save_time_estimate_s": 5},
        "chain": {"step_time_estimate_s": 2, "signal_margin_s": 8, "min_train_time_s": SIGNAL_S},
    }
    path = tmp_path / "reptiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    chain = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "submit", str(path)], capture_output=True,
                           text=True, timeout=280, stdin=subprocess.DEVNULL)
    assert chain.returncode == 0, chain.stdout[-3000:] + chain.stderr[-3000:]
    (root,) = (tmp_path / "runs").glob("reptiny-*")
    paths = RunPaths(root)
    segments = Ledger(paths).segments()
    assert len(segments) >= 2 and segments[-1].outcome == "finished", [s.ended for s in segments]

    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "report", str(root), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == str(out / "report.html")
    assert proc.stdout.splitlines()[1].startswith("goodput ")
    for name in FIGURES:
        assert_png(out / name)
    page = parse(out / "report.html")
    assert len(page.bars) == len(segments)
    assert [row["job"] for row in page.goodput] == [s.job_id for s in segments]
    for row, seg in zip(page.goodput, segments, strict=True):
        parts: dict[str, float] = row["parts"]  # type: ignore[assignment]
        assert set(parts) == set(COMPONENTS)
        assert seg.started and seg.ended
        wall = seg.ended["time"] - seg.started["time"]
        assert abs(sum(parts.values()) - wall) < 1.0, (seg.job_id, parts, wall)
        # the trainer's phases were all seen: start-up, training and saves, no untracked time
        assert parts["imports"] > 0 and parts["productive"] > 0 and parts["checkpoint_save"] > 0, parts
        assert parts.get("untracked", 0.0) == 0.0 and parts["failed"] == 0.0, parts
