"""The health check at segment start (issue 12 item 3, docs/training.md "Health check").

Every rank runs it right after torch.distributed is up and before Megatron builds the model
(megatron_seams: after `_initialize_distributed`): a timed matrix-multiply loop (bf16 on a GPU, fp32
on the CPU), then an all-reduce across the job; every rank's figures (and its node) are all-gathered,
so every rank takes the same decision from the same numbers (`judge`, a pure function).

A rank is unhealthy when its check raised, or its matmul TFLOP/s is below the reference by more than
`margin` in each of ATTEMPTS measurements (its best counts: a moment of load passes, a slow device does not). The reference is the job's median, or the team's recorded figure for this device
(`Baselines`, in the node-health directory) when that is higher: a 1-node job has no faster peer, and
a whole node of slow GPUs drags its own median down. Only healthy checks are recorded as baselines.

An unhealthy rank ends the segment with outcome `unhealthy_node` naming the node(s) and figures:
every rank raises `UnhealthyNode` (the same decision everywhere, so nobody waits in a collective),
rank 0 writes the outcome, `job end` puts the nodes in the node-health ledger and the successor
excludes them. Bounded: each measurement stops at its time budget (~30 s for the whole check).

Test hooks (environment): MEGALAUNCH_TEST_SLOW_NODE=NODE[:FACTOR] makes the matmul loop on NODE
FACTOR (default 10) times slower (a sleep inside the timed region); MEGALAUNCH_TEST_HEALTH_FAIL=NODE
makes the check raise on NODE. NODE may also be `rankN` (one rank, for tests on one machine)."""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import append_team_jsonl, read_team_jsonl
from megalaunch.rundir.hostlist import compress_hostlist

SLOW_NODE_ENV = "MEGALAUNCH_TEST_SLOW_NODE"
FAIL_NODE_ENV = "MEGALAUNCH_TEST_HEALTH_FAIL"
BASELINE_FILE = "health_baselines.jsonl"
BASELINE_WINDOW = 10  # the reference is the median of the newest healthy checks of the device

# sizes and time budgets: (matmul n, matmul seconds, all-reduce bytes, all-reduce timed iterations)
GPU_SHAPE = (8192, 1.5, 256 * 2**20, 10)  # 2 x 8192^3 = 1.1 TFLOP per matmul: ~1.6 ms on an H100
CPU_SHAPE = (256, 0.3, 4 * 2**20, 5)
ATTEMPTS = 3  # measurements of a check that finds slow ranks (run_check)
MATMUL_BUDGET_S = 10.0
PROBE_S = 0.25  # on a GPU: the host-timed probe; the rest of the matmul seconds is queued at once
QUEUE_MAX = 768  # matmuls queued at once (CUDA's launch queue holds ~1,000 before a launch blocks)  # a very slow device stops after its first batch past this
ALLREDUCE_BUDGET_S = 10.0
RANKS_KEPT = 16  # a check of more ranks records only the ranks that tell something (RankFigures.kept)


