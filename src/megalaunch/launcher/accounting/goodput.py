"""Goodput: where every second of a chain went (docs/goodput.md).

Each segment's wall time, from `job begin` to `job end` (the ledger's `started` and `ended`), is cut
into consecutive intervals at the phases its trainer reached (runtime/observation/timeline.py), so the parts
always add up to the wall time:

  launch           job begin -> the trainer process exists (srun, the task supervisor)
  imports          -> torch and Megatron imported, seams installed (setup_done)
  init             -> Megatron initialised: rendezvous, process groups (model_build_start)
  model_build      -> the model and optimizer are built (load_start)
  checkpoint_load  -> the checkpoint is loaded (load_end)
  data_setup       -> the datasets are built (data_end)
  health_check     the health check at segment start (runtime/health/health.py), carved out of the part it fell in
  training         -> the last iteration or save; split into
      productive       iterations whose result a checkpoint kept
      checkpoint_save  blocking time of every save, from the decision to save; a stop or final save's up to
                       its complete checkpoint (also when asynchronous), and every wait for an asynchronous
                       save to complete (the timeline's `saves`)
      lost_work        iterations after the last checkpoint this segment wrote (redone later)
  exit             -> the outcome is written: only what follows the last iteration or save
  teardown         -> job end (process-group teardown, interpreter exit, srun, the chain's bookkeeping)
  failed           a segment that failed, hung or was killed: from its last sign of life to job end
  restart          an in-job restart (launcher/chain/restart.py): the failed step from its last sign of life to
                   the restart, and the next step's start-up up to its first iteration's data
  untracked        a segment without a trainer timeline (a `workload` instead of Megatron's loop)

Queue wait between segments (`wait`: from the previous segment's end, or the submission, to this
one's start) is shown separately: it is not allocated GPU time. Goodput = productive / wall.
Standard library only: `status` and `report` run on login nodes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from megalaunch.config.planner.gpus import GPUS
from megalaunch.rundir.appended import read_json_cached
from megalaunch.rundir.files import atomic_write_json, read_json, read_jsonl
from megalaunch.rundir.ledger import Ledger, segment_numbers
from megalaunch.rundir.paths import RunPaths, step_file
from megalaunch.runtime.observation.timeline import STARTUP_PHASES

STARTUP = tuple(name for name, _ in STARTUP_PHASES)
COMPONENTS = (*STARTUP, "health_check", "productive", "checkpoint_save", "lost_work", "exit", "teardown", "failed", "restart",
              "untracked")
FAILED_OUTCOMES = {"failed", "hung", "killed", "config_error", "storage_full"}

# Dense bf16 peak TFLOP/s per GPU, by a substring of torch.cuda.get_device_name() (first match wins):
# the GPU table (config/planner/gpus.py) is the one place that knows GPUs.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = tuple((g.name, g.peak_tflops) for g in GPUS)


def peak_tflops(gpu: str | None, override: float | None = None) -> float | None:
    """The dense bf16 peak of `gpu` (a device name), or `override` (cluster.gpu_peak_tflops)."""
    if override:
        return float(override)
    if not gpu:
        return None
    for key, peak in PEAK_TFLOPS:
        if re.search(re.escape(key), gpu, re.I):
            return peak
    return None


@dataclass
class SegmentTime:
    job_id: str
    outcome: str | None
    start: float | None
    end: float | None
    wait: float | None = None  # queue wait before this segment (not GPU time)
    parts: dict[str, float] = field(default_factory=dict)
    start_iteration: int | None = None
    last_iteration: int | None = None
    last_checkpoint: int | None = None
    saves: list[list[float]] = field(default_factory=list)  # [iteration, begin, end]
    gpu: str | None = None
    world: int | None = None
    tflops_per_gpu: float | None = None
    tokens_per_s: float | None = None
    reason: str | None = None
    running: bool = False  # no `job end` yet: the parts so far, up to now

    @property
    def wall(self) -> float:
        return sum(self.parts.values())

    @property
    def startup(self) -> float:
        return sum(self.parts.get(k, 0.0) for k in STARTUP)


CUT_VERSION = 1  # raise it when a segment is cut differently: older cuts are then recomputed


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if isinstance(v, (int, float)) and math.isfinite(v))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def segment_time(job_id: str, started: dict[str, Any], ended: dict[str, Any] | None,
                 timeline: dict[str, Any] | None, metrics: list[dict[str, Any]], now: float) -> SegmentTime:
    """Cut one segment's wall time into the components (their sum is the wall time exactly)."""
    start = float(started["time"])
    end = float(ended["time"]) if ended else now
    outcome = (ended or {}).get("outcome")
    tl = timeline or {}
    ph: dict[str, float] = {k: float(v) for k, v in (tl.get("phases") or {}).items() if isinstance(v, (int, float))}
    saves = [s for s in (tl.get("saves") or []) if isinstance(s, list) and len(s) == 3]
    if ended is not None and ended.get("accounted_by"):
        # it vanished (node failure, scancel) and the next segment's `job begin` recorded its end: that
        # time includes the queue wait before the next segment. End it at its last sign of life.
        alive = [v for v in ph.values()] + [float(x[2]) for x in saves] + \
            [float(m["time"]) for m in metrics if str(m.get("job_id")) == str(job_id) and "time" in m]
        end = min(end, max([start, *alive])) if alive else start
    seg = SegmentTime(job_id=job_id, outcome=outcome, start=start, end=end if ended else None,
                      reason=(ended or {}).get("reason"), running=ended is None, saves=saves,
                      gpu=tl.get("gpu"), world=tl.get("world"))
    iters = tl.get("iterations") or {}
    seg.start_iteration = tl.get("start_iteration")
    seg.last_iteration = iters.get("last")
    mine = [m for m in metrics if str(m.get("job_id")) == str(job_id)]
    seg.tflops_per_gpu = _median([m.get("tflops_per_gpu") for m in mine])  # type: ignore[misc]
    seg.tokens_per_s = _median([m.get("tokens_per_s") for m in mine])  # type: ignore[misc]
    if mine and (seg.last_iteration is None or mine[-1]["iteration"] > seg.last_iteration):
        seg.last_iteration = mine[-1]["iteration"]  # a timeline flushed less often than the metrics
        ph["last_iteration_end"] = max(ph.get("last_iteration_end", 0.0), float(mine[-1]["time"]))

    def clamp(t: float | None, lo: float) -> float:
        return min(max(t if t is not None else lo, lo), end)

    # consecutive boundaries; a phase not reached (or reached before the previous one) adds nothing
    t = start
    parts: dict[str, float] = {k: 0.0 for k in COMPONENTS}
    spans: dict[str, tuple[float, float]] = {}  # the interval of each part (for the health check's carve)
    for name, phase in STARTUP_PHASES:
        nxt = clamp(ph.get(phase), t)
        parts[name] = nxt - t
        spans[name] = (t, nxt)
        t = nxt
    train_start = t
    save_ends = [float(s[2]) for s in saves]
    train_end = clamp(max([ph.get("last_iteration_end", 0.0), *save_ends, ph.get("decision", 0.0)]) or None,
                      train_start)
    window = train_end - train_start
    blocking = sum(max(0.0, min(float(e), train_end) - max(float(b), train_start)) for _, b, e in saves)
    # lost work: iterations after the last save this segment made (or after its start, if none); its
    # first interval (max keeps the first of equals): a later one is a wait for it to complete
    last_save = max(saves, key=lambda s: s[0]) if saves else None
    seg.last_checkpoint = int(last_save[0]) if last_save else None
    last_iter_end = clamp(ph.get("last_iteration_end"), train_start)
    lost = 0.0
    if seg.last_iteration is not None:
        kept_to = int(last_save[0]) if last_save else (seg.start_iteration or 0)
        if seg.last_iteration > kept_to:
            lost = max(0.0, last_iter_end - (float(last_save[2]) if last_save else train_start))
    failed = outcome in FAILED_OUTCOMES or (ended is not None and outcome is None)
    lost = min(lost, max(0.0, window - blocking))
    parts["checkpoint_save"] = blocking
    parts["lost_work"] = lost
    parts["productive"] = max(0.0, window - blocking - lost)
    t = train_end
    if failed:
        parts["failed"] = end - t
        spans["failed"] = (t, end)
    elif ended is None and "exit" not in ph and train_end > train_start:
        parts["productive"] += end - t  # still training: the time since the last record is training in flight
    else:
        exit_at = clamp(ph.get("exit"), t)
        parts["exit"] = exit_at - t
        parts["teardown"] = end - exit_at
        spans["exit"] = (t, exit_at)
    if "health_check_start" in ph and "health_check_end" in ph:
        hs, he = ph["health_check_start"], ph["health_check_end"]
        for name, (b, e) in spans.items():  # in the part its interval fell in (init, or exit if it ended there)
            overlap = max(0.0, min(e, he) - max(b, hs))
            parts[name] -= overlap
            parts["health_check"] += overlap
    if not ph:  # no trainer timeline (a `workload` instead of Megatron, or it never started): no phases
        parts = {k: 0.0 for k in COMPONENTS}
        parts["failed" if failed else "untracked"] = end - start
    seg.parts = parts
    return seg


