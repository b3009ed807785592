"""How the report names and colours things, shared by its figures (`report_figures`) and its page
(`report_html`): one colour and label per goodput component, outcome and segment colours, and the
words for durations, sizes, times, a segment's ending and the chain's one-line summary."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from megalaunch.launcher.accounting.goodput import STARTUP
from megalaunch.launcher.report.data import is_number, outcome_of

# One colour per component (the figures and the HTML timeline use the same ones).
COMPONENT_COLOURS = {
    "launch": "#c7c7c7", "imports": "#9edae5", "init": "#17becf", "model_build": "#aec7e8",
    "checkpoint_load": "#1f77b4", "data_setup": "#dbdb8d", "health_check": "#bcbd22",
    "productive": "#2ca02c",
    "checkpoint_save": "#ff7f0e", "lost_work": "#d62728", "exit": "#c5b0d5", "teardown": "#9467bd",
    "failed": "#7f0000", "restart": "#e377c2", "untracked": "#bbbbbb",
}
COMPONENT_LABELS = {
    "launch": "launch", "imports": "imports", "init": "init", "model_build": "model build",
    "checkpoint_load": "checkpoint load", "data_setup": "data setup", "health_check": "health check",
    "productive": "productive",
    "checkpoint_save": "checkpoint save", "lost_work": "lost work", "exit": "exit", "teardown": "teardown",
    "failed": "failed", "restart": "in-job restart", "untracked": "untracked",
}
OUTCOME_COLOURS = {
    "finished": "#2ca02c", "saved": "#1f77b4", "exited": "#555555", "aborted": "#ff7f0e",
    "failed": "#d62728", "hung": "#d62728", "killed": "#d62728", "config_error": "#d62728",
    "unhealthy_node": "#8c564b", "running": "#9467bd", "storage_full": "#d62728", "cancelled": "#7f7f7f",
    "timeout": "#d62728",
}
SEGMENT_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf")
REASON_CHARS = 48


def colour(component: str) -> str:
    return COMPONENT_COLOURS.get(component, "#bbbbbb")


def label(component: str) -> str:
    return COMPONENT_LABELS.get(component, component.replace("_", " "))


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
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t))) if is_number(t) else "-"


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
         f"failed {pct(['failed'])}, restarts {pct(['restart'])}, exit+teardown {pct(['exit', 'teardown'])}; queue wait {duration(c['wait'])}")