class UnhealthyNode(Exception):
    """Raised on every rank when the check finds an unhealthy node: the segment ends `unhealthy_node`."""

    def __init__(self, verdict: HealthVerdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


@dataclass(frozen=True)
class RankFigures:
    rank: int
    node: str
    device: str  # what the matmul ran on (GPU name, or "cpu"), with dtype and size: the baseline's key
    tflops: float | None = None
    allreduce_gbps: float | None = None  # bus bandwidth (NCCL's busbw: 2(n-1)/n x bytes / time)
    seconds: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool
    reason: str
    unhealthy_nodes: list[str]
    median_tflops: float | None
    reference_tflops: float | None
    baseline_tflops: float | None
    figures: list[RankFigures]

    def summary(self) -> dict[str, Any]:
        """The figures as the ledger, the timeline and the outcome keep them."""
        tf = [f.tflops for f in self.figures if f.error is None and f.tflops is not None]
        return {"healthy": self.healthy, "unhealthy_nodes": self.unhealthy_nodes,
                "median_tflops": _round(self.median_tflops), "reference_tflops": _round(self.reference_tflops),
                "baseline_tflops": _round(self.baseline_tflops),
                "allreduce_gbps": _round(_median([f.allreduce_gbps for f in self.figures])),
                "seconds": _round(max((f.seconds for f in self.figures), default=0.0)),
                "rank_count": len(self.figures), "nodes": compress_hostlist(dict.fromkeys(f.node for f in self.figures)),
                "min_tflops": _round(min(tf, default=None)), "max_tflops": _round(max(tf, default=None)),
                "ranks": [{k: _round(v) if isinstance(v, float) else v for k, v in asdict(f).items()}
                          for f in telling(self.figures, self.unhealthy_nodes)]}


def telling(figures: list[RankFigures], unhealthy: list[str]) -> list[RankFigures]:
    """The ranks a record keeps: all of a small job's; of a large one (over RANKS_KEPT), every rank that
    failed or sits on an unhealthy node, the four slowest and the fastest. One record per check, a few
    kilobytes at 8,000 ranks (the ledger, the timeline and the outcome each keep it)."""
    if len(figures) <= RANKS_KEPT:
        return figures
    bad = set(unhealthy)
    keep = {f.rank for f in figures if f.error is not None or f.node in bad}
    timed = sorted((f for f in figures if f.error is None and f.tflops is not None), key=lambda f: (f.tflops, f.rank))
    keep |= {f.rank for f in timed[:4]} | {f.rank for f in timed[-1:]}
    return [f for f in figures if f.rank in keep]


def _round(v: float | None) -> float | None:
    return None if v is None else float(f"{v:.4g}")  # 4 significant digits: CPU figures are tiny


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(xs) if xs else None


def judge(figures: list[RankFigures], *, margin: float, baseline: float | None = None) -> HealthVerdict:
    """The decision every rank takes from everybody's figures (pure: the same input, the same answer)."""
    median = _median([f.tflops for f in figures if f.error is None])
    reference = max((x for x in (median, baseline) if x is not None), default=None)
    bad: dict[str, list[str]] = {}
    for f in sorted(figures, key=lambda f: f.rank):
        if f.error is not None:
            bad.setdefault(f.node, []).append(f"rank {f.rank} failed the check: {f.error}")
        elif f.tflops is None or (reference is not None and f.tflops < (1.0 - margin) * reference):
            got = "no figure" if f.tflops is None else f"{f.tflops:.3g} TFLOP/s"
            against = "the job's median" if reference == median else "the recorded figure for the device"
            bad.setdefault(f.node, []).append(
                f"rank {f.rank} {got}, more than {margin:.0%} below {against} {reference:.3g}")
    if not bad:
        return HealthVerdict(True, f"healthy: median {median:.3g} TFLOP/s" if median is not None else "healthy",
                             [], median, reference, baseline, figures)
    nodes = sorted(bad)
    reason = "; ".join(f"{n}: {', '.join(why)}" for n, why in sorted(bad.items()))
    return HealthVerdict(False, f"health check: {reason}", nodes, median, reference, baseline, figures)


# --- the team's recorded figures -------------------------------------------------------------------

class Baselines:
    """Healthy checks' median TFLOP/s per device, appended to NODE_HEALTH_DIR/health_baselines.jsonl."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.file = Path(directory) / BASELINE_FILE

    def reference(self, device: str) -> float | None:
        values = [float(rec["tflops"]) for rec in read_team_jsonl(self.file)
                  if isinstance(rec, dict) and rec.get("device") == device
                  and isinstance(rec.get("tflops"), (int, float))]
        return _median(values[-BASELINE_WINDOW:])  # type: ignore[arg-type]

    def record(self, device: str, tflops: float, *, run: str, job_id: str | None, nodes: list[str]) -> None:
        append_team_jsonl(self.file, {"device": device, "tflops": round(tflops, 4), "time": time.time(), "run": run,
                                      "job_id": job_id, "nodes": nodes})


# --- measuring --------------------------------------------------------------------------------------

def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _hooked(name: str, node: str, rank: int) -> bool:
    return bool(name) and name in (node, f"rank{rank}")


def _slow_factor(node: str, rank: int) -> float:
    """MEGALAUNCH_TEST_SLOW_NODE=NODE[:FACTOR],... (test hook; NODE may be `rankN` for one rank)."""
    for item in (os.environ.get(SLOW_NODE_ENV) or "").split(","):
        name, _, factor = item.strip().partition(":")
        if _hooked(name, node, rank):
            return float(factor or 10.0)
    return 1.0


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul(torch: Any, device: Any, *, n: int, seconds: float, slow_factor: float = 1.0,
                   while_busy: Callable[[], Any] = lambda: None) -> float:
    """TFLOP/s of n x n matmuls (bf16 on a GPU, fp32 on the CPU) over about `seconds`.

    On a GPU, a short probe (batches doubling, timed on the host) gives the device's pace, then the rest of
    the time is queued at once between two CUDA events and `while_busy` runs while the GPU works through
    it (start-up's module imports, runtime/observation/warm_imports.py): the figure is the GPU's own time,
    which a busy interpreter (the imports hold the GIL for tens of ms at a time) neither lowers nor
    lengthens. On the CPU, or with the slow-node test hook, the timed loop covers all of it and
    `while_busy` runs first."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):  # warm-up: kernels chosen, clocks up
        torch.matmul(a, b)
    _sync(torch, device)
    queued = device.type == "cuda" and slow_factor <= 1
    if not queued:
        while_busy()
    probe = min(seconds, PROBE_S) if queued else seconds
    batch, done = 1, 0
    t0 = time.perf_counter()
    while True:
        b0 = time.perf_counter()
        for _ in range(batch):
            torch.matmul(a, b)
        _sync(torch, device)
        if slow_factor > 1:  # test hook: this node's device is `slow_factor` times slower
            time.sleep((time.perf_counter() - b0) * (slow_factor - 1))
        done += batch
        elapsed = time.perf_counter() - t0
        if elapsed >= probe or elapsed >= MATMUL_BUDGET_S:
            break
        batch = min(batch * 2, 64)
    probed = 2.0 * n**3 * done / elapsed / 1e12
    count = min(QUEUE_MAX, int((seconds - elapsed) / (elapsed / done))) if queued else 0
    if count < 8:  # the probe took the time (a slow device), or the CPU
        if queued:
            while_busy()
        return probed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        torch.matmul(a, b)
    end.record()
    while_busy()
    end.synchronize()
    return 2.0 * n**3 * count / (start.elapsed_time(end) / 1e3) / 1e12


def measure_allreduce(torch: Any, dist: Any, device: Any, *, nbytes: int, iterations: int) -> float | None:
    """All-reduce bus bandwidth in GB/s (None with one rank: nothing to measure)."""
    world = dist.get_world_size()
    if world < 2:
        return None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.ones(nbytes // (2 if device.type == "cuda" else 4), device=device, dtype=dtype)
    dist.all_reduce(x)  # warm-up: communicators created
    _sync(torch, device)
    # every rank runs the same number of iterations (a collective each): the budget is agreed on first
    t0 = time.perf_counter()
    dist.all_reduce(x)
    _sync(torch, device)
    one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    n = max(1, min(iterations, int(ALLREDUCE_BUDGET_S / max(float(one.item()), 1e-6))))
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    _sync(torch, device)
    elapsed = time.perf_counter() - t0
    return 2.0 * (world - 1) / world * nbytes * n / elapsed / 1e9


def device_key(torch: Any, device: Any, n: int) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} bf16 n={n}"
    return f"cpu fp32 n={n} threads={torch.get_num_threads()}"


def run_check(*, rank: int, margin: float, baselines: Baselines | None = None,
              while_busy: Callable[[], Any] = lambda: None) -> HealthVerdict:
    """Measure this rank, gather every rank's figures, judge. A collective: every rank calls it.
    A verdict of slow ranks (not of failed ones) is measured again, every rank together, up to
    ATTEMPTS times, each rank keeping its best figure: a device that is slow stays slow, while a
    moment of load from another process on the node (a CPU shared by several jobs) passes."""
    import torch
    import torch.distributed as dist

    from megalaunch.runtime.rank.collectives import collective_device

    device = collective_device() if dist.is_initialized() else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    n, seconds, nbytes, iterations = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    node = node_name()
    started = time.perf_counter()
    key, tflops, gbps, error = "?", None, None, None
    baseline: float | None = None
    for attempt in range(ATTEMPTS):
        try:
            key = device_key(torch, device, n)
            if _hooked(os.environ.get(FAIL_NODE_ENV) or "", node, rank):
                raise RuntimeError(f"test hook {FAIL_NODE_ENV}={os.environ[FAIL_NODE_ENV]}")
            got = measure_matmul(torch, device, n=n, seconds=seconds, slow_factor=_slow_factor(node, rank),
                                 while_busy=while_busy)
            tflops = got if tflops is None else max(tflops, got)
        except Exception as e:  # this rank fails the check; it still takes part in the collectives below
            error = f"{type(e).__name__}: {e}"[:300]
        if attempt == 0:
            # a device whose name cannot be read fails the check above ("?"), not the segment here
            baseline = baselines.reference(key) if baselines is not None and rank == 0 else None
            if dist.is_initialized():
                gbps = measure_allreduce(torch, dist, device, nbytes=nbytes, iterations=iterations)
        mine = RankFigures(rank=rank, node=node, device=key, tflops=tflops, allreduce_gbps=gbps,
                           seconds=time.perf_counter() - started, error=error)
        gathered: list[Any] = [(asdict(mine), baseline)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (asdict(mine), baseline))
        figures = [RankFigures(**f) for f, _ in gathered]
        verdict = judge(figures, margin=margin, baseline=gathered[0][1])  # rank 0's reading of the baselines
        if verdict.healthy or any(f.error is not None for f in figures):
            break
    return verdict
