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
    not a mean of rates). None before two log intervals of one segment. An interval is a line and the
    line of its job before it that has a sample count; "the newest segment" is the job of the newest
    interval. While running, that segment is found on a tail of the lines, and only its own lines are
    paired (a chain of thousands of segments has tens of thousands of lines)."""
    intervals = _recent_intervals(metrics, RECENT_INTERVALS) if running else _intervals(metrics)
    if not intervals:
        return None
    return sum(i[1] for i in intervals) / sum(i[1] / i[2] for i in intervals)


RECENT_INTERVALS = 20


def _intervals(metrics: list[dict[str, Any]], start: int = 0) -> list[tuple[Any, int, float, int]]:
    """The intervals of the lines from `start` on, oldest first: (job, samples, tokens/s, the closing line's
    index). A line without a sample count neither opens nor closes one; a line closes an interval when its
    job's line before (with a count) counted fewer samples and its rate is positive. From a `start` > 0, each
    job's first interval there is missing (its opening line is before). One pass, inlined: it runs over
    every line of a stopped chain (20,000 for 5,000 segments) on every `status`."""
    previous: dict[Any, int] = {}
    out: list[tuple[Any, int, float, int]] = []
    for i in range(start, len(metrics)):
        r = metrics[i]
        samples = r.get("consumed_samples")
        if not isinstance(samples, int):
            continue
        job = r.get("job_id")
        before = previous.get(job)
        previous[job] = samples
        if before is not None and samples > before:
            rate = r.get("tokens_per_s")
            if isinstance(rate, (int, float)) and rate > 0:
                out.append((job, samples - before, float(rate), i))
    return out


def _recent_intervals(metrics: list[dict[str, Any]], count: int) -> list[tuple[Any, int, float, int]]:
    """The newest interval's job's last `count` intervals, oldest first: `_intervals(metrics)` kept to those.
    The job is found on a tail of the lines (`_newest_job`); its intervals depend on its own lines only."""
    job = _newest_job(metrics)
    if job is _NO_JOB:
        return []
    return _intervals([r for r in metrics if r.get("job_id") == job])[-count:]


_NO_JOB = object()


def _newest_job(metrics: list[dict[str, Any]]) -> Any:
    """The job of the newest interval (by its closing line), or _NO_JOB. Found on a tail of the lines that
    grows until it settles it: the tail's intervals are exact but for each job's first, so the tail is
    enough once it has an interval and no job's first line in the tail comes after the newest one (that
    line might close an interval opened before the tail)."""
    size = 64
    while True:
        start = max(0, len(metrics) - size)
        found = _intervals(metrics, start)
        if found and (start == 0 or not _opens_after(metrics, start, found[-1][3])):
            return found[-1][0]
        if start == 0:
            return _NO_JOB
        size *= 4


def _opens_after(metrics: list[dict[str, Any]], start: int, index: int) -> bool:
    """Whether some job's first line with a sample count at or after `start` comes after `index`."""
    seen: set[Any] = set()
    for i in range(start, len(metrics)):
        r = metrics[i]
        job = r.get("job_id")
        if job in seen or not isinstance(r.get("consumed_samples"), int):
            continue
        if i > index:
            return True
        seen.add(job)
    return False


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
