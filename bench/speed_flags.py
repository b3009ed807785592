"""Which training flags make megalaunch's Megatron runs faster without transformer-engine, measured.

    PYTHONPATH=src python bench/speed_flags.py --stage flags      # 1-GPU cases side by side, one per GPU
    PYTHONPATH=src python bench/speed_flags.py --stage full       # llama3-8b on 4 GPUs: before and after

`flags`: llama3-8b's width with 8 of its 32 layers on one GPU each (micro-batch 1, seq 8192), up to as
many at once as there are GPUs, cumulatively: the local layers as before (`training.fused_kernels=false`),
+ the torch.compile'd fusions (`fused_kernels=true`: SwiGLU, bias-dropout-add, cross entropy),
+ Megatron's manual garbage collection. (The cuDNN-first rows of docs/results.md measured a KV-head
expansion that was then dropped; torch's own order already runs cuDNN's attention: sdpa_backends.py.)
`full`: the whole llama3-8b, TP 1 x DP 4, micro-batch 1, global batch 32 (`--gbs`), before and with
`--best` (the flags to apply). Prints tokens/s and Megatron's TFLOP/s per GPU (MFU against the dense
bf16 peak, `--peak`), and max allocated memory; writes OUT/speed_flags/speed_flags.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_calib as calib  # bench/: it puts src/ on the path and takes bench/ off again

ONE_GPU = ["model.num_layers=8", "training.micro_batch_size=1", "training.global_batch_size=4",
           "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]
GC = ["megatron_args.manual-gc=true", "megatron_args.manual-gc-interval=50"]
FLAG_CASES: dict[str, tuple[object, ...]] = {
    "unfused": ("train/llama3-8b", 1, [*ONE_GPU, "training.fused_kernels=false"]),
    "fused": ("train/llama3-8b", 1, [*ONE_GPU, "training.fused_kernels=true"]),
    "fused-gc": ("train/llama3-8b", 1, [*ONE_GPU, "training.fused_kernels=true", *GC]),
}
BEST = {"fused": ["training.fused_kernels=true"], "gc": GC}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("flags", "full"), default="flags")
    parser.add_argument("--gbs", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--best", default="fused", help="for --stage full: of fused, gc")
    parser.add_argument("--after-only", action="store_true", help="for --stage full: only the run with --best")
    parser.add_argument("--layout", action="append", default=[], help="more --set lines for --stage full")
    parser.add_argument("--cases", default="unfused,fused,fused-gc", help="for --stage flags")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (H100/H200 SXM)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "speed_flags")
    a = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("needs CUDA GPUs", file=sys.stderr)
        return 2
    if a.stage == "flags":
        cases = {k: v for k, v in FLAG_CASES.items() if not a.cases or k in a.cases.split(",")}
        tokens = 4 * 8192
    else:
        full = ["training.micro_batch_size=1", f"training.global_batch_size={a.gbs}",
                "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false", *a.layout]
        best = [s for name in a.best.split(",") if name for s in BEST[name]]
        cases = {"8b-before": ("train/llama3-8b", a.gpus, [*full, "training.fused_kernels=false"]),
                 "8b-after": ("train/llama3-8b", a.gpus, [*full, *best])}
        if a.after_only:
            del cases["8b-before"]
        tokens = a.gbs * 8192
    a.out.mkdir(parents=True, exist_ok=True)
    rows = calib.run_cases(list(cases), a.out, a.iters, torch.cuda.device_count(), 420, cases=cases)
    device = torch.cuda.get_device_name()
    print(f"\n== {a.stage} on {device} (torch {torch.__version__}) ==")
    print(f"{'case':16s} {'GPUs':>4} {'s/iter':>7} {'tokens/s/GPU':>12} {'TFLOP/s':>8} {'MFU':>6} {'max GiB':>8}")
    for r in rows:
        if "ms_per_iteration" not in r:
            print(f"{r['case']:16s} {r['gpus']:>4}  {r['error']}")
            continue
        r["tokens_per_s_per_gpu"] = tokens / (r["ms_per_iteration"] / 1000) / r["gpus"]
        r["mfu"] = r["tflops_per_gpu"] / a.peak
        print(f"{r['case']:16s} {r['gpus']:>4} {r['ms_per_iteration'] / 1000:>7.2f} {r['tokens_per_s_per_gpu']:>12,.0f} "
              f"{r['tflops_per_gpu']:>8.1f} {100 * r['mfu']:>5.1f}% {r['max_allocated_gib']:>8.1f}")
    (a.out / f"speed_flags_{a.stage}.json").write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
