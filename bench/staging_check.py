"""Megatron's asynchronous save as the trainer makes it (persistent writer, cached plan, 8 writer
threads), with and without megalaunch's pinned staging (runtime/loop/save_staging.py), and the load
with and without the threaded read (runtime/loop/parallel_load.py), beside `dd` (issue #35).

One process, one GPU, the llama3-1b state of bench/save_profile.py (17.3 GB: bf16 weights, fp32 main
parameters, Adam's two moments). The writer is started as Megatron starts it (forkserver, at
initialisation); `--lead-s` seconds pass (the load and the first iterations) before the first save;
then `--saves` saves, each: the blocking part (state and plan, then the hand-off to the writer, which
returns once the state is staged in host memory) and the wait for its write to complete (what a
stop save adds). Then the last checkpoint is loaded, warm (page cache) and cold, with one reader
thread and with the threaded read, and compared with the state.

    python bench/staging_check.py --dir /tmp/stage --mode arena|megatron [--json out.json]

`--mode megatron`: Megatron's own staging (MEGALAUNCH_PINNED_STAGING=0). Prints one line per figure."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p not in ("", str(HERE))]
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.append(str(HERE))

from save_profile import _drop_cache, dd_bandwidth, make_state, sharded, state_bytes  # noqa: E402

GB = 1e9


def start_writer(nbytes: int, mode: str) -> tuple[Any, str]:
    """What Megatron's initialisation does with --async-save --use-persistent-ckpt-worker (and
    what megalaunch's trainer adds before it)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

    from megalaunch.runtime.loop import save_staging

    if mode == "megatron":
        os.environ[save_staging.STAGING_ENV] = "0"
    note = save_staging.install(nbytes, 1, 1)
    queue = AsyncCallsQueue(persistent=True)
    t0 = time.perf_counter()
    AsyncCallsQueue.warmup_persistent_caller(0, mp_mode="forkserver")
    get_write_results_queue(mp_mode="fork")
    return queue, f"staging {note}; writer started in {time.perf_counter() - t0:.2f} s"


def one_save(state: dict[str, Any], strategy: Any, queue: Any, directory: Path, first: bool,
             profile: bool = False) -> dict[str, float]:
    import torch
    from megatron.core import dist_checkpointing

    from megalaunch.runtime.loop import save_staging

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    torch.cuda.synchronize()
    sampler = None
    if profile:
        from stack_sampler import Sampler

        sampler = Sampler(name="trainer")
        sampler.start()
    t0 = time.perf_counter()
    request = dist_checkpointing.save(sharded(state), str(directory), strategy, async_sharded_save=True,
                                      async_strategy="mcore", validate_access_integrity=first)
    t1 = time.perf_counter()
    queue.schedule_async_request(save_staging.staged(request))
    t2 = time.perf_counter()
    if sampler is not None:
        sampler.stop()
        print(sampler.summary(), flush=True)
    queue.maybe_finalize_async_calls(blocking=True)
    t3 = time.perf_counter()
    on_disk = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return {"plan_s": t1 - t0, "staging_s": t2 - t1, "blocking_s": t2 - t0, "write_wait_s": t3 - t2,
            "total_s": t3 - t0, "bytes": on_disk, "total_gbps": on_disk / (t3 - t0) / GB}


