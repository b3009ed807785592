"""Stragglers (issue 12 item 5, docs/training.md "Stragglers"): every rank times its own compute per
iteration (its forward steps; no collective per iteration); at points every rank reaches together, after each save and at the
segment's end, one all-gather brings every rank's mean and median step time to all, and rank 0 writes
a summary: the median, the slowest rank and its node, the fastest, and the spread (how much slower
the slowest is than the median). `status` prints a `stragglers:` line when the spread exceeds
cluster.straggler_threshold.

Where nvidia-resiliency-ext is installed, its straggler Detector's relative performance scores are
added to the summary (`nvrx_scores`); it is optional, never a dependency."""

from __future__ import annotations

import math
import statistics
import time
from array import array
from typing import Any


class StepTimer:
    """This rank's compute per iteration: the time inside its forward steps (CUDA events on a GPU,
    read once they completed, so no synchronisation is added; the clock on the CPU). Wall time per
    iteration is the same on every rank of a synchronous job (everyone waits for the slowest in the
    gradient all-reduce): the forward time is what tells a slow rank apart. The first iteration
    (warm-up) is left out."""

    def __init__(self, cuda: bool = False) -> None:
        self.times = array("d")
        self.cuda = cuda
        self._current = 0.0
        self._began: Any = None
        self._pending: list[tuple[Any, Any]] = []  # CUDA events not yet read
        self._iterations = 0

    def forward_begin(self) -> None:
        if self.cuda:
            import torch

            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        else:
            self._began = time.perf_counter()

    def forward_end(self) -> None:
        if self._began is None:
            return
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._began, end))
        else:
            self._current += time.perf_counter() - self._began
        self._began = None

    def iteration(self) -> None:
        still = []
        for begin, end in self._pending:
            if end.query():
                self._current += begin.elapsed_time(end) / 1000.0
            else:
                still.append((begin, end))
        self._pending = still
        self._iterations += 1
        if self._iterations > 1 and self._current > 0:
            self.times.append(self._current)
        self._current = 0.0

    def stats(self) -> dict[str, float | int | None]:
        xs = sorted(self.times)
        if not xs:
            return {"steps": 0, "mean_s": None, "median_s": None}
        mid = len(xs) // 2
        median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        return {"steps": len(xs), "mean_s": sum(xs) / len(xs), "median_s": median}


def summarize(ranks: list[dict[str, Any]], *, threshold: float) -> dict[str, Any] | None:
    """One segment's spread from every rank's {rank, node, steps, mean_s, median_s} (pure).
    None when no rank has timed a step yet."""
    timed = [r for r in ranks if isinstance(r.get("mean_s"), (int, float)) and math.isfinite(r["mean_s"])]
    if not timed:
        return None
    median = statistics.median(float(r["mean_s"]) for r in timed)
    slowest = max(timed, key=lambda r: (r["mean_s"], -r["rank"]))
    fastest = min(timed, key=lambda r: (r["mean_s"], r["rank"]))
    spread = (float(slowest["mean_s"]) - median) / median if median > 0 else 0.0
    return {"ranks": len(ranks), "steps": min(int(r.get("steps") or 0) for r in timed),
            "median_step_s": round(median, 4),
            "slowest": {"rank": slowest["rank"], "node": slowest.get("node"), "mean_s": round(slowest["mean_s"], 4)},
            "fastest": {"rank": fastest["rank"], "node": fastest.get("node"), "mean_s": round(fastest["mean_s"], 4)},
            "spread": round(spread, 4), "straggling": spread > threshold, "threshold": threshold}


def describe(summary: dict[str, Any]) -> str:
    """`status`'s words for a summary (forward compute per iteration)."""
    s, f = summary["slowest"], summary["fastest"]
    return (f"slowest rank {s['rank']} on {s['node']} {s['mean_s']:.3g} s forward/step, {summary['spread']:.0%} "
            f"above the median {summary['median_step_s']:.3g} s (fastest rank {f['rank']} on {f['node']} "
            f"{f['mean_s']:.3g} s; "
            f"{summary['ranks']} ranks, {summary['steps']} steps)")


def gather(timer: StepTimer, *, rank: int, node: str, threshold: float) -> dict[str, Any] | None:
    """A collective (every rank calls it at the same point): every rank's stats, summarised."""
    import torch.distributed as dist

    mine = {"rank": rank, "node": node, **timer.stats()}
    ranks: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    summary = summarize(ranks, threshold=threshold)
    if summary is not None and (scores := nvrx_scores()) is not None:
        summary["nvrx_scores"] = scores
    return summary


# --- nvidia-resiliency-ext, where installed ---------------------------------------------------------

_nvrx: Any = None


def nvrx_start() -> bool:
    """Initialise nvidia-resiliency-ext's Detector if the package is importable (every rank)."""
    global _nvrx
    try:  # 0.7 moved it under attribution/; megatron-core 0.19 refuses (at import) an nvrx older than 0.6
        from nvidia_resiliency_ext.attribution import straggler  # type: ignore[import-not-found]
    except ImportError:
        try:
            from nvidia_resiliency_ext import straggler  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return False
    try:
        straggler.Detector.initialize(scores_to_compute=["relative_perf_scores"], gather_on_rank0=True)
    except Exception:  # another version's API: our own measurement stands alone
        return False
    _nvrx = straggler
    return True


def nvrx_section() -> Any:
    """A context manager timing one forward step under the Detector (a no-op without it)."""
    import contextlib

    if _nvrx is None:
        return contextlib.nullcontext()
    return _nvrx.Detector.detection_section("forward")


def nvrx_scores() -> dict[str, Any] | None:
    """The Detector's per-rank relative scores (a collective inside nvrx), or None without it."""
    if _nvrx is None:
        return None
    try:
        report = _nvrx.Detector.generate_report()
    except Exception:
        return None
    if report is None:  # ranks other than 0 with gather_on_rank0
        return None
    scores = getattr(report, "section_relative_perf_scores", None) or {}
    # A section with no new timings since the last report scores NaN (seen at a segment's end right after
    # a save, nvrx 0.7): leave it out, so that the ledger stays valid JSON.
    out = {str(section): {str(r): round(float(v), 3) for r, v in per_rank.items() if math.isfinite(float(v))}
           for section, per_rank in scores.items()}
    out = {section: per_rank for section, per_rank in out.items() if per_rank}
    return out or None
