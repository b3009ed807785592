"""The expert load of a mixture-of-experts run, as its readers see it (standard library only: `status`, the
report and the job share it). The job (runtime/observation/moe_load.py) appends one JSON line per log
interval to RUN/state/moe_load.jsonl:

    {"iteration": 20, "job_id": "123", "time": 1764000000.0, "experts": 8, "topk": 2, "steps": 5,
     "layers": [{"layer": 1, "tokens": 640, "counts": [170, 151, ...], "dropped": 0,
                 "max_over_mean": 1.06, "aux": {"load_balancing_loss": 1.003}}, ...],
     "aux": {"load_balancing_loss": 1.004}}

`counts[e]` is how many tokens the router sent to expert e in the interval, over every rank (before a
capacity factor drops any: `dropped` of them were dropped), so a layer's counts add up to `tokens` x `topk`;
`tokens` is the tokens the layer routed (the global batch's, every iteration of the interval); `steps` the
iterations. `aux` holds the per-layer losses Megatron tracks (load-balancing loss as Megatron logs it, i.e.
without its coefficient, and the z-loss when on), averaged over the interval; the record's `aux` is their
mean over the MoE layers, Megatron's logged figure. A line holds layers x experts counts: bounded by the
model, not by the run.

A collapsing router: in one layer, one expert takes at least halfway from its even share of the tokens
(topk / experts) to all of them, `capture` = (share - topk/E) / (1 - topk/E) >= COLLAPSE_CAPTURE, in each
of the last COLLAPSE_INTERVALS log intervals. The rule holds for any top-k and number of experts: a top-1
router of 8 experts collapses at 56 % of the tokens on one expert (max/mean 4.5), a top-2 one at 62.5 %
(max/mean 2.5); with topk == experts there is nothing to collapse."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

COLLAPSE_CAPTURE = 0.5
COLLAPSE_INTERVALS = 3
TAIL_RECORDS = 12  # what `status` reads of the file's end: the latest records, enough to say since when
REPORT_POINTS = 400  # the report plots at most this many records, evenly spaced over the run


def hot_expert(layer: dict[str, Any]) -> tuple[int, float] | None:
    """The expert that took the most tokens of a layer record, and its share of the layer's tokens."""
    counts, tokens = layer.get("counts") or [], layer.get("tokens") or 0
    if not counts or tokens <= 0:
        return None
    expert = max(range(len(counts)), key=counts.__getitem__)
    return expert, counts[expert] / tokens


def max_over_mean(counts: Sequence[float]) -> float | None:
    """The busiest expert's tokens over the mean expert's: 1 is even, experts/topk is every token on one."""
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean > 0 else None


def capture(share: float, topk: int, experts: int) -> float | None:
    """How far one expert's token share went from the even share (0) to every token (1)."""
    even = topk / experts if experts else 1.0
    return (share - even) / (1 - even) if even < 1 else None


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """The record's headline (progress.json, status): its worst layer by max/mean and that layer's
    busiest expert, the aux losses, and the share of routed tokens dropped."""
    layers = [la for la in record.get("layers") or [] if isinstance(la.get("max_over_mean"), (int, float))]
    experts, topk = record.get("experts") or 0, record.get("topk") or 1
    out: dict[str, Any] = {"iteration": record.get("iteration"), "aux": record.get("aux") or {},
                           "even_share": topk / experts if experts else None}
    if layers:
        worst = max(layers, key=lambda la: la["max_over_mean"])
        hot = hot_expert(worst)
        out.update(worst_layer=worst["layer"], max_over_mean=round(worst["max_over_mean"], 4),
                   hot_expert=hot[0] if hot else None, hot_share=round(hot[1], 4) if hot else None)
        routed = sum(la.get("tokens", 0) for la in layers) * topk
        out["dropped_share"] = sum(la.get("dropped", 0) for la in layers) / routed if routed else 0.0
    return out


def collapsing(records: list[dict[str, Any]], intervals: int = COLLAPSE_INTERVALS,
               threshold: float = COLLAPSE_CAPTURE) -> list[dict[str, Any]]:
    """The layers whose router is collapsing in the last `intervals` records (oldest first): the same
    expert at or past `threshold` capture in each. For each: layer, expert, its latest token share, the
    even share, and since which record's iteration it has held (looking back through all `records`)."""
    if len(records) < intervals:
        return []
    found = []
    last = records[-1]
    for layer in last.get("layers") or []:
        hot = hot_expert(layer)
        if hot is None:
            continue
        run = 0
        for rec in reversed(records):
            if not _holds(rec, layer["layer"], hot[0], threshold):
                break
            run += 1
        if run >= intervals:
            experts, topk = last.get("experts") or len(layer["counts"]), last.get("topk") or 1
            found.append({"layer": layer["layer"], "expert": hot[0], "share": hot[1], "even": topk / experts,
                          "intervals": run, "since": records[-run].get("iteration")})
    return found


def _holds(record: dict[str, Any], layer_number: int, expert: int, threshold: float) -> bool:
    layer = next((la for la in record.get("layers") or [] if la.get("layer") == layer_number), None)
    hot = hot_expert(layer) if layer else None
    if hot is None or hot[0] != expert:
        return False
    c = capture(hot[1], record.get("topk") or 1, record.get("experts") or len(layer["counts"]))  # type: ignore[index]
    return c is not None and c >= threshold


def wandb_figures(record: dict[str, Any]) -> dict[str, float]:
    """What W&B gets each log interval: max/mean per layer and the worst, the aux losses, the dropped share."""
    s = summary(record)
    out = {f"moe/layer_{la['layer']}/max_over_mean": la["max_over_mean"] for la in record.get("layers") or []
           if isinstance(la.get("max_over_mean"), (int, float))}
    out.update({f"moe/{name}": v for name, v in s["aux"].items()})
    if "max_over_mean" in s:
        out.update({"moe/worst_max_over_mean": s["max_over_mean"], "moe/dropped_share": s["dropped_share"]})
    return out


# --- reading the file -----------------------------------------------------------------------------------

def _parse(lines: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line
        if isinstance(rec, dict) and isinstance(rec.get("iteration"), int):
            out.append(rec)
    return out


def tail(path: str | os.PathLike[str], n: int = TAIL_RECORDS) -> list[dict[str, Any]]:
    """The last `n` complete records, read from the file's end (a long run's file is large)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            size, data = 1 << 16, b""
            while True:
                start = max(0, end - size)
                f.seek(start)
                data = f.read(end - start)
                if start == 0 or data.count(b"\n") > n:
                    break
                size *= 4
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    complete = lines[:-1] if start == 0 else lines[1:-1]  # the first may be cut; the last lacks its newline
    return _parse(complete[-n:])


def sampled(path: str | os.PathLike[str], limit: int = REPORT_POINTS) -> list[dict[str, Any]]:
    """At most `limit` records spread evenly over the file, the last one always among them."""
    try:
        with open(path, "rb") as f:
            lines = [line for line in f if line.endswith(b"\n")]
    except FileNotFoundError:
        return []
    if len(lines) > limit:
        step = len(lines) / limit
        lines = [lines[int(i * step)] for i in range(limit - 1)] + [lines[-1]]
    return _parse(lines)
