"""What is allocated at a training run's memory peak, and where it was allocated: one rank of
`python -m megalaunch.runtime.train RUN` with torch's allocator history recorded, and after its
MEMTRACE_STEPS-th optimizer step (default 3: the peak of a step with the optimizer's state in place) a
report written to MEMTRACE_OUT: the peak rebuilt from the history (it equals torch.cuda.max_memory_allocated
when the history holds the whole run), then the blocks alive at that moment, by size and by the code that
allocated them (Python frames in megatron, megalaunch and liger_kernel).

    bench/memory_calib.py --trace ...   # runs every case through this file

Memory on the GPU is unchanged by the recording (it is kept on the host); the steps run slower."""

from __future__ import annotations

import collections
import os
import runpy
import sys
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if p not in ("", str(Path(__file__).resolve().parent))]
MIB = 2**20
KEEP = ("megatron/", "megalaunch/", "liger_kernel/")


def site(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """The innermost `depth` frames in megatron, megalaunch or liger_kernel code, innermost first."""
    if frames and "runpy" in frames[0].get("filename", ""):  # outermost first: turn it round
        frames = frames[::-1]
    picked = [f for f in frames if any(k in f.get("filename", "") for k in KEEP)][:depth]
    if not picked:
        picked = frames[:1]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in picked) or "?"


def peak_report(snap: dict[str, Any], device: int, allocated_now: int, max_allocated: int, top: int = 30) -> str:
    # A free counts when it is asked for (the allocator's allocated bytes drop then; "free_completed" may come
    # later, for a block merged with its neighbours, under another address and size).
    trace = [e for e in snap["device_traces"][device] if e["action"] in ("alloc", "free_requested")]
    cur = peak = peak_at = 0
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            cur += e["size"]
        else:
            cur -= sizes.pop(e["addr"], 0)
        if cur > peak:
            peak, peak_at = cur, i
    base = allocated_now - cur  # blocks allocated before the history began (0 when it holds the whole run)
    live: dict[int, dict[str, Any]] = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    lines = [f"max_memory_allocated {max_allocated / MIB:.0f} MiB; peak rebuilt from the history "
             f"{(peak + base) / MIB:.0f} MiB (of which before the history {base / MIB:.0f}); "
             f"{len(live)} blocks alive at the peak; events {len(trace)}",
             f"the allocation at the peak: {trace[peak_at]['size'] / MIB:.1f} MiB at {site(trace[peak_at].get('frames', []), 6)}"]
    by_size: collections.Counter[int] = collections.Counter(e["size"] for e in live.values())
    lines.append("alive at the peak, by block size (MiB x count = MiB):")
    lines += [f"  {s / MIB:10.2f} x {n:4d} = {s * n / MIB:9.0f}"
              for s, n in sorted(by_size.items(), key=lambda kv: -kv[0] * kv[1])[:top]]
    by_site: dict[str, list[int]] = collections.defaultdict(list)
    for e in live.values():
        by_site[site(e.get("frames", []))].append(e["size"])
    lines.append("alive at the peak, by where it was allocated (MiB, count, sizes):")
    for where, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]:
        common = ", ".join(f"{s / MIB:.0f}x{n}" for s, n in collections.Counter(sizes).most_common(4))
        lines.append(f"  {sum(sizes) / MIB:9.0f} MiB {len(sizes):5d}  [{common}]  {where}")
    return "\n".join(lines) + "\n"


def main() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out = Path(os.environ["MEMTRACE_OUT"])
    steps = int(os.environ.get("MEMTRACE_STEPS", "3"))
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    seen = [0]

    def after_step(*_: Any) -> None:
        seen[0] += 1
        if seen[0] != steps:
            return
        try:  # the run goes on whatever happens here: its max allocated is measured from its log
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            device = torch.cuda.current_device()
            out.write_text(peak_report(snap, device, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
        except Exception as e:
            out.write_text(f"no report: {type(e).__name__}: {e}\n")

    register_optimizer_step_post_hook(after_step)
    sys.argv = ["megalaunch.runtime.train", *sys.argv[1:]]
    runpy.run_module("megalaunch.runtime.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
