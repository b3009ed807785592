"""Time and cost to `training.train_iters`: a chain of segments, each limited by `cluster.time`, each paying a
start-up, periodic saves and a stop save. Plain arithmetic, shared by `submit` (figures predicted here from the
recipe and the planner) and `status` (figures measured by the run: launcher/accounting/pace.py).

One segment of a chain, from its start: start-up (imports, rendezvous, model build, checkpoint load, data);
training at `step_s` per iteration plus a periodic save's blocking time every `save_interval` iterations; the
stop signal at `cluster.time - lead` (the signal lead, plus half of Slurm's 30 s check period: it comes up to
that much early); the stop save; exit and teardown. The last segment trains what is left, then saves. Queue
waits between segments are not counted (they are not allocated GPU time, and no model knows them).

The predicted figures (`predicted_overheads`), each with where it comes from:
- step: the planner's prediction for the layout that runs (config/planner/auto.py), else
  `chain.step_time_estimate_s`;
- start-up: `FIRST_STARTUP_S` for the first segment (55-58 s measured for llama3-1b on one H100, its first
  segment; docs/results.md), `RESUMED_STARTUP_S` + the checkpoint's load for the next ones (15-22 s measured
  of which the load 3-8 s); the load: one checkpoint's bytes (config/planner/checkpoint_size.py) at
  `LOAD_BYTES_PER_S` per node (2.3 GB/s measured from a cold disk);
- saves: `checkpoint.save_time_estimate_s` for the stop save (the figure that sets the signal lead), and for a
  periodic save unless saves are asynchronous, whose blocking part is `ASYNC_BLOCKING_S` (0.47-0.50 s measured);
- exit and teardown: `EXIT_S` (3-9 s measured)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from megalaunch.config.schema import Recipe

FIRST_STARTUP_S = 60.0
CPU_STARTUP_S = 10.0  # a CPU job's segment (the tiny recipes: 7-9 s to the first iteration)
RESUMED_STARTUP_S = 15.0
LOAD_BYTES_PER_S = 2.0e9  # per node
ASYNC_BLOCKING_S = 0.5
EXIT_S = 5.0


@dataclass(frozen=True)
class Overheads:
    """Seconds of one segment's parts; `source` says whether predicted or measured (and from what)."""

    step_s: float  # one iteration, saves left out
    first_startup_s: float  # the first segment's start-up (no checkpoint of the run to load)
    startup_s: float  # a resumed segment's
    periodic_save_s: float  # blocking seconds of one periodic save
    stop_save_s: float  # the save at a segment's end (the signal's, or the final one)
    exit_s: float  # after the last save: exit and teardown
    source: dict[str, str]  # part -> where its figure comes from


@dataclass(frozen=True)
class Limits:
    """The recipe's limits on a segment."""

    time_limit_s: float  # cluster.time
    stop_at_s: float  # when, from a segment's start, the stop signal comes (time limit - lead - half the check)
    save_interval: int
    gpus: int  # GPUs allocated (spare nodes' included): GPU-hours count them

    @classmethod
    def of(cls, recipe: Recipe) -> Limits:
        from megalaunch.config.preflight import check_period_s, signal_lead_s

        cl = recipe.cluster
        return cls(time_limit_s=cl.time_limit_s, stop_at_s=cl.time_limit_s - signal_lead_s(recipe)
                   - check_period_s(recipe) / 2, save_interval=recipe.checkpoint.save_interval,
                   gpus=(cl.nodes + cl.spare_nodes) * cl.gpus_per_node)


@dataclass(frozen=True)
class Forecast:
    iterations: int  # to train
    seconds: float  # allocated wall time to the target (queue waits not counted)
    segments: int  # segments still to start (a running one not counted)
    per_segment: int  # iterations of a full resumed segment
    gpu_hours: float

    def record(self) -> dict[str, Any]:
        return asdict(self)


def per_iteration_s(o: Overheads, lim: Limits) -> float:
    return o.step_s + o.periodic_save_s / max(lim.save_interval, 1)


def forecast(o: Overheads, lim: Limits, iterations: int, *, first: bool = True,
             running_s: float | None = None) -> Forecast | None:
    """Time to train `iterations` more: in the running segment (`running_s`: seconds since it started), then in
    new segments (the first of the run when `first`). None when a segment has no room for one iteration."""
    it_s = per_iteration_s(o, lim)
    if it_s <= 0:
        return None
    left, seconds = max(0, iterations), 0.0
    if running_s is not None and left:
        startup = o.first_startup_s if first else o.startup_s
        room = lim.stop_at_s - max(running_s, startup)
        n = min(left, max(0, math.floor(room / it_s)))
        seconds += max(0.0, startup - running_s) + (n * it_s if n == left else max(room, 0.0))
        seconds += o.stop_save_s + o.exit_s
        left -= n
        first = False
    capacity = max(0, math.floor((lim.stop_at_s - o.startup_s) / it_s))
    segments = 0
    if left and first:
        cap1 = max(0, math.floor((lim.stop_at_s - o.first_startup_s) / it_s))
        if cap1 < 1:
            return None
        seconds += o.first_startup_s + (left * it_s if left <= cap1 else lim.stop_at_s - o.first_startup_s)
        seconds += o.stop_save_s + o.exit_s
        left -= min(left, cap1)
        segments += 1
    if left:
        if capacity < 1:
            return None
        more = math.ceil(left / capacity)
        last = left - (more - 1) * capacity
        seconds += (more - 1) * (lim.stop_at_s + o.stop_save_s + o.exit_s)
        seconds += o.startup_s + last * it_s + o.stop_save_s + o.exit_s
        segments += more
    return Forecast(iterations=max(0, iterations), seconds=seconds, segments=segments,
                    per_segment=capacity, gpu_hours=seconds * lim.gpus / 3600.0)


def predicted_overheads(recipe: Recipe, step_s: float | None, checkpoint_bytes: int | None) -> Overheads:
    """The figures before anything ran (module docstring): `step_s` from the planner, None: the recipe's estimate."""
    cl, ck = recipe.cluster, recipe.checkpoint
    load = (checkpoint_bytes or 0) / (LOAD_BYTES_PER_S * max(cl.nodes, 1))
    first = CPU_STARTUP_S if cl.gpus_per_node == 0 else FIRST_STARTUP_S
    if ck.load or ck.from_hf:  # fine-tuning starts from a checkpoint too
        first += load
    resumed = (CPU_STARTUP_S if cl.gpus_per_node == 0 else RESUMED_STARTUP_S) + load
    asynchronous = ck.async_save is True or (ck.async_save == "auto" and cl.gpus_per_node > 0
                                            and ck.ckpt_format == "torch_dist")
    periodic = ASYNC_BLOCKING_S if asynchronous else ck.save_time_estimate_s
    source = {"step": "the planner" if step_s is not None else "chain.step_time_estimate_s",
              "start-up": "estimate" + (f", load {(checkpoint_bytes or 0) / 1e9:.3g} GB" if checkpoint_bytes else ""),
              "saves": "checkpoint.save_time_estimate_s" + (", periodic asynchronous" if asynchronous else "")}
    return Overheads(step_s=step_s if step_s is not None else recipe.chain.step_time_estimate_s,
                     first_startup_s=first, startup_s=resumed, periodic_save_s=periodic,
                     stop_save_s=ck.save_time_estimate_s, exit_s=EXIT_S, source=source)


def duration(seconds: float) -> str:
    """'3 d 4 h', '5 h 12 min', '7 min 3 s'."""
    s = round(seconds)
    if s >= 86400:
        return f"{s // 86400} d {s % 86400 // 3600} h"
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"
