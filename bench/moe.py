"""Mixture-of-experts training on one GPU: Megatron's SequentialMLP beside megalaunch's grouped-GEMM experts
(runtime/model/experts/), in one call, the same model, seed and batches.

    PYTHONPATH=src python bench/moe.py                  # moe-3b (64 experts of 768, top-8) and a Mixtral-like layer
    PYTHONPATH=src python bench/moe.py --models moe3b --iters 8
    python bench/moe.py --dry-run --out DIR             # prepare the run directories only (no GPU needed)

Each case is a real megalaunch run (bench/memory_calib.py: `python -m megalaunch.runtime.train RUN` with the local
backend's environment, mock data, sdpa attention, `training.kernels: auto`, bf16), with MEGALAUNCH_MOE_EXPERTS
choosing the experts (runtime/model/kernels.py); the ledger's `kernels` record says which ran. Models:
`moe3b`   the recipe train/moe-3b as shipped (8 layers, hidden 2048, 64 experts of ffn 768, top-8, QK-norm), seq 4096;
`mixtral` train/mixtral-8x7b's layer (hidden 4096, 8 experts of ffn 14336, top-2) with 2 of its 32 layers, seq 4096.
Figures per GPU: seconds per iteration (mean after the first two), tokens/s, TFLOP/s as Megatron logs it
(`--log-throughput`: megatron.training.training.num_floating_point_operations, which counts MoE layers by their
active parameters, top-k x the experts' ffn, plus attention and the output layer), MFU against the dense bf16
peak (`--peak`, 989 TFLOP/s for H100/H200 SXM). Losses: every iteration's (MEGALAUNCH_LOSS_LOG); the first is on
the same batch from the same weights, and must agree within bf16's tolerance (LOSS_RTOL).
Writes OUT/moe.json; exits 1 where a case gave no figures or the first losses disagree.
Measured on one H200 (torch 2.11, 6 iterations of 8 x 4096 tokens, two calls): moe3b 4.67-5.23 -> 0.92 s/iter
(x5.1-5.7; 29-32 -> 163 TFLOP/s, MFU 2.9-3.3 -> 16.5 %), mixtral 1.22-1.26 -> 0.60 s/iter (x2.0-2.1; 161-165 -> 310-312
TFLOP/s, MFU 16.3-16.7 -> 31.3-31.6 %); first losses equal to 1e-5; 216 s for `gpu_session.sh setup moe`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_calib as calib

EXPERTS = ("sequential", "grouped")
ONE_GPU = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
           "parallel.expert_model_parallel_size=1", "parallel.sequence_parallel=false",
           "parallel.use_distributed_optimizer=true", "training.kernels=auto", "training.recompute=none"]
MODELS: dict[str, tuple[str, list[str]]] = {
    "moe3b": ("train/moe-3b", []),
    "mixtral": ("train/mixtral-8x7b", ["model.num_layers=2"]),
}
LOSS_RTOL = 0.02  # bf16: the first iteration's loss (same weights, same batch) within 2 % between the two classes


def defs(a: argparse.Namespace, out: Path) -> dict[str, tuple[Any, ...]]:
    cases = {}
    for model in a.models:
        recipe, sets = MODELS[model]
        for experts in EXPERTS:
            name = f"{model}-{experts}"
            all_sets = [f"model.seq_length={a.seq}", f"training.micro_batch_size={a.mb}",
                        f"training.global_batch_size={a.gbs}", "cluster.nodes=1", *ONE_GPU, *sets, *a.sets]
            env = {"MEGALAUNCH_MOE_EXPERTS": experts, "MEGALAUNCH_LOSS_LOG": str(out / f"loss-{name}.jsonl")}
            cases[name] = (recipe, 1, all_sets, env)
    return cases


def _losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["iteration"]): float(r["loss"]) for r in recs}


def _experts_ran(out: Path, name: str) -> str:
    """What the run's ledger says the MoE layers' experts were (runtime/model/kernels.py)."""
    for ledger in (out / "runs").glob(f"*{calib.run_name(name)}*/state/ledger.jsonl"):
        for line in ledger.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "kernels" or rec.get("kind") == "kernels":
                return str(rec.get("experts_why") or rec.get("experts") or "")
    return "?"


def report(a: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["case"]: r for r in rows}
    for r in rows:
        r["losses"] = _losses(a.out / f"loss-{r['case']}.jsonl")
        r["experts_ran"] = _experts_ran(a.out, r["case"])
        if "ms_per_iteration" in r:
            r["tokens_per_s"] = a.gbs * a.seq / (r["ms_per_iteration"] / 1000)
            r["mfu"] = r["tflops_per_gpu"] / a.peak
            print(f"  {r['case']:18s} {r['ms_per_iteration'] / 1000:7.3f} s/iter {r['tokens_per_s']:>9,.0f} tokens/s "
                  f"{r['tflops_per_gpu']:6.1f} TFLOP/s  MFU {100 * r['mfu']:5.1f} %  max {r['max_allocated_gib']:5.1f} GiB"
                  f"  [{r['experts_ran']}]", flush=True)
        else:
            print(f"  {r['case']:18s} {r['error']}  [{r['experts_ran']}]", flush=True)
    summary: dict[str, Any] = {}
    for model in a.models:
        seq, grp = by.get(f"{model}-sequential", {}), by.get(f"{model}-grouped", {})
        s: dict[str, Any] = {}
        if "ms_per_iteration" in seq and "ms_per_iteration" in grp:
            s["speedup"] = seq["ms_per_iteration"] / grp["ms_per_iteration"]
        ls, lg = seq.get("losses", {}), grp.get("losses", {})
        common = sorted(set(ls) & set(lg))
        if common:
            s["loss_rel"] = {i: (lg[i] - ls[i]) / ls[i] for i in common}
            s["first_within"] = abs(s["loss_rel"][common[0]]) <= LOSS_RTOL
        summary[model] = s
        speed = f"grouped x{s['speedup']:.2f} the sequential step" if "speedup" in s else "no speed-up measured"
        loss = (f"first loss {ls[common[0]]:.4f} vs {lg[common[0]]:.4f} ({100 * s['loss_rel'][common[0]]:+.2f} %, "
                f"{'within' if s['first_within'] else 'OUTSIDE'} {100 * LOSS_RTOL:g} %), last "
                f"{100 * s['loss_rel'][common[-1]]:+.2f} %") if common else "no common losses"
        print(f"  {model}: {speed}; {loss}", flush=True)
    return {"rows": rows, "summary": summary, "loss_rtol": LOSS_RTOL}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda v: [m for m in v.split(",") if m], default=list(MODELS))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--mb", type=int, default=1)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per case, start-up included")
    parser.add_argument("--sets", type=lambda v: [x for x in v.split(",") if x], default=[],
                        help="overrides for every case, comma-separated")
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (H100/H200 SXM)")
    parser.add_argument("--dry-run", action="store_true", help="prepare the run directories, run nothing")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "moe")
    a = parser.parse_args()
    unknown = set(a.models) - set(MODELS)
    if unknown:
        parser.error(f"--models: {', '.join(sorted(unknown))} not in {', '.join(MODELS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    cases = defs(a, a.out)
    if a.dry_run:
        for name, (recipe, gpus, sets, env) in cases.items():
            run, est = calib.prepare(a.out / "runs", recipe, gpus, sets, name)
            print(f"  {name}: {run} (memory estimate {est.total / 2**30:.1f} GiB) {env['MEGALAUNCH_MOE_EXPERTS']}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (--dry-run prepares the runs without one)", file=sys.stderr)
        return 2
    for name in cases:
        (a.out / f"loss-{name}.jsonl").unlink(missing_ok=True)
    device = torch.cuda.get_device_name()
    print(f"== moe on {device} (torch {torch.__version__}): {', '.join(cases)}; seq {a.seq}, global batch {a.gbs}, "
          f"{a.iters} iterations", flush=True)
    rows = calib.run_cases(list(cases), a.out, a.iters, 1, a.timeout, cases=cases)
    result = report(a, rows)
    (a.out / "moe.json").write_text(json.dumps({"device": device, "torch": torch.__version__, "args": {
        "seq": a.seq, "gbs": a.gbs, "mb": a.mb, "iters": a.iters, "peak": a.peak}, "result": result}, indent=2,
        default=str))
    failed = [r["case"] for r in rows if "error" in r] + \
        [f"{m}: first loss outside {LOSS_RTOL:g}" for m, s in result["summary"].items() if not s.get("first_within")]
    if failed:
        print(f"  FAILED: {'; '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
