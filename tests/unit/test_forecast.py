"""Time and cost to the target: submit's arithmetic (config/planner/forecast.py) checked by hand, the figures it
predicts from a recipe, and `status RUN`'s forecast from the figures a run measured (launcher/accounting/forecast.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests.unit.helpers import counter_recipe

from megalaunch.config.loader import load_recipe
from megalaunch.config.planner.forecast import (
    ASYNC_BLOCKING_S,
    FIRST_STARTUP_S,
    Limits,
    Overheads,
    forecast,
    predicted_overheads,
)
from megalaunch.launcher.accounting.forecast import measured_overheads

BASE = Overheads(step_s=1.0, first_startup_s=10.0, startup_s=5.0, periodic_save_s=0.0, stop_save_s=2.0, exit_s=1.0,
              source={})
LIM = Limits(time_limit_s=100.0, stop_at_s=90.0, save_interval=10, gpus=8)


def test_segments_time_and_gpu_hours_by_hand() -> None:
    # first segment: 90 - 10 = 80 iterations, then 90 - 5 = 85 per segment: 200 = 80 + 85 + 35
    f = forecast(BASE, LIM, 200)
    assert f is not None and (f.segments, f.per_segment) == (3, 85)
    first, full, last = 90 + 2 + 1, 90 + 2 + 1, 5 + 35 + 2 + 1
    assert f.seconds == pytest.approx(first + full + last)
    assert f.gpu_hours == pytest.approx((first + full + last) * 8 / 3600)
    one = forecast(BASE, LIM, 50)  # fits the first segment: start-up, 50 steps, the final save, exit
    assert one is not None and one.segments == 1 and one.seconds == pytest.approx(10 + 50 + 2 + 1)


def test_periodic_saves_cost_per_iteration_and_a_segment_without_room_is_none() -> None:
    slow = Overheads(**{**BASE.__dict__, "periodic_save_s": 5.0})  # 5 s every 10 iterations: 1.5 s per iteration
    f = forecast(slow, LIM, 30)
    assert f is not None and f.seconds == pytest.approx(10 + 30 * 1.5 + 2 + 1)
    assert forecast(Overheads(**{**BASE.__dict__, "step_s": 200.0}), LIM, 10) is None


def test_a_running_segment_trains_until_its_stop_signal_then_resumed_segments() -> None:
    # resumed segment running for 40 s: 50 s to its signal = 50 iterations, then 100 - 50 in a new one
    f = forecast(BASE, LIM, 100, first=False, running_s=40.0)
    assert f is not None and f.segments == 1
    assert f.seconds == pytest.approx(50 + 2 + 1 + 5 + 50 + 2 + 1)
    done_here = forecast(BASE, LIM, 20, first=False, running_s=40.0)  # finishes in the running segment
    assert done_here is not None and done_here.segments == 0 and done_here.seconds == pytest.approx(20 + 2 + 1)


def test_predicted_figures_come_from_the_planner_and_the_recipe() -> None:
    recipe = load_recipe("llama3-8b").recipe
    o = predicted_overheads(recipe, 14.4, int(112e9))
    assert o.step_s == 14.4 and o.source["step"] == "the planner"
    assert o.periodic_save_s == ASYNC_BLOCKING_S  # async saves on GPUs: only the copy blocks
    assert o.stop_save_s == recipe.checkpoint.save_time_estimate_s
    assert o.first_startup_s == FIRST_STARTUP_S and o.startup_s == pytest.approx(15 + 112e9 / (2e9 * 4))
    cpu = predicted_overheads(load_recipe("tiny").recipe, None, None)
    assert cpu.step_s == 1.0 and cpu.source["step"] == "chain.step_time_estimate_s"
    assert cpu.periodic_save_s == cpu.stop_save_s == 10.0  # synchronous on the CPU
    lim = Limits.of(recipe)  # the stop signal: the lead (save 120 + step 10 + 30 + margin 60) and half the check
    assert lim.time_limit_s - lim.stop_at_s == 220 + 15 and lim.gpus == 32


def _segment(start: float, *, saves: list[list[float]], ended: bool, startup: float, exit_s: float) -> dict:
    return {"start": start, "running": not ended, "ended_at": start + 1000 if ended else None, "startup": startup,
            "saves": saves, "parts": {"productive": 100.0, "health_check": 1.0, "exit": exit_s, "teardown": 1.0}}


def test_measured_figures_replace_the_predicted_ones_where_measured() -> None:
    segments = [_segment(0, saves=[[10, 1, 1.5], [20, 2, 14]], ended=True, startup=50, exit_s=2),  # stop: 12 s
                _segment(2000, saves=[[30, 3, 3.4], [40, 4, 15]], ended=True, startup=20, exit_s=3),
                _segment(4000, saves=[[50, 5, 5.6]], ended=False, startup=22, exit_s=0)]
    predicted = Overheads(step_s=9.0, first_startup_s=60, startup_s=40, periodic_save_s=0.5, stop_save_s=120,
                          exit_s=5, source={"step": "the planner"})
    o = measured_overheads(predicted, segments, tokens_per_s=1000.0, tokens_per_step=4000)
    assert o.step_s == 4.0 and o.source["step"] == "measured"
    assert o.first_startup_s == 51 and o.startup_s == pytest.approx((21 + 23) / 2)
    assert o.stop_save_s == pytest.approx((12 + 11) / 2)  # each ended segment's last save
    assert o.periodic_save_s == pytest.approx(0.5)  # the others: 0.5, 0.4, 0.6
    assert o.exit_s == pytest.approx(3.5)
    assert measured_overheads(predicted, [], None, 4000) == predicted  # nothing measured yet


def test_status_prints_the_forecast_from_the_runs_measured_figures(tmp_path: Path) -> None:
    """A run written by submit's own writers; the trainer's metrics lines give the measured step."""
    from megalaunch.launcher.prepare.prepare import prepare_submission
    from megalaunch.launcher.prepare.write import write_run
    from megalaunch.launcher.status import run_status
    from megalaunch.launcher.status_format import format_run_status
    from megalaunch.rundir.files import append_jsonl
    from megalaunch.rundir.ledger import Ledger
    from megalaunch.rundir.state import write_progress

    recipe = counter_recipe(tmp_path, training="{train_iters: 400}", cluster='{time: "00:01:00"}')
    paths = write_run(prepare_submission(str(recipe), []))
    assert paths.plan.is_file()
    st = run_status(paths)
    before = st["forecast"]
    assert before["source"]["step"] == "chain.step_time_estimate_s" and before["step_s"] == 0.5
    assert "  forecast: " in format_run_status(st) and "measured: nothing yet" in format_run_status(st)
    Ledger(paths).append("started", job_id="local-1", time=time.time() - 3)
    now = time.time()
    for i in range(6):  # 8 seqs x 64 tokens per step at 2,048 tokens/s: 0.25 s per step
        append_jsonl(paths.metrics, {"job_id": "local-1", "iteration": 10 * i, "time": now - 3 + 0.5 * i,
                                     "tokens_per_s": 2048.0 if i else None, "consumed_samples": 80 * i})
    write_progress(paths, iteration=50, loss=2.0)
    st = run_status(paths)
    fc = st["forecast"]
    assert fc["step_s"] == pytest.approx(0.25) and fc["source"]["step"] == "measured"
    assert fc["iterations_left"] == 400 - 50
    text = format_run_status(st)
    assert "forecast: " in text and "more to iteration 400" in text and "step 0.25 s" in text
    assert "measured: step" in text


def test_a_local_chain_segment_then_status_forecasts_from_what_it_measured(tmp_path: Path) -> None:
    """A real local chain (the stand-in trainer under the real runtime: timeline, metrics, saves, ledger) stops on
    its time limit's signal; `status` then forecasts the rest from the step, start-up and stop save it measured."""
    import json

    from tests.unit.helpers import cli

    recipe = tmp_path / "fc.yaml"
    recipe.write_text(
        f"include: [tiny]\nname: fc\nrun: {{root: {tmp_path / 'runs'}}}\n"
        'cluster: {time: "00:00:25", env: {MEGALAUNCH_TEST_STAND_IN: "1", MEGALAUNCH_TEST_STEP_SLEEP_S: "0.1"}}\n'
        "training: {train_iters: 5000, log_interval: 5}\n"
        "checkpoint: {save_interval: 50, save_time_estimate_s: 2}\n"
        "chain: {step_time_estimate_s: 0.5, signal_margin_s: 2, min_train_time_s: 5}\n")
    dry = cli("submit", str(recipe), "--dry-run")
    assert dry.returncode == 0 and "forecast: " in dry.stdout and "to iteration 5000 in" in dry.stdout
    proc = cli("submit", str(recipe), "--no-auto-requeue", timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "forecast: " in proc.stdout  # submit says it too, before the segment runs
    (run,) = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]
    st = json.loads(cli("status", str(run), "--json").stdout)
    fc = st["forecast"]
    assert fc["source"]["step"] == "measured" and fc["source"]["first start-up"].startswith("measured")
    assert fc["source"]["stop save"].startswith("measured")
    assert 0.1 <= fc["step_s"] < 0.5  # the stand-in's 0.1 s sleep and its bookkeeping, not the 0.5 s estimate
    assert fc["segments_done"] == 1 and fc["segments_left"] >= 1 and not fc["running"]
    text = cli("status", str(run)).stdout
    line = next(x for x in text.splitlines() if x.startswith("  forecast: "))
    assert "more to iteration 5000" in line and "measured: step" in line and "stop save" in line
