"""`logging.rank_output: failing` (runtime/observation/rank_output.py) on real supervisor processes
(`python -m megalaunch.runtime.task --rank-output failing`): the output of rank 0 and of the last rank
(Megatron's iteration lines) passes through; another rank's is held and reaches the log only when the rank fails (its last lines, under a header) or prints
the slow mark (from then on it passes through); `all` passes every rank's through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megalaunch.runtime.observation.rank_output import HOLD_LINES, SLOW_MARK

SRC = str(Path(__file__).resolve().parents[2] / "src")
SCRIPT = r"""
import sys
n, mode = int(sys.argv[1]), sys.argv[2]
for i in range(n):
    print(f"line {i}", flush=True)
if mode == "slow":
    print("{mark} rank 1 on here: 2 s forward/step", flush=True)
    print("after the mark", flush=True)
if mode == "crash":
    raise SystemExit("boom: the rank failed")
"""


def _task(rank: int, mode: str, *, lines: int = 5, rank_output: str = "failing",
          world: int = 4) -> subprocess.CompletedProcess[str]:
    script = SCRIPT.replace("{mark}", SLOW_MARK)
    env = {"PYTHONPATH": SRC, "RANK": str(rank), "WORLD_SIZE": str(world), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "megalaunch.runtime.task", "--rank-output", rank_output, "--",
                           sys.executable, "-c", script, str(lines), mode],
                          env=env, capture_output=True, text=True, timeout=60)


def test_ranks_0_and_last_pass_through_and_another_clean_rank_says_nothing() -> None:
    assert _task(0, "ok").stdout.splitlines() == [f"line {i}" for i in range(5)]
    # the last rank prints Megatron's iteration lines (print_rank_last)
    assert _task(3, "ok", world=4).stdout.splitlines() == [f"line {i}" for i in range(5)]
    done = _task(1, "ok")
    assert done.returncode == 0 and done.stdout == "", done


def test_a_failing_rank_writes_its_last_lines_under_a_header() -> None:
    done = _task(1, "crash", lines=HOLD_LINES + 50)
    assert done.returncode == 1
    out = done.stdout.splitlines()
    assert out[0].startswith("[megalaunch task] rank 1's output (exited with 1;") and "51 earlier line(s)" in out[0]
    # the last HOLD_LINES lines: 450 printed + the error, of which the first 51 were dropped
    assert out[-1] == "boom: the rank failed" and out[1] == "line 51", out[:3]
    assert len(out) == 1 + HOLD_LINES


def test_a_slow_rank_passes_through_from_its_mark_on() -> None:
    out = _task(1, "slow", lines=3).stdout.splitlines()
    assert "reported itself slow" in out[0] and out[1:4] == ["line 0", "line 1", "line 2"], out
    assert out[4].startswith(SLOW_MARK) and out[5] == "after the mark", out


@pytest.mark.parametrize("rank", [0, 2])
def test_all_passes_every_rank_through(rank: int) -> None:
    assert _task(rank, "ok", rank_output="all").stdout.splitlines() == [f"line {i}" for i in range(5)]
