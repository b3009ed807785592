"""The report's page: report.html, one self-contained HTML page (no script, no external URL; the
figures are PNG files next to it, referenced relatively). Every value from the run directory is
escaped (`_e`); the timeline is drawn in HTML too, so it needs no figure to read."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from megalaunch.launcher.accounting.goodput import COMPONENTS
from megalaunch.launcher.report.data import is_number, outcome_of, segment_spans
from megalaunch.launcher.report.style import (
    OUTCOME_COLOURS,
    colour,
    duration,
    label,
    segment_label,
    size_text,
    summary_line,
    when,
)


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
             f'<span class="badge">stopped: {_e(data["stopped"].get("reason"))}'
             + (f'; fix: {_e(data["stopped"]["fix"])}' if data["stopped"].get("fix") else "") + "</span>"
             if data["stopped"] else
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
                "loss": "Loss over iterations", "throughput": "Tokens/s and MFU over time",
                "moe_load": "Expert load per MoE layer over iterations"}
    for name in ("timeline", "goodput", "loss", "throughput", "moe_load"):
        if name == "moe_load" and name in figures:
            out += ['<h2 id="experts">Expert load</h2>', _moe_html(data)]
        if name in figures:
            out.append(f'<figure><img src="{_e(figures[name].name)}" alt="{_e(captions[name])}">'
                       f"<figcaption>{_e(captions[name])}</figcaption></figure>")
            if name == "goodput":
                out += ['<h2 id="goodput">Goodput per segment</h2>', _goodput_table(data)]
            if name == "throughput":
                out += ['<h2 id="mfu">Throughput and MFU</h2>', _mfu_table(data)]
    if any(m.get("flow") for m in data["metrics"]):
        out += ['<h2 id="flow">Flow metrics</h2>', _flow_table(data)]
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
            _e(f"{s['tokens_per_s']:.0f}" if is_number(s.get("tokens_per_s")) else None),
            _e(f"{tf:.4g}" if is_number(tf) else None), _e(s.get("peak_tflops")),
            _e(f"{100 * s['mfu']:.1f}%" if is_number(s.get("mfu")) else None))) + "</tr>")
    return (_table(["segment", "job", "device", "ranks", "tokens/s (median)", "model TFLOP/s per GPU (median)",
                    "peak TFLOP/s (dense bf16)", "MFU"], rows, "mfu")
            + "<p>MFU = model TFLOP/s per GPU / the device's dense bf16 peak (docs/goodput.md); no peak is known "
              "for CPUs and unlisted devices.</p>")


def _moe_html(data: dict[str, Any]) -> str:
    """The collapse rule and the routers it names at the last record (runtime/observation/moe_balance.py)."""
    from megalaunch.runtime.observation.moe_balance import COLLAPSE_CAPTURE, COLLAPSE_INTERVALS, collapsing

    rule = (f"A router collapses when one expert takes at least {COLLAPSE_CAPTURE:.0%} of the way from its even "
            f"share of the tokens (top-k / experts) to all of them, in {COLLAPSE_INTERVALS} log intervals in a row.")
    found = collapsing(data["moe"])
    named = "".join(f'<li class="moe-collapse">layer {_e(c["layer"])}: expert {_e(c["expert"])} took '
                    f'{_e(f"{c["share"]:.0%}")} of the tokens (even {_e(f"{c["even"]:.1%}")}) since iteration '
                    f"{_e(c['since'])}</li>" for c in found)
    return f"<p>{_e(rule)}</p>" + (f"<ul>{named}</ul>" if named else "<p>No router is collapsing.</p>")


def _eval_table(data: dict[str, Any]) -> str:
    """One row per evaluated iteration (RUN/evals/, docs/eval.md): held-out perplexity, task accuracies."""
    tasks = sorted({t for r in data["evals"] for t in (r.get("tasks") or {})})
    rows = []
    for r in data["evals"]:
        ppl = r.get("heldout_ppl")
        accs = [(r.get("tasks") or {}).get(t) for t in tasks]
        rows.append(f'<tr class="eval-row"><td class="num">{r["iteration"]}</td><td>{_e(r["state"])}</td>'
                    f'<td class="num">{_e(f"{ppl:.4g}" if is_number(ppl) else None)}</td>'
                    + "".join(f'<td class="num">{_e(f"{a:.3f}" if is_number(a) else None)}</td>' for a in accs)
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
    facts = (f"measured save time (median of {h['saves']} blocking saves): "
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


def _flow_table(data: dict[str, Any], most: int = 24) -> str:
    """A flow's own metrics (DPO's rewards, GRPO's reward / KL / clip fraction, distillation's KL) at up to
    `most` logged iterations, evenly spaced, the last included."""
    rows = [m for m in data["metrics"] if isinstance(m.get("flow"), dict) and m["flow"]]
    names = sorted({k for m in rows for k in m["flow"]})
    step = max(1, -(-len(rows) // most))
    shown = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    body = [f"<tr><td class=\"num\">{_e(m['iteration'])}</td>" + "".join(
        f"<td class=\"num\">{_e(f'{m['flow'][k]:.4g}' if isinstance(m['flow'].get(k), (int, float)) else None)}</td>"
        for k in names) + "</tr>" for m in shown]
    return _table(["iteration", *names], body, "flow")


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
