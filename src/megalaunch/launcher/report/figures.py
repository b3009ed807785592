"""The report's figures: loss.png, throughput.png, timeline.png and goodput.png (docs/goodput.md); for an MoE
run also moe_load.png (the experts' load per layer).

matplotlib (the `report` extra) is imported inside the functions that draw, with the Agg backend, so
importing this module costs nothing; the data come from `report_data.gather`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch.launcher.accounting.goodput import COMPONENTS
from megalaunch.launcher.report.data import is_number, outcome_of, segment_spans
from megalaunch.launcher.report.style import OUTCOME_COLOURS, SEGMENT_COLOURS, colour, label, segment_label


@dataclass(frozen=True)
class Frame:
    """What every figure shares: the segments, a colour per segment and the time axis."""

    data: dict[str, Any]
    segs: list[dict[str, Any]]
    seg_colour: dict[str, str]
    number: dict[str, int]
    t0: float
    t1: float
    unit: float
    uname: str

    @classmethod
    def of(cls, data: dict[str, Any]) -> Frame:
        segs = data["chain"]["segments"]
        t0 = min([float(s["start"]) for s in segs], default=data["generated"])
        t1 = max([float(s["end"] or data["generated"]) for s in segs], default=t0 + 1)
        unit, uname = _time_unit(t1 - t0)
        return cls(data=data, segs=segs,
                   seg_colour={s["job_id"]: SEGMENT_COLOURS[i % len(SEGMENT_COLOURS)] for i, s in enumerate(segs)},
                   number={s["job_id"]: s["number"] for s in segs}, t0=t0, t1=t1, unit=unit, uname=uname)

    def end(self, seg: dict[str, Any]) -> float:
        """Where a segment ends on the time axis: its end, or now while it runs."""
        return float(seg["end"] or self.data["generated"])


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

    frame = Frame.of(data)
    figs: dict[str, Path] = {}
    for name, draw in (("loss", _loss), ("throughput", _throughput), ("timeline", _timeline),
                       ("goodput", _goodput)):
        fig = draw(frame)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        figs[name] = path
    if data.get("moe"):  # an MoE run's expert load
        fig = _moe_load(frame)
        figs["moe_load"] = out / "moe_load.png"
        fig.savefig(figs["moe_load"], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return figs


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")


def _legend(ax: Any, used: list[str]) -> None:
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colour(c), label=label(c)) for c in used],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _loss(f: Frame) -> Any:
    """Loss over iterations, one colour per segment, a line where each segment resumed."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    plotted = False
    for s in f.segs:
        rows = [m for m in f.data["metrics"] if str(m.get("job_id")) == s["job_id"] and is_number(m.get("loss"))]
        if rows:
            ax.plot([m["iteration"] for m in rows], [m["loss"] for m in rows], color=f.seg_colour[s["job_id"]],
                    marker="." if len(rows) < 60 else None, lw=1.2, label=f"segment {f.number[s['job_id']]}")
            plotted = True
        if f.number[s["job_id"]] > 1 and s.get("start_iteration") is not None:
            ax.axvline(s["start_iteration"], color=f.seg_colour[s["job_id"]], ls="--", lw=0.8, alpha=0.7)
    if plotted:
        ax.legend(fontsize=8, ncol=min(5, len(f.segs)), loc="upper right")
    else:
        _empty(ax, "no loss logged yet")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title("Loss (dashed: where a segment resumed)")
    ax.grid(alpha=0.3)
    return fig


