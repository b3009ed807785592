"""The hang watchdog fires after `timeout_s` without a beat, dumps every thread's stack, reports,
and exits; beats keep it quiet."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from megalaunch.runtime.health.watchdog import EXIT_HUNG, Watchdog


def test_fires_without_progress(tmp_path: Path) -> None:
    hung: list[str] = []
    exited = threading.Event()
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    started = time.monotonic()
    wd = Watchdog(tmp_path / "debug", rank=3, job_id="77", timeout_s=0.6, check_s=0.1,
                  on_hang=hung.append, exit=fake_exit).start()
    assert exited.wait(10)
    wd.stop()
    assert 0.6 <= time.monotonic() - started < 3
    assert codes == [EXIT_HUNG] and "rank 3" in hung[0] and "hang_timeout 0.6" in hung[0]
    text = (tmp_path / "debug" / "stacks-job77-rank3.txt").read_text()
    assert "no progress" in text and "test_fires_without_progress" in text  # the main thread's stack
    assert "rank 3" in (wd.hang_reported() or "")


def test_beats_keep_it_quiet(tmp_path: Path) -> None:
    hung: list[str] = []
    wd = Watchdog(tmp_path, rank=0, job_id="1", timeout_s=0.5, check_s=0.05, on_hang=hung.append,
                  exit=lambda code: None).start()
    for i in range(20):
        wd.beat(f"iteration {i}")
        time.sleep(0.05)
    assert (tmp_path / "stacks-backstop-job1-rank0.txt").exists()  # armed: faulthandler's file, open
    wd.stop()
    assert hung == [] and wd.hang_reported() is None
    assert list(tmp_path.iterdir()) == []  # neither fired: no empty stack file is left behind


def test_disabled_with_zero_timeout(tmp_path: Path) -> None:
    wd = Watchdog(tmp_path, rank=0, job_id="1", timeout_s=0, on_hang=lambda r: None).start()
    wd.beat()
    wd.stop()
