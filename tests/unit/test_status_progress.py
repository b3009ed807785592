"""`status` on a run directory written by megalaunch's own writers: the iteration it shows is never
behind the last checkpoint, and tokens/s and the ETA come from a window of recent log intervals (the
run's average once nothing runs), never from zero; the forecast's durations read as seconds and minutes,
never in e-notation."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.helpers import counter_recipe

from megalaunch.launcher.prepare.prepare import prepare_submission
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import run_status
from megalaunch.launcher.status_format import forecast_line, format_run_status, short_duration
from megalaunch.rundir.files import append_jsonl, atomic_write_text
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import shown_iteration, write_progress


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    recipe = counter_recipe(tmp_path, training="{train_iters: 400}")
    return write_run(prepare_submission(str(recipe), []))


def test_progress_behind_the_checkpoint_is_shown_at_the_checkpoint(paths: RunPaths) -> None:
    write_progress(paths, iteration=170, loss=2.0)
    atomic_write_text(paths.tracker, "173\n")  # as Megatron's tracker after a save on the signal
    st = run_status(paths)
    assert (st["iteration"], st["last_checkpoint"]) == (173, 173)
    assert "iteration: 173 / 400   last checkpoint: 173" in format_run_status(st)
    write_progress(paths, iteration=190, loss=2.0)  # training went on past the checkpoint
    assert run_status(paths)["iteration"] == 190


def test_shown_iteration() -> None:
    assert shown_iteration(None, None) is None
    assert shown_iteration({"iteration": 5}, None) == 5
    assert shown_iteration(None, 20) == 20
    assert shown_iteration({"iteration": 19}, 20) == 20
    assert shown_iteration({"iteration": 21}, 20) == 21


def _log_intervals(paths: RunPaths, job: str, start: int, rates: list[float]) -> None:
    """state/metrics.jsonl lines as the trainer appends them every log interval (the first of a
    segment has no rate yet)."""
    for i, rate in enumerate([None, *rates]):
        append_jsonl(paths.metrics, {"job_id": job, "iteration": start + 10 * i, "time": 1e9 + i, "loss": 2.0,
                                     "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": rate, "tflops_per_gpu": None,
                                     "consumed_samples": (start + 10 * i) * 8})


def test_tokens_per_s_is_the_recent_window_while_running_and_the_run_average_after(paths: RunPaths) -> None:
    import os

    ledger = Ledger(paths)
    _log_intervals(paths, "local-1", 0, [1000.0] * 30)
    _log_intervals(paths, "local-2", 300, [400.0] * 5 + [100.0] * 20)
    write_progress(paths, iteration=550, tokens_per_s=0.0)  # the last interval's own figure: not what is shown
    for job in ("local-1", "local-2"):
        ledger.append("submitted", job_id=job, by="test", pid=os.getpid())  # this process: alive, running
        ledger.append("started", job_id=job, checkpoint_iteration=None)
    ledger.append("ended", job_id="local-1", outcome="saved")
    st = run_status(paths)
    assert st["chain_state"] == "running"
    assert st["tokens_per_s"] == pytest.approx(100.0)  # the newest segment's last 20 intervals only
    text = format_run_status(st)
    assert "tokens/s: 100" in text and "run average" not in text
    ledger.append("ended", job_id="local-2", outcome="finished")
    ledger.append("chain_stopped", reason="training reached its target")
    st = run_status(paths)
    # every interval has the same samples: the run's tokens over its time, 55 intervals
    average = 55 / (30 / 1000 + 5 / 400 + 20 / 100)
    assert st["chain_state"] == "stopped" and st["tokens_per_s"] == pytest.approx(average)
    assert f"tokens/s: {average:.0f} (run average)" in format_run_status(st)


@pytest.mark.parametrize(("seconds", "text"), [
    (0.25, "0.25 s"), (1.4321, "1.43 s"), (13.92, "13.9 s"), (45.0, "45 s"), (119.6, "120 s"), (120.4, "2 min"),
    (150, "2 min 30 s"), (1234.0, "20 min 34 s"), (3900, "1 h 5 min"), (None, "-"), (float("nan"), "-"),
])
def test_short_durations_read_like_a_person_writes_them(seconds: float | None, text: str) -> None:
    assert short_duration(seconds) == text


def test_forecast_line_never_prints_seconds_in_e_notation() -> None:
    """issue #49: the stop save read "1.2e+02 s"."""
    fc = {"target": 5000, "seconds_left": 7200.0, "segments_left": 2, "segments_done": 1, "running": False,
          "source": {"step": "measured", "stop save": "measured (1 save)"}, "predicted_step_s": 1234.5, "gpus": 8,
          "gpu_hours_left": 16.0, "gpu_hours_spent": 4.0, "step_s": 1.4321, "startup_s": 312.0, "stop_save_s": 123.0,
          "periodic_save_s": 1500.0}
    line = forecast_line(fc)
    assert "e+" not in line
    assert "step 1.43 s, 20 min 34 s predicted, start-up 5 min 12 s, stop save 2 min 3 s, periodic save 25 min " in line
    assert "no room for an iteration of 20 min 34 s " in forecast_line({**fc, "seconds_left": None,
                                                                        "step_s": 1234.5})
