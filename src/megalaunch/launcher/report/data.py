"""The report's data, from the run directory only (standard library): the ledger's segments and their
goodput, the metrics, the checkpoints, the trigger audit and the evaluations (`gather`), and each
segment's components laid out in time (`segment_spans`), which the figures and the page both draw."""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from megalaunch.errors import RunDirError
from megalaunch.launcher.accounting.goodput import (
    COMPONENTS,
    STARTUP,
    chain_goodput,
    checkpoint_interval_hint,
    checkpoint_saves,
    mfu,
    peak_tflops,
)
from megalaunch.rundir.evals import eval_records
from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import TriggerBox

ITER_DIR = re.compile(r"^iter_(\d{7})(?:\.(.+))?$")
TRAINING = ("productive", "checkpoint_save", "lost_work")


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool): a value the report can print and plot."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def outcome_of(seg: dict[str, Any]) -> str:
    return "running" if seg.get("running") else (seg.get("outcome") or "unknown")


# ------------------------------------------------------------------------------------------ gather


def _step_seconds(metrics: list[dict[str, Any]]) -> float | None:
    """The median time per iteration, from consecutive metrics rows of one segment."""
    steps: list[float] = []
    by_job: dict[str, list[dict[str, Any]]] = {}
    for m in metrics:
        by_job.setdefault(str(m.get("job_id")), []).append(m)
    for rows in by_job.values():
        for a, b in itertools.pairwise(rows):
            try:
                di, dt = int(b["iteration"]) - int(a["iteration"]), float(b["time"]) - float(a["time"])
            except (KeyError, TypeError, ValueError):
                continue
            if di > 0 and dt > 0:
                steps.append(dt / di)
    if not steps:
        return None
    steps.sort()
    return steps[len(steps) // 2]


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                continue
    return total


def checkpoints(paths: RunPaths, chain: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every checkpoint a segment saved or that is on disk: iteration, size, blocking save time, state."""
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for seg in chain["segments"]:
        for it, (save_s, saved_at) in checkpoint_saves(seg["saves"]).items():
            rows[(it, "")] = {"iteration": it, "job_id": seg["job_id"], "save_s": save_s,
                              "saved_at": saved_at, "size": None, "state": "deleted (retention)"}
    deleted = {int(e["iteration"]) for e in events if e.get("event") == "checkpoint_deleted"
               and isinstance(e.get("iteration"), int)}
    tracker = paths.read_tracker()
    try:
        names = sorted(os.listdir(paths.checkpoints))
    except OSError:
        names = []
    for name in names:
        m = ITER_DIR.match(name)
        if not m or not (paths.checkpoints / name).is_dir():
            continue
        it, suffix = int(m.group(1)), m.group(2) or ""
        row = rows.setdefault((it, suffix), {"iteration": it, "job_id": None, "save_s": None, "saved_at": None})
        row["size"] = _dir_size(paths.checkpoints / name)
        if suffix:
            row["state"] = f"set aside ({suffix})"
        else:
            row["state"] = "latest" if it == tracker else "on disk"
    for (it, suffix), row in rows.items():
        if row.get("size") is None and not suffix and it not in deleted:
            row["state"] = "not on disk"
    return sorted(rows.values(), key=lambda r: (r["iteration"], r["state"]))


def triggers(paths: RunPaths) -> list[dict[str, Any]]:
    box = TriggerBox(paths)
    rows = [{**r, "pending": False} for r in box.consumed()]
    rows += [{**box.read(v), "verb": v, "pending": True} for v in box.pending()]
    return rows


def _recipe_facts(paths: RunPaths) -> tuple[str, str | None, int | None, float | None]:
    """The run's name, backend, target iteration and peak-TFLOP/s override, from run.yaml when it loads."""
    try:
        from megalaunch.config.loader import load_run_recipe

        recipe = load_run_recipe(paths)
        override = getattr(recipe.cluster, "gpu_peak_tflops", None)
        return recipe.name, recipe.cluster.backend, recipe.training.train_iters, override
    except Exception:  # a damaged run.yaml must not hide the report: the ledger has what it needs
        return paths.root.name, None, None, None


def _stopped(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last `chain_stopped` event, unless the chain was resumed after it."""
    stopped = next((e for e in reversed(events) if e.get("event") == "chain_stopped"), None)
    resumed = next((e for e in reversed(events) if e.get("event") == "chain_resumed"), None)
    if stopped and resumed and resumed["time"] > stopped["time"]:
        return None
    return stopped


def gather(paths: RunPaths, now: float | None = None) -> dict[str, Any]:
    """Everything the report shows, from the run directory (standard library only)."""
    now = time.time() if now is None else now
    if not paths.ledger.exists():
        raise RunDirError(f"{paths.root} has no ledger yet (state/ledger.jsonl): the chain has not started",
                          fix=f"megalaunch status {paths.root}")
    chain = chain_goodput(paths, now)
    events = Ledger(paths).events()
    metrics = [m for m in read_jsonl(paths.metrics) if isinstance(m.get("iteration"), int)]
    step_s = _step_seconds(metrics)
    name, backend, target, override = _recipe_facts(paths)
    for seg in chain["segments"]:
        seg["peak_tflops"] = peak_tflops(seg.get("gpu"), override)
        seg["mfu"] = mfu(seg.get("tflops_per_gpu"), seg.get("gpu"), override)
    return {
        "run_dir": str(paths.root), "chain_name": paths.root.name, "name": name, "backend": backend,
        "target": target, "generated": now, "chain": chain, "metrics": metrics, "step_s": step_s,
        "hint": checkpoint_interval_hint(chain, step_s), "checkpoints": checkpoints(paths, chain, events),
        "triggers": triggers(paths), "running": any(s["running"] for s in chain["segments"]),
        "stopped": _stopped(events), "evals": eval_records(paths), "moe": moe_records(paths),
    }


def moe_records(paths: RunPaths) -> list[dict[str, Any]]:
    """An MoE run's expert-load records (state/moe_load.jsonl, at most REPORT_POINTS spread over the run), one
    per iteration (a redone one: its latest), in order; [] for a dense run."""
    from megalaunch.runtime.observation.moe_balance import sampled

    return sorted({r["iteration"]: r for r in sampled(paths.moe_load)}.values(), key=lambda r: r["iteration"])


# ------------------------------------------------------------------------------------------ spans


def segment_spans(seg: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(component, begin, end) in time order, covering the segment's wall time exactly once: the
    start-up phases one after another, then the training window with each save where it happened and
    the lost work at its end (after the last save), then exit and teardown (or failed)."""
    parts = seg["parts"]
    t = float(seg["start"])
    spans: list[tuple[str, float, float]] = []

    def add(name: str, length: float) -> None:
        nonlocal t
        if length > 0:
            spans.append((name, t, t + length))
            t += length

    for k in STARTUP:
        add(k, parts.get(k, 0.0))
    window_end = t + parts.get("productive", 0.0) + parts.get("checkpoint_save", 0.0) + parts.get("lost_work", 0.0)
    spans += _training_spans(parts, seg["saves"], t, window_end)
    t = window_end
    for k in ("exit", "teardown", "failed", *[c for c in COMPONENTS if c not in (*STARTUP, *TRAINING)]):
        if not any(n == k for n, _, _ in spans):
            add(k, parts.get(k, 0.0))
    return spans


def _training_spans(parts: dict[str, float], saves: list[Any], start: float,
                    end: float) -> list[tuple[str, float, float]]:
    """The training window: productive time with each save where it happened, the lost work last."""
    clipped = sorted((max(float(b), start), min(float(e), end)) for _, b, e in saves)
    clipped = [(b, e) for b, e in clipped if e > b]
    # goodput.py counts the overlap of each save with the window; if that differs (overlapping saves,
    # rounding), the pieces follow one another instead
    if abs(sum(e - b for b, e in clipped) - parts.get("checkpoint_save", 0.0)) > 1e-6:
        return _cut_lost_work(_sequential_pieces(parts, start), 0.0)
    return _cut_lost_work(_window_pieces(clipped, start, end), parts.get("lost_work", 0.0))


def _window_pieces(saves: list[tuple[float, float]], start: float, end: float) -> list[tuple[str, float, float]]:
    pieces: list[tuple[str, float, float]] = []
    cursor = start
    for b, e in saves:
        if b > cursor:
            pieces.append(("productive", cursor, b))
        b = max(b, cursor)
        if e > b:
            pieces.append(("checkpoint_save", b, e))
        cursor = max(cursor, e)
    if end > cursor:
        pieces.append(("productive", cursor, end))
    return pieces


def _sequential_pieces(parts: dict[str, float], start: float) -> list[tuple[str, float, float]]:
    pieces: list[tuple[str, float, float]] = []
    cursor = start
    for name in TRAINING:
        if parts.get(name, 0.0) > 0:
            pieces.append((name, cursor, cursor + parts[name]))
            cursor += parts[name]
    return pieces


def _cut_lost_work(pieces: list[tuple[str, float, float]], lost: float) -> list[tuple[str, float, float]]:
    """The lost work is the last stretch of non-save training time."""
    out: list[tuple[str, float, float]] = []
    for name, b, e in reversed(pieces):
        if name == "productive" and lost > 1e-9:
            cut = min(lost, e - b)
            out.append(("lost_work", e - cut, e))
            if e - cut > b:
                out.append(("productive", b, e - cut))
            lost -= cut
        else:
            out.append((name, b, e))
    return [s for s in reversed(out) if s[2] > s[1]]
