"""`status RUN`'s forecast: the time, segments and GPU-hours left to `training.train_iters`, by submit's arithmetic
(config/planner/forecast.py) on the figures the run measured, each figure falling back to the one predicted at
submit (RUN/plan.json) until the run has measured it:

- step: the global batch's tokens over the training tokens/s of state/metrics.jsonl (saves left out; recent
  while the chain runs, the run's average after: pace.tokens_per_s);
- start-up: the goodput cut's start-up (and health check) of the first segment, and the median of the others;
- saves: of each ended segment's checkpoints, the last one's blocking seconds is its stop (or final) save and
  the others' periodic; a running segment's are periodic (goodput.checkpoint_saves);
- exit and teardown: the median of the ended segments'.
A running segment trains on until its stop signal (`cluster.time` less the lead, from its start). Standard
library only: status runs on login nodes."""

from __future__ import annotations

import time
from statistics import median
from typing import Any

from megalaunch.config.planner.forecast import Limits, Overheads, forecast, predicted_overheads
from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths


def _predicted(paths: RunPaths, recipe: Any) -> tuple[Overheads, float | None]:
    """The figures predicted at submit (RUN/plan.json), and its planned step for the layout that runs now (None
    when the run has none, or `resume --set` changed the layout since)."""
    from megalaunch.config.planner.auto import describe_layout

    plan = read_json(paths.plan)
    fallback = predicted_overheads(recipe, None, None)
    if not isinstance(plan, dict) or not isinstance(plan.get("overheads"), dict):
        return fallback, None
    try:
        o = Overheads(**plan["overheads"])
    except TypeError:
        return fallback, None
    layout = plan.get("layout") or {}
    predicted = layout.get("predicted") or {}
    step = predicted.get("step_s") if layout.get("layout") == describe_layout(recipe) else None
    if step is None:
        o = Overheads(**{**plan["overheads"], "step_s": recipe.chain.step_time_estimate_s,
                         "source": {**o.source, "step": "chain.step_time_estimate_s"}})
    return o, step


RECENT_SEGMENTS = 200


def _segment_figures(segments: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each overhead's measured values: the first segment's start-up, and the newest RECENT_SEGMENTS'
    others (a chain of thousands of segments: status stays fast, and the medians follow what the run
    does now)."""
    from megalaunch.launcher.accounting.goodput import checkpoint_saves

    out: dict[str, list[float]] = {"first": [], "startup": [], "periodic": [], "stop": [], "exit": []}
    chosen = list(enumerate(segments))
    if len(chosen) > RECENT_SEGMENTS + 1:
        chosen = chosen[:1] + chosen[-RECENT_SEGMENTS:]
    for i, s in chosen:
        parts = s.get("parts") or {}
        startup = float(s.get("startup") or 0.0) + float(parts.get("health_check") or 0.0)
        if startup > 0 and (parts.get("productive") or 0) > 0:
            out["first" if i == 0 else "startup"].append(startup)
        saves = checkpoint_saves(s.get("saves") or [])
        ended = s.get("ended_at") is not None
        for it, (seconds, _) in saves.items():
            out["stop" if ended and it == max(saves) else "periodic"].append(seconds)
        if ended and (parts.get("exit") or 0) > 0:
            out["exit"].append(float(parts["exit"]) + float(parts.get("teardown") or 0.0))
    return out


def measured_overheads(predicted: Overheads, segments: list[dict[str, Any]], tokens_per_s: float | None,
                       tokens_per_step: int) -> Overheads:
    """The run's figures where it measured them, else the predicted ones; `source` says which."""
    got = _segment_figures(segments)
    source = dict(predicted.source)

    def pick(key: str, label: str, fallback: float) -> float:
        if got[key]:
            source[label] = f"measured, {len(got[key])} value{'s' if len(got[key]) > 1 else ''}"
            return float(median(got[key]))
        return fallback

    step = predicted.step_s
    if tokens_per_s:
        step = tokens_per_step / tokens_per_s
        source["step"] = "measured"
    first = pick("first", "first start-up", predicted.first_startup_s)
    return Overheads(step_s=step, first_startup_s=first, startup_s=pick("startup", "start-up", predicted.startup_s),
                     periodic_save_s=pick("periodic", "periodic save", predicted.periodic_save_s),
                     stop_save_s=pick("stop", "stop save", predicted.stop_save_s),
                     exit_s=pick("exit", "exit", predicted.exit_s), source=source)


def status_forecast(paths: RunPaths, recipe: Any, chain: dict[str, Any] | None, tokens_per_s: float | None,
                    iteration: int | None, now: float | None = None, running: bool = True) -> dict[str, Any]:
    """What `status RUN` shows of the way to the target (status_format.py prints it). `running`: the backend
    says a job of the chain runs (a segment the ledger has not seen end may have been killed)."""
    now = time.time() if now is None else now
    target = recipe.training.train_iters
    done = int(iteration or 0)
    if done >= target:
        return {"reached": True, "target": target}
    predicted, planned_step = _predicted(paths, recipe)
    segments = (chain or {}).get("segments") or []
    tokens = recipe.training.global_batch_size * recipe.model.seq_length
    o = measured_overheads(predicted, segments, tokens_per_s, tokens)
    lim = Limits.of(recipe)
    last = segments[-1] if segments else None
    running_s = now - float(last["start"]) if running and last and last.get("running") and last.get("start") else None
    f = forecast(o, lim, target - done, first=not segments or (running_s is not None and len(segments) == 1),
                 running_s=running_s)
    spent_h = float((chain or {}).get("gpu_hours") or 0.0)
    spent_s = float((chain or {}).get("wall") or 0.0)
    return {"reached": False, "target": target, "iterations_left": target - done,
            "seconds_left": f.seconds if f else None, "segments_left": f.segments if f else None,
            "running": running_s is not None, "segments_done": len(segments),
            "gpus": lim.gpus, "gpu_hours_left": f.gpu_hours if f else None, "gpu_hours_spent": spent_h, "wall_spent_s": spent_s,
            "step_s": o.step_s, "predicted_step_s": planned_step, "startup_s": o.startup_s,
            "stop_save_s": o.stop_save_s, "periodic_save_s": o.periodic_save_s, "source": o.source}
