"""Where a checkpoint save's time goes, beside the disk's own bandwidth (issue #23, item 7).

One process, one GPU. The state of a model of `--params` parameters in Megatron's layout (bf16
weights, fp32 main parameters, Adam's two fp32 moments: 14 bytes a parameter; llama3-1b by default,
17.3 GB) sits on the GPU as `--layers` x 4 tensors per family. Then, on `--dir`:

  dd         the disk: one fsync'd dd stream, and `max(--threads)` streams at once, write and read
             (the read after dropping the file from the page cache, so it comes from the disk)
  d2h        copying the state to host memory, pageable and pinned (what every save does first)
  serialize  torch.save of the host copy into memory (the CPU cost of torch_dist's framing)
  save tN    megatron-core's dist_checkpointing.save (torch_dist, what Megatron's save calls) with N
             writer threads: total, and the phases from its own debug log; then a load of it
  async tN   the same as an async request: the part that blocks training (planning + D2H staging)
             and the part that runs beside it
  load       a resumed segment's load: cold, warm, and cold with runtime/checkpoint/readahead.py started
             `--readahead-overlap-s` before it (the imports and model build it overlaps)

    python bench/save_profile.py --dir /tmp/prof [--params 1.24e9] [--threads 1,2,4,8] [--json out.json]

Prints one table; `--json` keeps the figures.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GB = 1e9


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _drop_cache(root: Path) -> None:
    """Evict the files under root from the page cache, so the next read comes from the disk."""
    for path in [root] if root.is_file() else root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dd_write(path: Path, count_16m: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count_16m}", "conv=fsync"],
                   check=True, capture_output=True)
    return time.perf_counter() - t0


def dd_bandwidth(directory: Path, nbytes: float, streams: int) -> dict[str, float]:
    """GB/s of `streams` fsync'd dd writers at once (nbytes in all), then of reading it back cold."""
    count = max(1, int(nbytes / streams / (16 << 20)))
    paths = [directory / f"dd{i}.bin" for i in range(streams)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={p}", "bs=16M", f"count={count}", "conv=fsync"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in paths]
    for p in procs:
        p.wait()
    write_s = time.perf_counter() - t0
    total = sum(p.stat().st_size for p in paths)
    for p in paths:
        _drop_cache(p)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=16M"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in paths]
    for p in procs:
        p.wait()
    read_s = time.perf_counter() - t0
    for p in paths:
        p.unlink()
    return {"write_gbps": total / write_s / GB, "read_gbps": total / read_s / GB, "bytes": total}


def make_state(params: float, layers: int, device: str) -> dict[str, Any]:
    """Megatron's four families, `layers` tensors each, on the device (values random: no compression)."""
    import torch

    per = int(params // layers)
    state: dict[str, Any] = {}
    for i in range(layers):
        state[f"model.layer{i}.weight"] = torch.randn(per, dtype=torch.bfloat16, device=device)
        for family in ("main_param", "exp_avg", "exp_avg_sq"):
            state[f"optimizer.{family}.layer{i}"] = torch.randn(per, dtype=torch.float32, device=device)
    return state


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sharded(state: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in state.items()}


class PhaseLog(logging.Handler):
    """megatron-core's dist_checkpointing logs its phases at DEBUG with their times: keep them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "time" in msg:
            self.lines.append(msg)


def time_d2h(state: dict[str, Any], pinned: bool) -> float:
    import torch

    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for k, t in state.items()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k, t in state.items():
        host[k].copy_(t, non_blocking=pinned)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_serialize(state: dict[str, Any]) -> float:
    import torch

    host = {k: t.cpu() for k, t in list(state.items())[:4]}  # one layer: enough to rate the CPU cost
    nbytes = state_bytes(host)
    t0 = time.perf_counter()
    buf = io.BytesIO()
    for k, t in host.items():
        torch.save({k: t}, buf)
    elapsed = time.perf_counter() - t0
    return nbytes / elapsed / GB


def profile_save(state: dict[str, Any], directory: Path, threads: int, handler: PhaseLog) -> dict[str, Any]:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    ckpt = directory / f"ckpt-t{threads}"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    strategy.thread_count = threads
    handler.lines.clear()
    _sync()
    t0 = time.perf_counter()
    dist_checkpointing.save(sharded(state), str(ckpt), strategy)
    save_s = time.perf_counter() - t0
    phases = list(handler.lines)
    on_disk = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    _drop_cache(ckpt)
    template = {k: torch.empty_like(t) for k, t in state.items()}
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load(sharded(template), str(ckpt))
    _sync()
    load_s = time.perf_counter() - t0
    key = next(iter(state))
    assert torch.equal(loaded[key].to(state[key].device), state[key]), "the loaded state differs"
    del loaded, template
    shutil.rmtree(ckpt)
    return {"threads": threads, "save_s": save_s, "load_s": load_s, "bytes": on_disk,
            "save_gbps": on_disk / save_s / GB, "load_gbps": on_disk / load_s / GB, "phases": phases}


def profile_readahead(state: dict[str, Any], directory: Path, threads: int, overlap_s: float) -> dict[str, Any]:
    """A resumed segment's load, cold (the checkpoint not in the page cache: the successor on another
    node, or hours later), warm (just written), and cold with megalaunch's read-ahead started
    `overlap_s` before the load (what the imports, the health check and the model build take)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megalaunch.runtime.checkpoint import readahead

    ckpt = directory / "iter_0000100"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    strategy.thread_count = threads
    dist_checkpointing.save(sharded(state), str(ckpt), strategy)
    template = {k: torch.empty_like(t) for k, t in state.items()}

    def load() -> float:
        t0 = time.perf_counter()
        dist_checkpointing.load(sharded(template), str(ckpt))
        _sync()
        return time.perf_counter() - t0

    out: dict[str, Any] = {"overlap_s": overlap_s}
    _drop_cache(ckpt)
    out["cold_s"] = load()
    out["warm_s"] = load()
    _drop_cache(ckpt)
    reader, why = readahead.start(ckpt, local_rank=0, nodes=1)
    time.sleep(overlap_s)
    out["ahead_s"] = load()
    out["ahead"] = reader.figures() if reader is not None else {"why": why}
    shutil.rmtree(ckpt)
    return out


def profile_async(state: dict[str, Any], directory: Path, threads: int) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    ckpt = directory / f"async-t{threads}"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    strategy.thread_count = threads
    _sync()
    t0 = time.perf_counter()
    request = dist_checkpointing.save(sharded(state), str(ckpt), strategy, async_sharded_save=True,
                                      async_strategy="mcore")
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    staged = request.preload_fn() if request.preload_fn is not None else None
    _sync()
    stage_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    args = list(request.async_fn_args)
    if staged is not None:
        args[1] = staged
    request.async_fn(*args, **request.async_fn_kwargs)
    for fn in request.finalize_fns:
        fn()
    write_s = time.perf_counter() - t0
    on_disk = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    shutil.rmtree(ckpt)
    return {"threads": threads, "blocking_s": plan_s + stage_s, "plan_s": plan_s, "stage_s": stage_s,
            "background_s": write_s, "bytes": on_disk, "background_gbps": on_disk / write_s / GB}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--params", type=float, default=1.2358e9, help="llama3-1b: 1.2358e9")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--readahead-overlap-s", type=float, default=10.0,
                    help="the load with runtime/checkpoint/readahead.py started this long before it (0: skip)")
    ap.add_argument("--skip-saves", action="store_true", help="only dd, D2H and the read-ahead probe")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    handler = PhaseLog()
    mlog = logging.getLogger("megatron.core.dist_checkpointing")
    mlog.setLevel(logging.DEBUG)
    mlog.addHandler(handler)

    args.dir.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    if not torch.cuda.is_available():
        print("save_profile: needs a CUDA GPU (megatron-core's torch_dist save stages tensors through CUDA)",
              file=sys.stderr)
        return 2
    device = "cuda"
    gpu = torch.cuda.get_device_name()
    state = make_state(args.params, args.layers, device)
    nbytes = state_bytes(state)
    out: dict[str, Any] = {"gpu": gpu, "dir": str(args.dir), "state_bytes": nbytes}
    print(f"state: {nbytes / GB:.2f} GB on {gpu}; directory {args.dir}", flush=True)

    out["dd_1"] = dd_bandwidth(args.dir, nbytes / 2, 1)
    out["dd_n"] = dd_bandwidth(args.dir, nbytes / 2, max(threads))
    print(f"dd  1 stream : write {out['dd_1']['write_gbps']:.2f} GB/s, read {out['dd_1']['read_gbps']:.2f} GB/s",
          flush=True)
    print(f"dd {max(threads)} streams: write {out['dd_n']['write_gbps']:.2f} GB/s, "
          f"read {out['dd_n']['read_gbps']:.2f} GB/s", flush=True)
    out["d2h_pageable_gbps"] = nbytes / time_d2h(state, False) / GB
    out["d2h_pinned_gbps"] = nbytes / time_d2h(state, True) / GB
    print(f"d2h: pageable {out['d2h_pageable_gbps']:.1f} GB/s, pinned {out['d2h_pinned_gbps']:.1f} GB/s",
          flush=True)
    out["serialize_gbps"] = time_serialize(state)
    print(f"torch.save into memory: {out['serialize_gbps']:.1f} GB/s", flush=True)

    out["saves"] = []
    for t in [] if args.skip_saves else threads:
        r = profile_save(state, args.dir, t, handler)
        out["saves"].append(r)
        print(f"save t{t}: {r['save_s']:.1f} s = {r['save_gbps']:.2f} GB/s "
              f"({r['save_gbps'] / out['dd_1']['write_gbps']:.0%} of dd 1 stream); load {r['load_s']:.1f} s = "
              f"{r['load_gbps']:.2f} GB/s ({r['load_gbps'] / out['dd_1']['read_gbps']:.0%} of dd read)", flush=True)
        for line in r["phases"][-6:]:
            print(f"    {line[:160]}")
    out["async"] = []
    for t in [] if args.skip_saves else threads[-2:]:  # the two largest: what async saves would use
        r = profile_async(state, args.dir, t)
        out["async"].append(r)
        print(f"async t{t}: blocks {r['blocking_s']:.1f} s (plan {r['plan_s']:.1f}, D2H staging {r['stage_s']:.1f}); "
              f"writes {r['background_s']:.1f} s beside training = {r['background_gbps']:.2f} GB/s", flush=True)
    if args.readahead_overlap_s > 0:
        r = profile_readahead(state, args.dir, threads[-1], args.readahead_overlap_s)
        out["readahead"] = r
        print(f"load: cold {r['cold_s']:.1f} s, warm (page cache) {r['warm_s']:.1f} s, cold with the read-ahead "
              f"started {r['overlap_s']:g} s before {r['ahead_s']:.1f} s; read-ahead {r['ahead']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
