"""Where a training step's GPU time goes, from a torch profiler trace (Megatron's `--use-pytorch-profiler`
writes RUN/torch_profile/rank-0.json.gz): the GPU's busy and idle time per step, the kernels by kind, and the
kernels that take the most time.

    python bench/trace_summary.py RUN/torch_profile/rank-0.json.gz --steps 2 [--json OUT.json]

Kinds come from the kernels' names (cuBLAS/CUTLASS GEMMs, cuDNN/flash attention, Triton kernels (Inductor's
or liger's), NCCL, torch's elementwise, reduction, copy and foreach kernels). Idle is the window in which no
kernel, copy or memset runs on any stream: the GPU waiting for the CPU (launch overhead, Python) or for the
host. Standard library only: it runs where the trace is."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

KINDS = [  # first match wins
    ("nccl", r"nccl"),
    ("attention", r"cudnn|fmha|flash|sdpa|_attention|attn"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|s\d+_?sm90|sm90_|sm80_|ampere_|Kernel2"),
    ("optimizer (foreach)", r"multi_tensor|foreach"),
    ("inductor (triton)", r"^triton_"),
    ("liger (triton)", r"_rms_norm|_rope|rope_|swiglu|_silu|liger|cross_entropy_kernel|element_mul_kernel"),
    ("copy / cat / transpose", r"copy|CatArray|cat_|transpose|Memcpy|memcpy|index|gather|scatter"),
    ("memset / fill", r"memset|Memset|fill|FillFunctor|zero"),
    ("reduction / norm / softmax", r"reduce|Reduce|norm|softmax|Softmax|welford|Welford"),
    ("elementwise (torch)", r"elementwise|vectorized|unrolled|Functor|pointwise"),
]


def kind(name: str) -> str:
    for label, pattern in KINDS:
        if re.search(pattern, name):
            return label
    return "other"


def gpu_events(trace: dict[str, Any]) -> list[tuple[float, float, str]]:
    return [(float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?")) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def busy_us(events: list[tuple[float, float, str]]) -> float:
    """The union of the events' intervals (streams overlap)."""
    total, end = 0.0, float("-inf")
    for ts, dur, _ in sorted(events):
        if ts + dur <= end:
            continue
        total += ts + dur - max(ts, end)
        end = ts + dur
    return total


def summarize(path: Path, steps: int, top: int = 25) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = gpu_events(json.load(f))
    if not events:
        raise SystemExit(f"{path}: no GPU events (was the profiler's CUDA activity on?)")
    start = min(ts for ts, _, _ in events)
    window = max(ts + dur for ts, dur, _ in events) - start
    busy = busy_us(events)
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for _, dur, name in events:
        by_kind[kind(name)] += dur
        by_name[name][0] += 1
        by_name[name][1] += dur
    per = 1000.0 * steps  # us -> ms per step
    return {
        "trace": str(path), "steps": steps, "window_ms_per_step": window / per, "busy_ms_per_step": busy / per,
        "idle_ms_per_step": (window - busy) / per, "kernel_sum_ms_per_step": sum(by_kind.values()) / per,
        "kinds": {k: v / per for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n, "kind": kind(n), "calls_per_step": c / steps, "ms_per_step": d / per}
                for n, (c, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def render(s: dict[str, Any]) -> str:
    w = s["window_ms_per_step"]
    lines = [f"{s['trace']}: {w:.1f} ms per step on the GPU's clock; busy {s['busy_ms_per_step']:.1f} ms, "
             f"idle {s['idle_ms_per_step']:.1f} ms ({100 * s['idle_ms_per_step'] / w:.1f} %)"]
    lines += [f"  {k:28s} {v:8.1f} ms  {100 * v / w:5.1f} %" for k, v in s["kinds"].items()]
    lines.append("  top kernels (ms per step, calls per step):")
    lines += [f"  {t['ms_per_step']:8.1f} ms {t['calls_per_step']:7.0f}x  {t['kind']:22s} {t['name'][:110]}"
              for t in s["top"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, required=True, help="training steps the trace holds")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    s = summarize(a.trace, a.steps, a.top)
    print(render(s))
    if a.json:
        a.json.write_text(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