def _throughput(f: Frame) -> Any:
    """Tokens/s and MFU over wall-clock time, each segment's wall time shaded."""
    import matplotlib.pyplot as plt

    metrics = f.data["metrics"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    have_mfu = any(s.get("peak_tflops") for s in f.segs)
    for s in f.segs:
        rows = [m for m in metrics if str(m.get("job_id")) == s["job_id"]]
        x = [(float(m["time"]) - f.t0) / f.unit for m in rows]
        tok = [(xi, m["tokens_per_s"]) for xi, m in zip(x, rows, strict=True) if is_number(m.get("tokens_per_s"))]
        if tok:
            ax1.plot(*zip(*tok, strict=True), color=f.seg_colour[s["job_id"]], lw=1.2, marker=".")
        peak = s.get("peak_tflops")
        fl = [(xi, 100 * m["tflops_per_gpu"] / peak if peak else m["tflops_per_gpu"])
              for xi, m in zip(x, rows, strict=True) if is_number(m.get("tflops_per_gpu"))]
        if fl:
            ax2.plot(*zip(*fl, strict=True), color=f.seg_colour[s["job_id"]], lw=1.2, marker=".")
        for ax in (ax1, ax2):
            ax.axvspan((float(s["start"]) - f.t0) / f.unit, (f.end(s) - f.t0) / f.unit,
                       color=f.seg_colour[s["job_id"]], alpha=0.06)
    if not any(is_number(m.get("tokens_per_s")) for m in metrics):
        _empty(ax1, "no throughput logged yet")
    if not any(is_number(m.get("tflops_per_gpu")) for m in metrics):
        _empty(ax2, "no model FLOP/s logged")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("Throughput (shaded: each segment's wall time)")
    ax2.set_ylabel("MFU (%)" if have_mfu else "TFLOP/s per GPU")
    if not have_mfu:
        ax2.set_title("MFU unknown (no peak for this device): model TFLOP/s per GPU", fontsize=9)
    ax2.set_xlabel(f"time since the first segment started ({f.uname})")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return fig


def _timeline(f: Frame) -> Any:
    """The chain's timeline: one bar per segment, its components in time order, outlined by its outcome."""
    import matplotlib.pyplot as plt

    segs, t0, unit = f.segs, f.t0, f.unit
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * max(1, len(segs))))
    for i, s in enumerate(segs):
        y = len(segs) - 1 - i
        for name, b, e in segment_spans(s):
            ax.barh(y, (e - b) / unit, left=(b - t0) / unit, height=0.6, color=colour(name), lw=0)
        outcome = outcome_of(s)
        ax.barh(y, (f.end(s) - float(s["start"])) / unit,
                left=(float(s["start"]) - t0) / unit, height=0.6, fill=False,
                edgecolor=OUTCOME_COLOURS.get(outcome, "#999999"), lw=2, ls="--" if s["running"] else "-")
        ax.text((f.end(s) - t0) / unit, y, "  " + segment_label(s), va="center",
                fontsize=8, color=OUTCOME_COLOURS.get(outcome, "#333333"))
    ax.set_yticks(range(len(segs)))
    ax.set_yticklabels([f"{s['number']}: {s['job_id']}" for s in reversed(segs)], fontsize=8)
    ax.set_xlim(0, (f.t1 - t0) / unit * 1.35 + 1e-9)
    ax.set_ylim(-0.7, max(1, len(segs)) - 0.3)
    ax.set_xlabel(f"time since the first segment started ({f.uname}); gaps between bars: queue wait")
    ax.set_title("Chain timeline (outline: outcome)")
    _legend(ax, [c for c in COMPONENTS if any(n == c for s in segs for n, _, _ in segment_spans(s))])
    ax.grid(axis="x", alpha=0.3)
    return fig


def _goodput(f: Frame) -> Any:
    """Where the time went: each segment and the chain, as shares of wall time."""
    import matplotlib.pyplot as plt

    chain = f.data["chain"]
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.4 * (len(f.segs) + 1)))
    rows = [(f"{s['number']}: {s['job_id']}", s["parts"], s["wall"]) for s in f.segs]
    rows.append(("chain", chain["totals"], chain["wall"]))
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
    g = chain["goodput"]
    ax.set_title(f"Goodput {100 * g:.1f}% (productive / wall)" if g is not None else "Goodput")
    _legend(ax, [c for c in COMPONENTS if chain["totals"].get(c, 0.0) > 0])
    return fig


def _moe_load(f: Frame) -> Any:
    """Expert load over iterations: max/mean tokens per expert of every MoE layer (a heat map), and the
    share of the tokens each expert of the worst layer (at the latest record) took, against the even share."""
    import matplotlib.pyplot as plt

    from megalaunch.runtime.observation.moe_balance import summary

    records = f.data["moe"]
    its = [r["iteration"] for r in records]
    numbers = sorted({la["layer"] for r in records for la in r["layers"]})
    grid = [[next((la["max_over_mean"] for la in r["layers"] if la["layer"] == n), None) for r in records]
            for n in numbers]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 2.4 + 0.18 * len(numbers) + 3), sharex=True,
                                   gridspec_kw={"height_ratios": [max(1.0, 0.18 * len(numbers)), 2.2]})
    step = (its[-1] - its[0]) / (len(its) - 1) if len(its) > 1 else 1.0  # each cell centred on its iteration
    span = (its[0] - step / 2, its[-1] + step / 2)
    image = ax1.imshow([[v if v is not None else float("nan") for v in row] for row in grid], aspect="auto",
                       origin="lower", interpolation="nearest", cmap="magma_r", vmin=1.0,
                       extent=(span[0], span[1], 0.5, len(numbers) + 0.5))
    fig.colorbar(image, ax=ax1, label="max / mean", pad=0.01)
    ax1.set_yticks(range(1, len(numbers) + 1), [str(n) for n in numbers] if len(numbers) <= 24 else None)
    ax1.set_ylabel("layer")
    ax1.set_title("Expert load: the busiest expert's tokens / the mean expert's, per MoE layer (1 = even)")
    worst = summary(records[-1])
    layer = worst.get("worst_layer")
    rows = [next((la for la in r["layers"] if la["layer"] == layer), None) for r in records]
    pairs = [(it, la) for it, la in zip(its, rows, strict=True) if la and la["tokens"] > 0]
    if pairs:
        shares = [[c / la["tokens"] for c in la["counts"]] for _, la in pairs]
        for e in range(len(shares[0])):
            ax2.plot([it for it, _ in pairs], [s[e] for s in shares], lw=1.1, marker="." if len(pairs) < 60 else None,
                     label=f"expert {e}")
        if worst.get("even_share") is not None:
            ax2.axhline(worst["even_share"], color="#333333", ls="--", lw=0.9, label="even share")
        if len(shares[0]) <= 16:
            ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax2.set_ylabel("share of the tokens")
    ax2.set_xlabel("iteration")
    ax2.set_title(f"Layer {layer} (the worst at iteration {its[-1]}): each expert's share of the tokens", fontsize=9)
    ax2.grid(alpha=0.3)
    return fig