def loads(state: dict[str, Any], directory: Path) -> dict[str, float]:
    """The checkpoint loaded into a template on the GPU: one reader thread, then the threaded read,
    each warm (page cache) and cold (dropped first); the loaded state compared with the saved one."""
    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import filesystem

    from megalaunch.runtime.loop import parallel_load

    template = {k: torch.empty_like(t) for k, t in state.items()}
    serial = filesystem.FileSystemReader.read_data
    out: dict[str, float] = {}

    def load(name: str, cold: bool) -> None:
        if cold:
            _drop_cache(directory)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loaded = dist_checkpointing.load(sharded(template), str(directory))
        torch.cuda.synchronize()
        out[name] = time.perf_counter() - t0
        for key in list(state)[:: max(1, len(state) // 8)]:
            assert torch.equal(loaded[key], state[key]), f"{name}: {key} differs"

    for name, cold in (("serial_warm_s", False), ("serial_cold_s", True)):
        load(name, cold)
    out["threads"] = parallel_load.install()  # type: ignore[assignment]
    for name, cold in (("threaded_warm_s", False), ("threaded_cold_s", True)):
        load(name, cold)
    filesystem.FileSystemReader.read_data = serial  # type: ignore[method-assign]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--mode", choices=("arena", "megatron"), default="arena")
    ap.add_argument("--params", type=float, default=1.2358e9)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=8, help="writer threads (checkpoint.writer_threads)")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--lead-s", type=float, default=15.0, help="from the writer's start to the first save")
    ap.add_argument("--dd", action="store_true", help="also dd: 1 and --threads streams, write and cold read")
    ap.add_argument("--no-load", action="store_true", help="skip the load comparison")
    ap.add_argument("--profile", action="store_true", help="sample the trainer's and the writer's stacks")
    ap.add_argument("--warmup", action="store_true", help="a one-tensor save before the first")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megalaunch.runtime.loop import save_staging

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    args.dir.mkdir(parents=True, exist_ok=True)
    state = make_state(args.params, args.layers, "cuda")
    nbytes = state_bytes(state)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "mode": args.mode, "state_bytes": nbytes}
    if args.dd:
        out["dd_1"] = dd_bandwidth(args.dir, nbytes / 2, 1)
        out["dd_n"] = dd_bandwidth(args.dir, nbytes / 2, args.threads)
        print(f"dd 1 stream: write {out['dd_1']['write_gbps']:.2f} GB/s, read {out['dd_1']['read_gbps']:.2f} GB/s; "
              f"{args.threads} streams: write {out['dd_n']['write_gbps']:.2f}, read {out['dd_n']['read_gbps']:.2f}",
              flush=True)
    if args.profile:  # the writer's main thread sampled (bench/stack_sampler.py)
        import stack_sampler
        from megalaunch.runtime.loop import save_staging

        save_staging.writer_main = stack_sampler.profiled_writer_main  # type: ignore[assignment]
    queue, out["writer"] = start_writer(nbytes, args.mode)
    print(f"{args.mode}: state {nbytes / GB:.2f} GB; {out['writer']}", flush=True)
    time.sleep(2.0)  # the load
    save_staging.release()
    time.sleep(args.lead_s)  # the first iterations
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    strategy.thread_count, strategy.use_cached_ckpt_structure = args.threads, True
    if args.warmup:  # a one-tensor save first: what of the first save's cost is once per process
        tiny = {"warmup": torch.zeros(1024, device="cuda")}
        tiny_strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
        r = one_save(tiny, tiny_strategy, queue, args.dir / "warmup", first=True, profile=args.profile)
        out["warmup"] = r
        print(f"{args.mode} warm-up save of one small tensor: blocking {r['blocking_s']:.2f} s (state and plan "
              f"{r['plan_s']:.2f}, staging {r['staging_s']:.2f}); complete after {r['total_s']:.2f} s", flush=True)
    out["saves"] = []
    for i in range(args.saves):
        r = one_save(state, strategy, queue, args.dir / "ckpt", first=i == 0, profile=args.profile and i == 0)
        out["saves"].append(r)
        print(f"{args.mode} save {i + 1}: blocking {r['blocking_s']:.2f} s (state and plan {r['plan_s']:.2f}, "
              f"staging {r['staging_s']:.2f}); write waited {r['write_wait_s']:.2f} s; start to complete "
              f"{r['total_s']:.2f} s = {r['total_gbps']:.2f} GB/s", flush=True)
    if not args.no_load:
        out["loads"] = loads(state, args.dir / "ckpt")
        print(f"{args.mode} load: {json.dumps(out['loads'])}", flush=True)
    queue.close()
    shutil.rmtree(args.dir / "ckpt", ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
