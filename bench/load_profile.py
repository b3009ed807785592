"""Where a resumed segment's checkpoint load goes (issue #25, start-up), one GPU.

The parent builds llama3-1b's training state on the GPU (bench/save_profile.py's layout: bf16 weights,
fp32 main parameters, Adam's two moments; 17.3 GB), saves it with megatron-core's torch_dist format
(8 writer threads, as the trainer does) and reads it once, so the files sit in the page cache. Then
each variant loads it in a fresh process (an allocator setting is read once per process), warm:

  default   megatron-core's dist_checkpointing.load, as the trainer calls it
  thp       the same with THP_MEM_ALLOC_ENABLE=1: torch's CPU allocator asks the kernel for huge
            pages (2 MB) for large host tensors, so staging a tensor faults 512x fewer pages
  profile   default under cProfile: where the seconds go (the top functions by own time)

    python bench/load_profile.py --dir /tmp/lp [--params 1.2358e9] [--layers 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
GB = 1e9
VARIANTS = {"default": {}, "thp": {"THP_MEM_ALLOC_ENABLE": "1"}, "profile": {}}


def _init() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)


def child(args: argparse.Namespace) -> int:
    import torch
    from megatron.core import dist_checkpointing

    from save_profile import make_state, sharded

    _init()
    template = make_state(args.params, args.layers, "cuda")
    prof = cProfile.Profile() if args.variant == "profile" else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    dist_checkpointing.load(sharded(template), str(args.dir / "ckpt"))
    torch.cuda.synchronize()
    if prof is not None:
        prof.disable()
    out: dict[str, Any] = {"variant": args.variant, "load_s": time.perf_counter() - t0}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        out["top"] = [line for line in text.getvalue().splitlines() if line.strip()][-16:]
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def parent(args: argparse.Namespace) -> int:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from save_profile import make_state, sharded, state_bytes

    _init()
    ckpt = args.dir / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    state = make_state(args.params, args.layers, "cuda")
    nbytes = state_bytes(state)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    strategy.thread_count = 8
    t0 = time.perf_counter()
    dist_checkpointing.save(sharded(state), str(ckpt), strategy)
    save_s = time.perf_counter() - t0
    del state
    torch.cuda.empty_cache()
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    t0 = time.perf_counter()
    for p in files:  # into the page cache, as the read-ahead leaves it
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    read_s = time.perf_counter() - t0
    on_disk = sum(p.stat().st_size for p in files)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "state_bytes": nbytes, "bytes": on_disk,
                           "save_s": save_s, "page_cache_read_s": read_s,
                           "thp": thp.read_text().strip() if thp.exists() else None, "loads": []}
    print(f"state {nbytes / GB:.2f} GB on {out['gpu']}; saved in {save_s:.1f} s; read into the page cache "
          f"{on_disk / GB / read_s:.2f} GB/s; transparent huge pages: {out['thp']}", flush=True)
    for variant in args.variants.split(","):
        env = {**os.environ, **VARIANTS[variant], "MASTER_PORT": str(29542 + len(out["loads"]))}
        proc = subprocess.run([sys.executable, __file__, "--child", "--variant", variant, "--dir", str(args.dir),
                               "--params", str(args.params), "--layers", str(args.layers)],
                              env=env, capture_output=True, text=True, timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{variant}: failed ({proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        out["loads"].append(r)
        print(f"{variant:8s}: load {r['load_s']:.1f} s = {on_disk / GB / r['load_s']:.2f} GB/s", flush=True)
        for line in r.get("top") or []:
            print(f"    {line[:150]}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--params", type=float, default=1.2358e9)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--variants", default="default,thp,profile")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