def restarted_segment_time(paths: RunPaths, job_id: str, started: dict[str, Any], ended: dict[str, Any] | None,
                           timeline: Any, restarts: list[dict[str, Any]], metrics: list[dict[str, Any]],
                           now: float) -> SegmentTime:
    """A segment with in-job restarts: each step cut on its own (its timeline was moved aside at the
    restart), then summed; a failed step's end and the next step's start-up become `restart`."""
    bounds = [float(started["time"]), *(float(r["time"]) for r in restarts)]
    steps: list[SegmentTime] = []
    for i, lo in enumerate(bounds):
        hi = bounds[i + 1] if i + 1 < len(bounds) else None
        tl = read_json(step_file(paths.timeline(job_id), i)) if hi is not None else timeline
        mine = [m for m in metrics if lo <= float(m.get("time") or 0) < (hi if hi is not None else math.inf)]
        end = {"time": hi, "outcome": "failed"} if hi is not None else ended
        steps.append(segment_time(job_id, {"time": lo}, end, tl if isinstance(tl, dict) else None, mine, now))
    parts = {k: 0.0 for k in COMPONENTS}
    for i, st in enumerate(steps):
        for k, v in st.parts.items():
            moved = (i > 0 and k in STARTUP) or (i + 1 < len(steps) and k == "failed")
            parts["restart" if moved else k] += v
    seg = steps[-1]
    seg.start, seg.parts = bounds[0], parts
    seg.saves = [s for st in steps for s in st.saves]
    seg.start_iteration = steps[0].start_iteration
    return seg


