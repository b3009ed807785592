"""`megalaunch report RUN`: one self-contained HTML page about a chain (docs/goodput.md).

`OUT/report.html` plus its figures as PNG files next to it (referenced relatively, no script, no
external URL), so the directory can be copied or attached as it is. The data come from the run
directory only (the ledger, the timelines, the metrics, the trigger audit, the checkpoints), so the
report works while the chain runs, for local and Slurm runs, and for any member of the run's group.

Gathering is standard library (`gather`); only `write_figures` needs matplotlib (the `report` extra),
imported inside it with the Agg backend."""

from __future__ import annotations

import html
import itertools
import math
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.errors import RunDirError
from megalaunch.launcher.goodput import (
    COMPONENTS,
    STARTUP,
    chain_goodput,
    checkpoint_interval_hint,
    mfu,
    peak_tflops,
)
from megalaunch.rundir.evals import eval_records
from megalaunch.rundir.files import atomic_write_text, read_jsonl
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import TriggerBox

# One colour per component (the figures and the HTML timeline use the same ones).
COMPONENT_COLOURS = {
    "launch": "#c7c7c7", "imports": "#9edae5", "init": "#17becf", "model_build": "#aec7e8",
    "checkpoint_load": "#1f77b4", "data_setup": "#dbdb8d", "health_check": "#bcbd22",
    "productive": "#2ca02c",
    "checkpoint_save": "#ff7f0e", "lost_work": "#d62728", "exit": "#c5b0d5", "teardown": "#9467bd",
    "failed": "#7f0000", "untracked": "#bbbbbb",
}
COMPONENT_LABELS = {
    "launch": "launch", "imports": "imports", "init": "init", "model_build": "model build",
    "checkpoint_load": "checkpoint load", "data_setup": "data setup", "health_check": "health check",
    "productive": "productive",
    "checkpoint_save": "checkpoint save", "lost_work": "lost work", "exit": "exit", "teardown": "teardown",
    "failed": "failed", "untracked": "untracked",
}
OUTCOME_COLOURS = {
    "finished": "#2ca02c", "saved": "#1f77b4", "exited": "#555555", "aborted": "#ff7f0e",
    "failed": "#d62728", "hung": "#d62728", "killed": "#d62728", "config_error": "#d62728",
    "unhealthy_node": "#8c564b", "running": "#9467bd",
}
SEGMENT_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf")
ITER_DIR = re.compile(r"^iter_(\d{7})(?:\.(.+))?$")
REASON_CHARS = 48


@dataclass
class Report:
    html: Path
    figures: list[Path]
    summary: str
    out_note: str | None  # set when the report could not go to RUN/report/


# ------------------------------------------------------------------------------------------ gather


