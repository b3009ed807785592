"""How fast a run trains, read from state/metrics.jsonl: its tokens/s (recent while the chain runs, the
run's average after), its iterations/s, and with the goodput so far (goodput.py) the latest segment's
MFU and the training time left. `megalaunch status` shows them."""

from __future__ import annotations

import time
from typing import Any

from megalaunch.rundir.paths import RunPaths


def tokens_per_s(metrics: list[dict[str, Any]], *, running: bool) -> float | None:
    """Training tokens/s from state/metrics.jsonl: while the chain runs, over the newest segment's last
    (up to) 20 log intervals; otherwise the average over every logged interval of the run. Each line's
    rate leaves its interval's saves out; intervals are weighted by their samples (tokens over time,
    not a mean of rates). None before two log intervals of one segment."""
    previous: dict[Any, int] = {}
    intervals: list[tuple[Any, int, float]] = []  # (job, samples, tokens/s)
    for r in metrics:
        job, samples, rate = r.get("job_id"), r.get("consumed_samples"), r.get("tokens_per_s")
        before = previous.get(job)
        if isinstance(samples, int):
            previous[job] = samples
        if (isinstance(before, int) and isinstance(samples, int) and samples > before
                and isinstance(rate, (int, float)) and rate > 0):
            intervals.append((job, samples - before, float(rate)))
    if running and intervals:
        intervals = [i for i in intervals if i[0] == intervals[-1][0]][-20:]
    if not intervals:
        return None
    return sum(n for _, n, _ in intervals) / sum(n / rate for _, n, rate in intervals)


def efficiency(paths: RunPaths, recipe: Any, it: int | None, metrics: list[dict[str, Any]],
               events: list[dict[str, Any]] | None = None, numbers: dict[str, int] | None = None,
               rate: float | None = None, running: bool = True) -> dict[str, Any]:
    """Goodput so far, MFU of the latest segment, the training time left at the recent pace, and the forecast
    to the target from the measured figures (forecast.py; `rate`: the training tokens/s; `running`: a job of
    the chain runs, as the backend says)."""
    from megalaunch.launcher.accounting.forecast import status_forecast
    from megalaunch.launcher.accounting.goodput import STARTUP, chain_goodput, mfu

    try:
        chain = chain_goodput(paths, time.time(), metrics, events, numbers)
    except (OSError, ValueError, KeyError, TypeError):  # a half-written file: status must still answer
        return {"goodput": None, "forecast": status_forecast(paths, recipe, None, rate, it, running=running)}
    wall = chain["wall"]
    if not chain["segments"] or wall <= 0:
        return {"goodput": None, "forecast": status_forecast(paths, recipe, chain, rate, it, running=running)}
    totals = chain["totals"]
    latest = chain["segments"][-1]
    its_per_s = _iterations_per_s(metrics)
    left = None
    if its_per_s and it is not None:
        left = max(0, recipe.training.train_iters - int(it)) / its_per_s
    return {"goodput": chain["goodput"], "wall_h": wall / 3600.0,
            "startup_share": sum(totals[k] for k in STARTUP) / wall, "save_share": totals["checkpoint_save"] / wall,
            "lost_share": totals["lost_work"] / wall,
            "mfu": mfu(latest["tflops_per_gpu"], latest["gpu"], recipe.cluster.gpu_peak_tflops), "eta_s": left,
            "forecast": status_forecast(paths, recipe, chain, rate, it, running=running)}


def _iterations_per_s(metrics: list[dict[str, Any]]) -> float | None:
    """Iterations per second of training over the last (up to) 20 log intervals of one segment."""
    rows = metrics[-20:]
    if rows:
        rows = [r for r in rows if r.get("job_id") == rows[-1].get("job_id")]
    if len(rows) < 2:
        return None
    di, dt = rows[-1]["iteration"] - rows[0]["iteration"], rows[-1]["time"] - rows[0]["time"]
    return di / dt if di > 0 and dt > 0 else None