Events = dict[str, dict[str, Any]]


def _index(events: list[dict[str, Any]]) -> tuple[dict[str, float], Events, Events, dict[str, list[dict[str, Any]]]]:
    """The ledger's segments by job id: submitted (time), started and ended (first event each, started in
    order), and in-job restarts."""
    submitted: dict[str, float] = {}
    started: Events = {}
    ended: Events = {}
    restarts: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        jid = e.get("job_id")
        if jid is None:
            continue
        jid = str(jid)
        if e["event"] == "submitted":
            submitted.setdefault(jid, float(e["time"]))
        elif e["event"] == "started" and jid not in started:
            started[jid] = e
        elif e["event"] == "ended" and jid not in ended:
            ended[jid] = e
        elif e["event"] == "restart":
            restarts.setdefault(jid, []).append(e)
    return submitted, started, ended, restarts


def chain_goodput(paths: RunPaths, now: float, metrics: list[dict[str, Any]] | None = None,
                  events: list[dict[str, Any]] | None = None, numbers: dict[str, int] | None = None) -> dict[str, Any]:
    """Every segment's time and the chain's totals (goodput, badput by cause, wait). `metrics` (the
    lines of state/metrics.jsonl) and `events` (the ledger's): when the caller has read them already."""
    events = Ledger(paths).events() if events is None else events
    metrics = read_jsonl(paths.metrics) if metrics is None else metrics
    by_job: dict[str, list[dict[str, Any]]] = {}  # one pass: a 5,000-segment chain has 5,000 segments to cut
    for m in metrics:
        by_job.setdefault(str(m.get("job_id")), []).append(m)
    submitted, started, ended, restarts = _index(events)
    numbers = numbers or segment_numbers(Ledger(paths).segments(events))  # as `status` and `logs --segment` number them
    out: list[dict[str, Any]] = []  # each segment as the caller gets it
    previous_end: float | None = None
    known = _cut_before(paths)
    for jid in started:
        done = ended.get(jid)
        if done is not None and (k := known.get(jid)) and k.get("ended_at") == done["time"] \
                and k.get("restarts") == len(restarts.get(jid, [])):  # as cut at an earlier `job end`: as is
            k["number"] = numbers.get(jid)  # k: this call's own copy (_cut_before parses it for each call)
            out.append(k)
            previous_end = k["end"] if k.get("end") is not None else now
            continue
        tl = read_json(paths.timeline(jid))
        mine = by_job.get(jid, [])
        if jid in restarts:
            seg = restarted_segment_time(paths, jid, started[jid], done, tl, restarts[jid], mine, now)
        else:
            seg = segment_time(jid, started[jid], done, tl if isinstance(tl, dict) else None, mine, now)
        since = max(x for x in (submitted.get(jid), previous_end) if x is not None) \
            if (submitted.get(jid) is not None or previous_end is not None) else None
        seg.wait = max(0.0, seg.start - since) if since is not None and seg.start is not None else None
        previous_end = seg.end if seg.end is not None else now
        out.append({**vars(seg), "parts": dict(seg.parts), "saves": [list(v) for v in seg.saves], "wall": seg.wall,
                    "startup": seg.startup, "number": numbers.get(jid), "ended_at": (done or {}).get("time"),
                    "restarts": len(restarts.get(jid, []))})
    totals = dict.fromkeys(COMPONENTS, 0.0)
    for o in out:
        for key, v in o["parts"].items():
            if key in totals:
                totals[key] += v
    wall = sum(totals.values())
    gpus = [o["world"] for o in out if o.get("world")]
    return {
        "segments": out, "totals": totals, "wall": wall, "wait": sum(o.get("wait") or 0.0 for o in out),
        "goodput": (totals["productive"] / wall) if wall > 0 else None,
        "gpu_hours": sum(o["wall"] * (o.get("world") or 1) for o in out) / 3600.0,
        "world": gpus[-1] if gpus else None,
    }