def outcome_of(seg: dict[str, Any]) -> str:
    return "running" if seg.get("running") else (seg.get("outcome") or "unknown")


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
        for it, begin, end in seg["saves"]:
            rows[(int(it), "")] = {"iteration": int(it), "job_id": seg["job_id"], "save_s": float(end) - float(begin),
                                   "saved_at": float(end), "size": None, "state": "deleted (retention)"}
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
    name, backend, target, override = paths.root.name, None, None, None
    try:
        from megalaunch.config.loader import load_run_recipe

        recipe = load_run_recipe(paths)
        name, backend, target = recipe.name, recipe.cluster.backend, recipe.training.train_iters
        override = getattr(recipe.cluster, "gpu_peak_tflops", None)
    except Exception:  # a damaged run.yaml must not hide the report: the ledger has what it needs
        pass
    for seg in chain["segments"]:
        seg["peak_tflops"] = peak_tflops(seg.get("gpu"), override)
        seg["mfu"] = mfu(seg.get("tflops_per_gpu"), seg.get("gpu"), override)
    stopped = next((e for e in reversed(events) if e.get("event") == "chain_stopped"), None)
    resumed = next((e for e in reversed(events) if e.get("event") == "chain_resumed"), None)
    if stopped and resumed and resumed["time"] > stopped["time"]:
        stopped = None
    return {
        "run_dir": str(paths.root), "chain_name": paths.root.name, "name": name, "backend": backend,
        "target": target, "generated": now, "chain": chain, "metrics": metrics, "step_s": step_s,
        "hint": checkpoint_interval_hint(chain, step_s), "checkpoints": checkpoints(paths, chain, events),
        "triggers": triggers(paths), "running": any(s["running"] for s in chain["segments"]),
        "stopped": stopped, "evals": eval_records(paths),
    }


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
    window_start = t
    window_end = t + parts.get("productive", 0.0) + parts.get("checkpoint_save", 0.0) + parts.get("lost_work", 0.0)
    saves = sorted((max(float(b), window_start), min(float(e), window_end)) for _, b, e in seg["saves"])
    saves = [(b, e) for b, e in saves if e > b]
    save_total = sum(e - b for b, e in saves)
    # goodput.py counts the overlap of each save with the window; rescale if rounding made them differ
    want = parts.get("checkpoint_save", 0.0)
    lost_left = parts.get("lost_work", 0.0)
    pieces: list[tuple[str, float, float]] = []
    cursor = window_start
    for b, e in saves:
        if b > cursor:
            pieces.append(("productive", cursor, b))
        b = max(b, cursor)
        if e > b:
            pieces.append(("checkpoint_save", b, e))
        cursor = max(cursor, e)
    if window_end > cursor:
        pieces.append(("productive", cursor, window_end))
    if abs(save_total - want) > 1e-6:  # overlapping saves: fall back to plain sequence
        pieces = []
        cursor = window_start
        for name in ("productive", "checkpoint_save"):
            if parts.get(name, 0.0) > 0:
                pieces.append((name, cursor, cursor + parts[name]))
                cursor += parts[name]
        if lost_left > 0:
            pieces.append(("lost_work", cursor, cursor + lost_left))
        lost_left = 0.0
    # the lost work is the last stretch of non-save training time
    out: list[tuple[str, float, float]] = []
    for name, b, e in reversed(pieces):
        if name == "productive" and lost_left > 1e-9:
            cut = min(lost_left, e - b)
            out.append(("lost_work", e - cut, e))
            if e - cut > b:
                out.append(("productive", b, e - cut))
            lost_left -= cut
        else:
            out.append((name, b, e))
    spans += [s for s in reversed(out) if s[2] > s[1]]
    t = window_end
    training = ("productive", "checkpoint_save", "lost_work")
    for k in ("exit", "teardown", "failed", *[c for c in COMPONENTS if c not in (*STARTUP, *training)]):
        if not any(n == k for n, _, _ in spans):
            add(k, parts.get(k, 0.0))
    return spans


def colour(component: str) -> str:
    return COMPONENT_COLOURS.get(component, "#bbbbbb")


def label(component: str) -> str:
    return COMPONENT_LABELS.get(component, component.replace("_", " "))


