"""`megalaunch logs`: -f follows a real chain from segment to segment and ends with it; Ctrl-C ends it
quietly; --tail and --since-start (after Megatron's own argument dump); one segment numbering shared
with `status`, and a one-line error that lists the numbers that have a log."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.unit.helpers import REPO, cli, counter_recipe

from megalaunch.launcher.logs import print_logs
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _first_log(tmp: Path) -> RunPaths | None:
    runs = [p for p in (tmp / "runs").glob("*") if not p.name.startswith(".")] if (tmp / "runs").exists() else []
    if not runs:
        return None
    paths = RunPaths(runs[0])
    segs = Ledger(paths).segments() if paths.ledger.exists() else []
    return paths if segs and paths.segment_log(segs[0].job_id).exists() else None


def _popen(*args: str, stdout: object = subprocess.PIPE, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megalaunch.cli.main", *args], stdout=stdout,
                            stderr=subprocess.PIPE, cwd=REPO, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})


def test_follow_moves_to_each_new_segment_and_ends_with_the_chain(tmp_path: Path) -> None:
    recipe = counter_recipe(tmp_path, training="{train_iters: 260}")
    chain = _popen("submit", str(recipe), env={"COUNTER_STEP_S": "0.05"})
    follower = quitter = None
    try:
        paths = _wait_for(lambda: _first_log(tmp_path), 60, "the first segment's log")
        follower = _popen("logs", str(paths.root), "-f")
        quitter_out = tmp_path / "quitter.out"
        with open(quitter_out, "wb") as sink:
            quitter = _popen("logs", str(paths.root), "--follow", stdout=sink)
            _wait_for(lambda: quitter_out.stat().st_size > 0, 30, "the second follower's first output")
            quitter.send_signal(signal.SIGINT)  # Ctrl-C while the chain runs
            _, q_err = quitter.communicate(timeout=30)
        out, err = follower.communicate(timeout=180)  # ends by itself when the chain ends
        chain.wait(timeout=60)
    finally:
        for p in (chain, follower, quitter):
            if p is not None and p.poll() is None:
                p.kill()
    assert quitter is not None and follower is not None
    assert quitter.returncode == 0 and b"Traceback" not in q_err, q_err
    assert follower.returncode == 0, err
    segs = Ledger(paths).segments()
    assert len(segs) >= 2 and segs[-1].ended["outcome"] == "finished"
    # every segment's whole log, in order, each later one after a line naming its number and job
    expected = paths.segment_log(segs[0].job_id).read_bytes()
    for n, s in enumerate(segs[1:], 2):
        log = paths.segment_log(s.job_id)
        expected += f"==> segment {n} (job {s.job_id}): {log} <==\n".encode() + log.read_bytes()
    stopped = Ledger(paths).stopped()
    expected += f"==> chain stopped: {stopped['reason']} <==\n".encode()
    assert out == expected
    # the numbers in that separator are the numbers `status` shows
    st = json.loads(cli("status", str(paths.root), "--json").stdout)
    assert [(r["segment"], r["job_id"]) for r in st["segments"]] == [(n, s.job_id) for n, s in enumerate(segs, 1)]


def _run_with_segments(tmp: Path, logs: dict[str, bytes | None]) -> RunPaths:
    """A run directory whose ledger (written by the Ledger) has these jobs submitted; each job with
    bytes got a log (the file Slurm's --output writes), each with None never started."""
    paths = RunPaths(tmp / "run-abc")
    for d in (paths.state, paths.logs):
        d.mkdir(parents=True)
    ledger = Ledger(paths)
    for job, text in logs.items():
        ledger.append("submitted", job_id=job, by="test")
        if text is not None:
            ledger.append("started", job_id=job, checkpoint_iteration=None)
            paths.segment_log(job).write_bytes(text)
            ledger.append("ended", job_id=job, outcome="saved")
    return paths


def _printed(paths: RunPaths, **kw: object) -> bytes:
    buf = io.BytesIO()
    print_logs(paths, buf, **kw)  # type: ignore[arg-type]
    return buf.getvalue()


@pytest.fixture(scope="module")
def megatron_log() -> tuple[bytes, bytes, bytes]:
    """(before, Megatron's argument dump as its own `_print_args` prints it, after)."""
    arguments = pytest.importorskip("megatron.training.arguments")
    import argparse

    ns = argparse.Namespace(**{f"option_{i}": i for i in range(1100)})
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        arguments._print_args("arguments", ns)
    before = b"[megalaunch rank 0] no GPU: running on the CPU\nusing world size: 1\n"
    after = b"".join(f"iteration {i}/ 100 | loss 1.0\n".encode() for i in range(1, 8))
    return before, buf.getvalue().encode(), after


def test_since_start_begins_after_megatrons_argument_dump(tmp_path: Path, megatron_log) -> None:
    before, dump, after = megatron_log
    assert dump.count(b"\n") > 1100
    paths = _run_with_segments(tmp_path, {"11": before + dump + after})
    assert _printed(paths, since_start=True) == after
    assert _printed(paths) == before + dump + after
    assert _printed(paths, since_start=True, tail=3) == b"".join(after.splitlines(keepends=True)[-3:])
    # --tail never reaches back into the dump it was asked to skip
    assert _printed(paths, since_start=True, tail=100) == after


def test_since_start_shows_a_log_without_a_dump_whole_and_drops_one_still_being_written(tmp_path: Path,
                                                                                        megatron_log) -> None:
    before, dump, after = megatron_log
    half = dump[: len(dump) // 2]
    half = half[: half.rfind(b"\n") + 1]
    paths = _run_with_segments(tmp_path, {"11": after, "12": before + half})
    assert _printed(paths, number=1, since_start=True) == after
    assert _printed(paths, number=2, since_start=True) == before  # the dump so far is left out


def test_tail_counts_lines_from_the_end(tmp_path: Path) -> None:
    lines = [f"line {i}\n".encode() for i in range(200_000)]  # > one 64 KiB block
    paths = _run_with_segments(tmp_path, {"11": b"".join(lines), "12": b"a\nb\nno newline at the end"})
    assert _printed(paths, number=1, tail=3) == b"".join(lines[-3:])
    assert _printed(paths, number=1, tail=150_000) == b"".join(lines[-150_000:])
    assert _printed(paths, number=1, tail=0) == b""
    assert _printed(paths, tail=2) == b"b\nno newline at the end"
    assert _printed(paths, tail=10) == b"a\nb\nno newline at the end"


def test_segment_numbers_match_status_and_the_error_lists_those_with_a_log(tmp_path: Path) -> None:
    # job 12 was queued and cancelled before it started: it is segment 2 in `status`, without a log
    paths = _run_with_segments(tmp_path, {"11": b"one\n", "12": None, "13": b"three\n"})
    assert _printed(paths, number=3) == b"three\n"
    assert _printed(paths) == b"three\n"  # default: the newest log
    from megalaunch.errors import RunDirError

    with pytest.raises(RunDirError) as e:
        _printed(paths, number=2)
    msg = str(e.value)
    assert "segment 2 has no log: job 12 never started" in msg and "valid: segments with a log: 1, 3" in msg
    assert "\n" not in msg
    with pytest.raises(RunDirError, match=r"segment 9 has no log: the run has 3 segment\(s\)"):
        _printed(paths, number=9)