def mfu(tflops_per_gpu: float | None, gpu: str | None, override: float | None = None) -> float | None:
    peak = peak_tflops(gpu, override)
    if tflops_per_gpu is None or not peak:
        return None
    return tflops_per_gpu / peak


def checkpoint_saves(saves: list[Any]) -> dict[int, tuple[float, float]]:
    """A segment's `saves` by checkpoint: its blocking seconds (its intervals summed: a wait for an
    asynchronous save to complete may be an interval of its own) and when the last of them ended."""
    out: dict[int, tuple[float, float]] = {}
    for it, begin, end in saves:
        seconds, ended = out.get(int(it), (0.0, float(end)))
        out[int(it)] = (seconds + float(end) - float(begin), max(ended, float(end)))
    return out


def checkpoint_interval_hint(chain: dict[str, Any], step_s: float | None) -> dict[str, Any]:
    """Young/Daly: the checkpoint interval that minimises expected loss, sqrt(2 x MTBF x save time),
    from the measured blocking save time and the chain's observed failure rate."""
    segs = chain["segments"]
    saves = [seconds for s in segs for seconds, _ in checkpoint_saves(s["saves"]).values()]
    save_s = _median(saves)
    # a configuration error or a full disk is not a failure rate of the machines: not in the MTBF
    failures = sum(1 for s in segs if s["outcome"] in FAILED_OUTCOMES - {"config_error", "storage_full"})
    wall = chain["wall"]
    out: dict[str, Any] = {"save_s": save_s, "saves": len(saves), "failures": failures, "wall_s": wall,
                           "interval_s": None, "interval_iters": None, "mtbf_s": None}
    if save_s is None or wall <= 0:
        return out
    mtbf = wall / failures if failures else None
    out["mtbf_s"] = mtbf
    if mtbf is not None:
        interval = math.sqrt(2.0 * mtbf * save_s)
        out["interval_s"] = interval
        if step_s:
            out["interval_iters"] = max(1, int(interval / step_s))
    return out


def write_chain_goodput(paths: RunPaths) -> None:
    """The chain's goodput so far into state/goodput.json (`job end` after every segment), for
    `status`, the report and the next segment's W&B run (`chain/*`)."""
    import time

    g = chain_goodput(paths, time.time())
    cut = [s for s in g["segments"] if s["ended_at"] is not None]  # reused by the next call (_cut_before)
    atomic_write_json(paths.goodput, {"time": time.time(), "goodput": g["goodput"], "wall_s": g["wall"],
                                      "wait_s": g["wait"], "segments": len(g["segments"]), "totals_s": g["totals"],
                                      "cut": cut, "cut_version": CUT_VERSION})


def _cut_before(paths: RunPaths) -> dict[str, dict[str, Any]]:
    """The ended segments as the last `job end` cut them (state/goodput.json), by job id: a segment's
    cut never changes once its `ended` event is written, and a chain of 5,000 segments would otherwise
    re-read 5,000 timelines for every `status` (docs/scale.md)."""
    data = read_json_cached(paths.goodput)
    cut = data.get("cut") if isinstance(data, dict) and data.get("cut_version") == CUT_VERSION else None
    return {str(s["job_id"]): s for s in cut if isinstance(s, dict) and "job_id" in s} if isinstance(cut, list) else {}
