"""The health check (runtime/health/health.py) standalone on N local GPUs: per-rank matmul TFLOP/s (bf16,
8192^3), all-reduce bus bandwidth (256 MiB bf16, NCCL) and the check's cost in seconds, as the
trainer runs it at segment start. No torchrun: ranks are spawned with torch.multiprocessing.

    PYTHONPATH=src python bench/health_check.py --gpus 2 [--slow-rank 1] [--json out.json]

--slow-rank R makes rank R 10x slower (the test hook), to show the verdict it gives."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _rank(rank: int, world: int, port: int, slow: int | None, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from megalaunch.runtime.health.health import run_check

    if slow is not None:
        os.environ["MEGALAUNCH_TEST_SLOW_NODE"] = f"rank{slow}:10"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    t0 = time.perf_counter()
    verdict = run_check(rank=rank, margin=0.2)
    total = time.perf_counter() - t0
    if rank == 0:
        out.put({"total_s": total, **verdict.summary(), "reason": verdict.reason})
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    from megalaunch.runtime.rank.dist_env import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, a.gpus, port, a.slow_rank, q)) for r in range(a.gpus)]
    for proc in procs:
        proc.start()
    result = q.get(timeout=300)
    for proc in procs:
        proc.join(60)
    print(f"device: {result['ranks'][0]['device']}   ranks: {a.gpus}")
    for r in result["ranks"]:
        print(f"  rank {r['rank']} {r['node']}: matmul {r['tflops']} TFLOP/s, all-reduce {r['allreduce_gbps']} GB/s "
              f"(bus), {r['seconds']:.2f} s" + (f", error {r['error']}" if r["error"] else ""))
    print(f"verdict: {result['reason']}")
    print(f"health check cost: {result['total_s']:.2f} s (slowest rank's measurement {result['seconds']} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