# ------------------------------------------------------------------------------------------ figures


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s >= 3 * 3600:
        return 3600.0, "h"
    if span_s >= 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def write_figures(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """loss.png, throughput.png, timeline.png, goodput.png under `out` (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    segs = data["chain"]["segments"]
    seg_colour = {s["job_id"]: SEGMENT_COLOURS[i % len(SEGMENT_COLOURS)] for i, s in enumerate(segs)}
    number = {s["job_id"]: s["number"] for s in segs}
    t0 = min([float(s["start"]) for s in segs], default=data["generated"])
    t1 = max([float(s["end"] or data["generated"]) for s in segs], default=t0 + 1)
    unit, uname = _time_unit(t1 - t0)
    figs: dict[str, Path] = {}

    def save(fig: Any, name: str) -> None:
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        figs[name] = path

    def empty(ax: Any, text: str) -> None:
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")

    metrics = data["metrics"]
    # (a) loss over iterations, one colour per segment, a line where each segment resumed
    fig, ax = plt.subplots(figsize=(9, 3.8))
    plotted = False
    for s in segs:
        rows = [m for m in metrics if str(m.get("job_id")) == s["job_id"] and _num(m.get("loss"))]
        if rows:
            ax.plot([m["iteration"] for m in rows], [m["loss"] for m in rows], color=seg_colour[s["job_id"]],
                    marker="." if len(rows) < 60 else None, lw=1.2, label=f"segment {number[s['job_id']]}")
            plotted = True
        if number[s["job_id"]] > 1 and s.get("start_iteration") is not None:
            ax.axvline(s["start_iteration"], color=seg_colour[s["job_id"]], ls="--", lw=0.8, alpha=0.7)
    if plotted:
        ax.legend(fontsize=8, ncol=min(5, len(segs)), loc="upper right")
    else:
        empty(ax, "no loss logged yet")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title("Loss (dashed: where a segment resumed)")
    ax.grid(alpha=0.3)
    save(fig, "loss")

    # (b) tokens/s and MFU over wall-clock time
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    have_mfu = any(s.get("peak_tflops") for s in segs)
    for s in segs:
        rows = [m for m in metrics if str(m.get("job_id")) == s["job_id"]]
        x = [(float(m["time"]) - t0) / unit for m in rows]
        tok = [(xi, m["tokens_per_s"]) for xi, m in zip(x, rows, strict=True) if _num(m.get("tokens_per_s"))]
        if tok:
            ax1.plot(*zip(*tok, strict=True), color=seg_colour[s["job_id"]], lw=1.2, marker=".")
        peak = s.get("peak_tflops")
        fl = [(xi, 100 * m["tflops_per_gpu"] / peak if peak else m["tflops_per_gpu"])
              for xi, m in zip(x, rows, strict=True) if _num(m.get("tflops_per_gpu"))]
        if fl:
            ax2.plot(*zip(*fl, strict=True), color=seg_colour[s["job_id"]], lw=1.2, marker=".")
        for ax in (ax1, ax2):
            ax.axvspan((float(s["start"]) - t0) / unit, (float(s["end"] or data["generated"]) - t0) / unit,
                       color=seg_colour[s["job_id"]], alpha=0.06)
    if not any(_num(m.get("tokens_per_s")) for m in metrics):
        empty(ax1, "no throughput logged yet")
    if not any(_num(m.get("tflops_per_gpu")) for m in metrics):
        empty(ax2, "no model FLOP/s logged")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("Throughput (shaded: each segment's wall time)")
    ax2.set_ylabel("MFU (%)" if have_mfu else "TFLOP/s per GPU")
    if not have_mfu:
        ax2.set_title("MFU unknown (no peak for this device): model TFLOP/s per GPU", fontsize=9)
    ax2.set_xlabel(f"time since the first segment started ({uname})")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    save(fig, "throughput")

    # (c) the chain's timeline: one bar per segment, its components in time order
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * max(1, len(segs))))
    for i, s in enumerate(segs):
        y = len(segs) - 1 - i
        for name, b, e in segment_spans(s):
            ax.barh(y, (e - b) / unit, left=(b - t0) / unit, height=0.6, color=colour(name), lw=0)
        outcome = outcome_of(s)
        ax.barh(y, (float(s["end"] or data["generated"]) - float(s["start"])) / unit,
                left=(float(s["start"]) - t0) / unit, height=0.6, fill=False,
                edgecolor=OUTCOME_COLOURS.get(outcome, "#999999"), lw=2, ls="--" if s["running"] else "-")
        ax.text((float(s["end"] or data["generated"]) - t0) / unit, y, "  " + segment_label(s), va="center",
                fontsize=8, color=OUTCOME_COLOURS.get(outcome, "#333333"))
    ax.set_yticks(range(len(segs)))
    ax.set_yticklabels([f"{s['number']}: {s['job_id']}" for s in reversed(segs)], fontsize=8)
    ax.set_xlim(0, (t1 - t0) / unit * 1.35 + 1e-9)
    ax.set_ylim(-0.7, max(1, len(segs)) - 0.3)
    ax.set_xlabel(f"time since the first segment started ({uname}); gaps between bars: queue wait")
    ax.set_title("Chain timeline (outline: outcome)")
    used = [c for c in COMPONENTS if any(n == c for s in segs for n, _, _ in segment_spans(s))]
    ax.legend(handles=[Patch(color=colour(c), label=label(c)) for c in used],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    save(fig, "timeline")

    # (d) where the time went: each segment and the chain, as shares of wall time
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.4 * (len(segs) + 1)))
    rows = [(f"{s['number']}: {s['job_id']}", s["parts"], s["wall"]) for s in segs]
    rows.append(("chain", data["chain"]["totals"], data["chain"]["wall"]))
    for y, (_label, parts, wall) in enumerate(reversed(rows)):
        left = 0.0
        for c in COMPONENTS:
            share = 100 * parts.get(c, 0.0) / wall if wall > 0 else 0.0
            if share > 0:
                ax.barh(y, share, left=left, color=colour(c), height=0.7)
                if share >= 6:
                    ax.text(left + share / 2, y, f"{share:.0f}%", ha="center", va="center", fontsize=7)
                left += share
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in reversed(rows)], fontsize=8)
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of wall time")
    g = data["chain"]["goodput"]
    ax.set_title(f"Goodput {100 * g:.1f}% (productive / wall)" if g is not None else "Goodput")
    used = [c for c in COMPONENTS if data["chain"]["totals"].get(c, 0.0) > 0]
    ax.legend(handles=[Patch(color=colour(c), label=label(c)) for c in used],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    save(fig, "goodput")
    return figs


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ------------------------------------------------------------------------------------------ text


def segment_label(seg: dict[str, Any]) -> str:
    outcome = outcome_of(seg)
    if outcome == "running":
        return "in progress"
    reason = seg.get("reason")
    if reason:
        reason = " ".join(str(reason).split())
        if len(reason) > REASON_CHARS:
            reason = reason[: REASON_CHARS - 1] + "…"
        return f"{outcome}: {reason}"
    return outcome


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def size_text(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or u == "TiB":
            return f"{value:.0f} {u}" if u == "B" else f"{value:.1f} {u}"
        value /= 1024
    return f"{n} B"


def when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t))) if _num(t) else "-"


def summary_line(data: dict[str, Any]) -> str:
    c = data["chain"]
    segs = c["segments"]
    g = c["goodput"]
    tot = c["totals"]
    wall = c["wall"] or 0.0

    def pct(keys: Iterable[str]) -> str:
        return f"{100 * sum(tot.get(k, 0.0) for k in keys) / wall:.0f}%" if wall > 0 else "-"

    state = "in progress" if data["running"] else ("stopped" if data["stopped"] else "idle")
    return (f"goodput {100 * g:.1f}%" if g is not None else "goodput -") + \
        (f" of {duration(wall)} over {len(segs)} segment{'s' if len(segs) != 1 else ''} ({state}); "
         f"start-up {pct(STARTUP)}, saves {pct(['checkpoint_save'])}, lost work {pct(['lost_work'])}, "
         f"failed {pct(['failed'])}, exit+teardown {pct(['exit', 'teardown'])}; queue wait {duration(c['wait'])}")


def _e(v: Any) -> str:
    return html.escape("-" if v is None else str(v), quote=True)


def _table(head: list[str], rows: list[str], cls: str) -> str:
    return (f'<table class="{cls}"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in head)
            + "</tr></thead><tbody>\n" + "\n".join(rows) + "\n</tbody></table>")


def _timeline_html(data: dict[str, Any]) -> str:
    segs = data["chain"]["segments"]
    if not segs:
        return "<p>No segment has started yet.</p>"
    t0 = min(float(s["start"]) for s in segs)
    t1 = max(float(s["end"] or data["generated"]) for s in segs)
    span = max(t1 - t0, 1e-9)
    rows = []
    for s in segs:
        outcome = outcome_of(s)
        pieces = []
        for name, b, e in segment_spans(s):
            pieces.append(f'<span class="span c-{name}" style="left:{100 * (b - t0) / span:.4f}%;'
                          f'width:{100 * (e - b) / span:.4f}%;background:{colour(name)}" '
                          f'title="{_e(label(name))}: {_e(duration(e - b))}"></span>')
        rows.append(
            f'<div class="timeline-bar outcome-{_e(outcome)}" data-job="{_e(s["job_id"])}" '
            f'style="border-color:{OUTCOME_COLOURS.get(outcome, "#999999")}">'
            f'<span class="seg-name">{_e(s["number"])}: {_e(s["job_id"])}</span>'
            f'<span class="track">{"".join(pieces)}</span>'
            f'<span class="seg-label" style="color:{OUTCOME_COLOURS.get(outcome, "#333333")}">'
            f'{_e(segment_label(s))}</span></div>')
    legend = "".join(f'<span class="key"><i style="background:{colour(c)}"></i>{_e(label(c))}'
                     "</span>" for c in COMPONENTS)
    return f'<div class="timeline">{"".join(rows)}</div><p class="legend">{legend}</p>'


def render_html(data: dict[str, Any], figures: dict[str, Path]) -> str:
    c = data["chain"]
    segs = c["segments"]
    wall = c["wall"]
    state = ('<span class="badge running">in progress</span>' if data["running"] else
             f'<span class="badge">stopped: {_e(data["stopped"].get("reason"))}</span>' if data["stopped"] else
             '<span class="badge">idle</span>')
    last_it = max([s["last_iteration"] for s in segs if s.get("last_iteration") is not None], default=None)
    out: list[str] = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',
        f"<title>megalaunch report: {_e(data['chain_name'])}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
        f"<h1>Run {_e(data['chain_name'])} {state}</h1>",
        '<dl class="facts">',
        f"<dt>run directory</dt><dd><code>{_e(data['run_dir'])}</code></dd>",
        f"<dt>backend</dt><dd>{_e(data['backend'])}</dd>",
        f"<dt>iteration</dt><dd>{_e(last_it)} / {_e(data['target'])}</dd>",
        f"<dt>segments</dt><dd>{len(segs)}</dd>",
        f"<dt>wall time</dt><dd>{_e(duration(wall))} (+ {_e(duration(c['wait']))} queue wait)</dd>",
        f"<dt>GPU-hours</dt><dd>{c['gpu_hours']:.3f}</dd>",
        f"<dt>goodput</dt><dd><b>{_e(f'{100 * c['goodput']:.1f} %' if c['goodput'] is not None else None)}</b>"
        " (productive / wall)</dd>",
        f"<dt>generated</dt><dd>{_e(when(data['generated']))}</dd>",
        "</dl>",
        f'<p class="summary">{_e(summary_line(data))}</p>',
        '<h2 id="timeline">Chain timeline</h2>',
        "<p>One bar per segment, from <code>job begin</code> to <code>job end</code>; its components in time "
        "order; the outline is the outcome. Gaps between bars are queue wait (not GPU time).</p>",
        _timeline_html(data),
    ]
    captions = {"timeline": "The chain's timeline", "goodput": "Where the time went (share of wall time)",
                "loss": "Loss over iterations", "throughput": "Tokens/s and MFU over time"}
    for name in ("timeline", "goodput", "loss", "throughput"):
        if name in figures:
            out.append(f'<figure><img src="{_e(figures[name].name)}" alt="{_e(captions[name])}">'
                       f"<figcaption>{_e(captions[name])}</figcaption></figure>")
            if name == "goodput":
                out += ['<h2 id="goodput">Goodput per segment</h2>', _goodput_table(data)]
            if name == "throughput":
                out += ['<h2 id="mfu">Throughput and MFU</h2>', _mfu_table(data)]
    out += ['<h2 id="checkpoints">Checkpoints</h2>', _checkpoint_table(data),
            '<h2 id="interval">Checkpoint interval (Young/Daly)</h2>', _hint_html(data),
            '<h2 id="triggers">Trigger audit</h2>', _trigger_table(data),
            *(['<h2 id="evals">Evaluations</h2>', _eval_table(data)] if data.get("evals") else []),
            '<p class="foot">Definitions: docs/goodput.md. Written by <code>megalaunch report</code>.</p>',
            "</body>", "</html>"]
    return "\n".join(out) + "\n"


def _goodput_table(data: dict[str, Any]) -> str:
    c = data["chain"]
    head = ["segment", "job", "outcome", "queue wait", *[label(k) for k in COMPONENTS], "wall", "goodput"]
    rows = []

    def cells(parts: dict[str, float], wall: float) -> str:
        out = []
        for k in COMPONENTS:
            v = parts.get(k, 0.0)
            share = f"{100 * v / wall:.1f}%" if wall > 0 else "-"
            out.append(f'<td class="num" data-component="{k}" data-seconds="{v:.6f}">{v:.1f} s<br>'
                       f'<small>{share}</small></td>')
        return "".join(out)

    for s in c["segments"]:
        wall = s["wall"]
        g = s["parts"].get("productive", 0.0) / wall if wall > 0 else None
        rows.append(f'<tr class="goodput-row" data-job="{_e(s["job_id"])}" data-wall="{wall:.6f}">'
                    f"<td>{_e(s.get('number'))}</td><td>{_e(s['job_id'])}</td><td>{_e(segment_label(s))}</td>"
                    f'<td class="num">{_e(duration(s["wait"]))}</td>{cells(s["parts"], wall)}'
                    f'<td class="num">{wall:.1f} s</td><td class="num">{_e(f"{100 * g:.1f}%" if g is not None else None)}'
                    "</td></tr>")
    g = c["goodput"]
    rows.append(f'<tr class="goodput-total" data-wall="{c["wall"]:.6f}"><th colspan="3">chain</th>'
                f'<td class="num">{_e(duration(c["wait"]))}</td>{cells(c["totals"], c["wall"])}'
                f'<td class="num">{c["wall"]:.1f} s</td><td class="num">'
                f'{_e(f"{100 * g:.1f}%" if g is not None else None)}</td></tr>')
    note = ("<p>The running segment's figures are up to now; its lost work is the training since its last "
            "save, which a save may still keep.</p>" if data["running"] else "")
    return note + '<div class="wide">' + _table(head, rows, "goodput") + "</div>"


def _mfu_table(data: dict[str, Any]) -> str:
    rows = []
    for s in data["chain"]["segments"]:
        tf = s.get("tflops_per_gpu")
        rows.append("<tr>" + "".join(f"<td>{v}</td>" for v in (
            _e(s.get("number")), _e(s["job_id"]), _e(s.get("gpu") or "CPU / unknown"), _e(s.get("world")),
            _e(f"{s['tokens_per_s']:.0f}" if _num(s.get("tokens_per_s")) else None),
            _e(f"{tf:.4g}" if _num(tf) else None), _e(s.get("peak_tflops")),
            _e(f"{100 * s['mfu']:.1f}%" if _num(s.get("mfu")) else None))) + "</tr>")
    return (_table(["segment", "job", "device", "ranks", "tokens/s (median)", "model TFLOP/s per GPU (median)",
                    "peak TFLOP/s (dense bf16)", "MFU"], rows, "mfu")
            + "<p>MFU = model TFLOP/s per GPU / the device's dense bf16 peak (docs/goodput.md); no peak is known "
              "for CPUs and unlisted devices.</p>")


def _eval_table(data: dict[str, Any]) -> str:
    """One row per evaluated iteration (RUN/evals/, docs/eval.md): held-out perplexity, task accuracies."""
    tasks = sorted({t for r in data["evals"] for t in (r.get("tasks") or {})})
    rows = []
    for r in data["evals"]:
        ppl = r.get("heldout_ppl")
        accs = [(r.get("tasks") or {}).get(t) for t in tasks]
        rows.append(f'<tr class="eval-row"><td class="num">{r["iteration"]}</td><td>{_e(r["state"])}</td>'
                    f'<td class="num">{_e(f"{ppl:.4g}" if _num(ppl) else None)}</td>'
                    + "".join(f'<td class="num">{_e(f"{a:.3f}" if _num(a) else None)}</td>' for a in accs)
                    + f"<td>{_e(r.get('reason'))}</td></tr>")
    return _table(["iteration", "state", "held-out perplexity", *[f"{t} acc" for t in tasks], "why it failed"],
                  rows, "evals")


def _checkpoint_table(data: dict[str, Any]) -> str:
    if not data["checkpoints"]:
        return "<p>No checkpoint yet.</p>"
    rows = [f'<tr class="checkpoint-row"><td class="num">{r["iteration"]}</td><td class="num">{_e(size_text(r["size"]))}'
            f'</td><td class="num">{_e(duration(r["save_s"]) if r["save_s"] is not None else None)}</td>'
            f"<td>{_e(r['job_id'])}</td><td>{_e(when(r['saved_at']))}</td><td>{_e(r['state'])}</td></tr>"
            for r in data["checkpoints"]]
    return _table(["iteration", "size", "blocking save time", "saved by job", "saved at", "state"], rows,
                  "checkpoints")


def _hint_html(data: dict[str, Any]) -> str:
    h = data["hint"]
    facts = (f"measured save time (median of {sum(len(s['saves']) for s in data['chain']['segments'])} blocking saves): "
             f"<b>{_e(duration(h['save_s']))}</b>; failures observed: <b>{h['failures']}</b> in "
             f"{_e(duration(h['wall_s']))} of wall time")
    if h["save_s"] is None:
        return f"<p>{facts}. No save has been measured yet, so there is no suggestion.</p>"
    if h["interval_s"] is None:
        return (f"<p>{facts}. No failure has been observed, so the mean time between failures (MTBF) is "
                "unknown and no interval is suggested: save as often as the work you can afford to lose.</p>")
    iters = (f" = about <b>{h['interval_iters']}</b> iterations at {data['step_s']:.3g} s per iteration"
             if h.get("interval_iters") else "")
    return (f"<p>{facts}; MTBF = wall / failures = <b>{_e(duration(h['mtbf_s']))}</b>.</p>"
            f'<p class="hint">Suggested checkpoint interval: sqrt(2 × MTBF × save time) = '
            f"<b>{_e(duration(h['interval_s']))}</b>{iters} (<code>checkpoint.save_interval</code>). "
            "Young/Daly's first-order optimum; it assumes failures independent of each other and a save "
            "much shorter than the MTBF.</p>")


def _trigger_table(data: dict[str, Any]) -> str:
    if not data["triggers"]:
        return "<p>No trigger has been written.</p>"
    rows = []
    for r in data["triggers"]:
        done = "pending" if r["pending"] else (
            f"iteration {r.get('consumed_iteration')} (job {r.get('consumed_by_job')}, {when(r.get('consumed_at'))})")
        rows.append(f'<tr class="trigger-row"><td>{_e(r.get("verb"))}</td><td>{_e(r.get("user"))}@{_e(r.get("host"))}'
                    f"</td><td>{_e(r.get('reason'))}</td><td>{_e(when(r.get('time')))}</td><td>{_e(done)}</td></tr>")
    return _table(["verb", "who", "why", "written", "acted on at"], rows, "triggers")


CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
.badge{font-size:.6em;vertical-align:middle;padding:.15em .5em;border-radius:.6em;background:#eee;color:#333}
.badge.running{background:#9467bd;color:#fff}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dl.facts dt{color:#666}dl.facts dd{margin:0}
.summary{background:#f6f6f6;padding:.5em .8em;border-left:4px solid #2ca02c}
table{border-collapse:collapse;margin:.5em 0;font-size:12px}th,td{border:1px solid #ddd;padding:.25em .45em;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;white-space:nowrap}.wide{overflow-x:auto}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}figcaption{color:#666;font-size:12px}
.timeline{margin:.5em 0}
.timeline-bar{display:flex;align-items:center;gap:.6em;margin:3px 0;border-left:5px solid;padding-left:.4em}
.timeline-bar .seg-name{width:9em;font-size:12px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.timeline-bar .track{position:relative;flex:1;height:16px;background:#fafafa}
.timeline-bar .span{position:absolute;top:0;height:100%}
.timeline-bar .seg-label{width:22em;font-size:12px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.outcome-running .track{outline:1px dashed #9467bd}
.legend .key{display:inline-block;margin-right:1em;font-size:12px}.legend i{display:inline-block;width:.9em;height:.9em;margin-right:.3em;vertical-align:-1px}
.hint{background:#eef5ff;padding:.5em .8em;border-left:4px solid #1f77b4}.foot{color:#888;font-size:12px;margin-top:2em}
"""


# ------------------------------------------------------------------------------------------ write


def default_out(paths: RunPaths) -> tuple[Path, str | None]:
    """RUN/report/, or ./<chain-name>-report/ when this user cannot write in the run directory."""
    target = paths.root / "report"
    probe = target if target.is_dir() else paths.root
    if os.access(probe, os.W_OK | os.X_OK):
        return target, None
    local = Path.cwd() / f"{paths.root.name}-report"
    return local, f"you cannot write in {paths.root}; the report goes to {local}"


def write_report(paths: RunPaths, out: Path | None = None, now: float | None = None) -> Report:
    """Gather, draw and write OUT/report.html with its figures; returns where and a one-line summary."""
    note = None
    if out is None:
        out, note = default_out(paths)
    data = gather(paths, now)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the report directory {out}: {e.strerror or e}",
                          field="--out", fix="pass --out DIR with a directory you can write") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise RunDirError(f"cannot write in {out}", field="--out", fix="pass --out DIR with a directory you can write")
    figures = write_figures(data, out)
    path = out / "report.html"
    atomic_write_text(path, render_html(data, figures))
    return Report(html=path, figures=list(figures.values()), summary=summary_line(data), out_note=note)
