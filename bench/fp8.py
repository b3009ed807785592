"""`training.precision: fp8` measured on one GPU, side by side with bf16 in the same call.

    PYTHONPATH=src python bench/fp8.py --stage gemm   # the linear layers' three GEMMs at 1B and 8B shapes (~1 min)
    PYTHONPATH=src python bench/fp8.py --stage e2e    # llama3-1b end to end: bf16, fp8 tensorwise, fp8 rowwise
    PYTHONPATH=src python bench/fp8.py --stage loss   # llama3-1b loss curves, bf16 against fp8, N iterations
    python bench/fp8.py --stage plot --out DIR --png F  # the loss stage's DIR/fp8_loss.json as a figure (no GPU)

`gemm`: each linear layer of llama3-1b and llama3-8b at 8192 tokens, forward and backward (its three GEMMs: x @ W^T,
dy @ W, dy^T @ x) through the autograd function Megatron's layers call (runtime/model/fp8_linear.py): bf16's
autograd matmul against FP8 tensorwise (Triton casts, the weight cast once per optimizer step), the same recasting
the weight every call (a step's first micro-batch), rowwise (per-row scales, Triton casts), and the three _scaled_mm
alone on pre-cast operands (the ceiling). Median of 20 repetitions with CUDA events; TFLOP/s = 3 x 2 M N K / time.
`e2e`: bench/memory_calib.py's runs (real trainer, mock data, sdpa attention, `training.kernels: auto`); tokens/s
and Megatron's TFLOP/s per GPU, which counts bf16-equivalent FLOPs (its formula knows no FP8), MFU against the
dense bf16 peak (`--peak`).
`loss`: the same model trained `--iters` iterations per case from the same seed on the same data (`--data`: a
corpus with a known loss floor from bench/entropy_corpus.py; without it Megatron's mock data, which a model
memorises); the loss of every iteration (MEGALAUNCH_LOSS_LOG), the gap of the last 10 % mean against bf16 and the
tolerance (LOSS_RTOL), written to OUT/fp8_loss.json.
Writes OUT/fp8_<stage>.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_calib as calib

SHAPES = {"1b": dict(h=2048, qkv=3072, ffn=8192), "8b": dict(h=4096, qkv=6144, ffn=14336)}
TOKENS = 8192
CASES = {"bf16": ["training.precision=bf16"],
         "fp8": ["training.precision=fp8", "training.fp8_recipe=tensorwise"],
         "fp8-rowwise": ["training.precision=fp8", "training.fp8_recipe=rowwise"]}


def cuda_ms(fn: Any, reps: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def layer_row(model: str, layer: str, n: int, k: int) -> dict[str, Any]:
    """One linear layer (n outputs, k inputs) at TOKENS tokens, forward and backward, each way."""
    import torch

    from megalaunch.runtime.model import fp8, fp8_linear

    bf, e4, e5 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
    x = torch.randn(TOKENS, k, device="cuda", dtype=bf, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=bf) * 0.02)
    dy = torch.randn(TOKENS, n, device="cuda", dtype=bf) * 1e-3
    row: dict[str, Any] = {"model": model, "layer": layer, "shape": [TOKENS, n, k]}

    def step(impl: Any, recast: bool = False) -> None:
        if recast:  # as the first micro-batch after an optimizer step
            fp8_linear._GENERATION[0] += 1
        impl().backward(dy)

    row["bf16_ms"] = cuda_ms(lambda: step(lambda: x @ w.t()))
    for name, recipe, recast in (("fp8_ms", "tensorwise", False), ("fp8_recast_ms", "tensorwise", True),
                                 ("fp8_rowwise_ms", "rowwise", False)):
        impl = fp8_linear.forward_impl(fp8.Formats.of(recipe, fused=True), None)
        row[name] = cuda_ms(lambda impl=impl, recast=recast: step(lambda: impl(input=x, weight=w), recast))
    qx, sx = fp8.quantize(x.detach(), e4, False)
    qw, sw = fp8.quantize(w.detach(), e4, False)
    qd, sd = fp8.quantize(dy, e5, False)
    qwt, qdt, qxt = qw.t().contiguous(), qd.t().contiguous(), qx.t().contiguous()

    def gemms_only() -> None:
        torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=bf)
        torch._scaled_mm(qd, qwt.t(), scale_a=sd, scale_b=sw, out_dtype=bf)
        torch._scaled_mm(qdt, qxt.t(), scale_a=sd, scale_b=sx, out_dtype=bf)

    row["scaled_mm_only_ms"] = cuda_ms(gemms_only)
    flops = 3 * 2 * TOKENS * n * k
    for key in [key for key in row if key.endswith("_ms")]:
        row[key.replace("_ms", "_tflops")] = flops / (row[key] / 1e3) / 1e12
    return row


def stage_gemm() -> list[dict[str, Any]]:
    """Each linear layer's forward and backward (its three GEMMs and their casts) through the autograd function
    Megatron's layers call (runtime/model/fp8_linear.py), against bf16's autograd matmul."""
    rows = []
    for model, s in SHAPES.items():
        layers = {"qkv": (s["qkv"], s["h"]), "proj": (s["h"], s["h"]), "fc1": (2 * s["ffn"], s["h"]),
                  "fc2": (s["h"], s["ffn"])}
        for layer, (n, k) in layers.items():
            row = layer_row(model, layer, n, k)
            rows.append(row)
            print(f"  {model} {layer:4s} {row['shape']!s:20s} fwd+bwd: bf16 {row['bf16_tflops']:5.0f}  "
                  f"fp8 {row['fp8_tflops']:5.0f} (x{row['bf16_ms'] / row['fp8_ms']:.2f})  "
                  f"fp8 recasting the weight {row['fp8_recast_tflops']:5.0f} (x{row['bf16_ms'] / row['fp8_recast_ms']:.2f})  "
                  f"rowwise {row['fp8_rowwise_tflops']:5.0f} (x{row['bf16_ms'] / row['fp8_rowwise_ms']:.2f})  "
                  f"3 x _scaled_mm alone {row['scaled_mm_only_tflops']:5.0f} TFLOP/s", flush=True)
    for model in SHAPES:
        mine = [r for r in rows if r["model"] == model]
        t = {k: sum(r[k] for r in mine) for k in ("bf16_ms", "fp8_ms", "fp8_recast_ms", "fp8_rowwise_ms",
                                                  "scaled_mm_only_ms")}
        print(f"  {model} a layer's linear layers, fwd+bwd: bf16 {t['bf16_ms']:.2f} ms, fp8 {t['fp8_ms']:.2f} "
              f"(x{t['bf16_ms'] / t['fp8_ms']:.2f}), recasting weights {t['fp8_recast_ms']:.2f} "
              f"(x{t['bf16_ms'] / t['fp8_recast_ms']:.2f}), rowwise {t['fp8_rowwise_ms']:.2f} "
              f"(x{t['bf16_ms'] / t['fp8_rowwise_ms']:.2f}), GEMMs alone {t['scaled_mm_only_ms']:.2f}", flush=True)
    return rows


def defs(a: argparse.Namespace, cases: list[str], extra: list[str]) -> dict[str, tuple[Any, ...]]:
    """Each case on `--per-case` GPUs, TP 1 unless `--sets` says otherwise (later overrides win)."""
    out = {}
    for name in cases:
        sets = [f"model.seq_length={a.seq}", f"training.global_batch_size={a.gbs}", f"training.micro_batch_size={a.mb}",
                "training.kernels=auto", "training.fused_kernels=true", "parallel.tensor_model_parallel_size=1",
                "parallel.sequence_parallel=false", *CASES[name], *extra, *a.sets]
        env = {"MEGALAUNCH_LOSS_LOG": str(a.out / f"loss-{name}.jsonl")}
        out[name] = (a.recipe, a.per_case, sets, env)
    return out


def stage_e2e(a: argparse.Namespace) -> list[dict[str, Any]]:
    cases = a.cases.split(",")
    rows = calib.run_cases(cases, a.out, a.iters, a.gpus, a.timeout, cases=defs(a, cases, []))
    for r in rows:
        if "ms_per_iteration" in r:
            r["tokens_per_s"] = a.gbs * a.seq / (r["ms_per_iteration"] / 1000)
            r["mfu"] = r["tflops_per_gpu"] / a.peak
            r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / a.per_case
            print(f"  {r['case']:12s} {a.recipe} on {a.per_case} GPU(s) seq {a.seq} {r['ms_per_iteration'] / 1000:6.3f} "
                  f"s/iter {r['tokens_per_s_per_gpu']:>9,.0f} tokens/s/GPU {r['tflops_per_gpu']:6.1f} TFLOP/s (bf16-equivalent) MFU {100 * r['mfu']:5.1f} % "
                  f"max {r['max_allocated_gib']:5.1f} GiB", flush=True)
        else:
            print(f"  {r['case']:12s} {r['error']}", flush=True)
    return rows


LOSS_RTOL = 0.01  # fp8's final loss within 1 % of bf16's: published FP8 pre-training runs end within ~1 % (docs/results.md)


def stage_loss(a: argparse.Namespace) -> dict[str, Any]:
    """The cases trained side by side on the same data (a corpus from bench/entropy_corpus.py with --data: a loss
    floor no model can pass; else Megatron's mock data, which a model memorises)."""
    cases = a.cases.split(",")
    for name in cases:
        (a.out / f"loss-{name}.jsonl").unlink(missing_ok=True)
    extra = ["training.log_interval=1"]
    floor = None
    if a.data:
        meta = json.loads(Path(f"{a.data}.json").read_text())
        floor = meta["floor_nats"]
        extra += ["data.mock=false", f"data.blend=[{{path: {a.data}}}]", "data.tokenizer_type=NullTokenizer",
                  f"data.vocab_size={meta['vocab']}"]
        print(f"  data: {a.data} ({meta['tokens']:,} tokens), loss floor {floor:.4f} nats", flush=True)
    calib.run_cases(cases, a.out, a.iters, a.gpus, a.timeout, cases=defs(a, cases, extra))
    curves: dict[str, dict[int, float]] = {}
    for name in cases:
        path = a.out / f"loss-{name}.jsonl"
        recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        curves[name] = {r["iteration"]: r["loss"] for r in recs}
    tail = max(1, a.iters // 10)
    result: dict[str, Any] = {"iters": a.iters, "tail": tail, "curves": curves, "tail_mean": {}, "floor_nats": floor,
                              "data": a.data or "mock", "rtol": LOSS_RTOL}
    for name, c in curves.items():
        last = [c[i] for i in sorted(c)[-tail:]]
        result["tail_mean"][name] = statistics.mean(last) if last else None
    ref = result["tail_mean"].get("bf16")
    for name, m in result["tail_mean"].items():
        gap = None if ref is None or m is None else (m - ref) / ref
        result.setdefault("gap", {})[name] = gap
        verdict = "" if gap is None or name == "bf16" else (" within" if abs(gap) <= LOSS_RTOL else " OUTSIDE") + \
            f" the {100 * LOSS_RTOL:g} % tolerance"
        print(f"  {name:12s} {len(curves[name])} iterations, mean loss of the last {tail}: {m}"
              + (f", against bf16 {100 * gap:+.2f} %{verdict}" if gap is not None else ""), flush=True)
    return result


def plot(result_json: Path, png: Path) -> None:
    """The loss stage's curves (top) and each case's gap to bf16, smoothed over 20 iterations (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(result_json.read_text())
    r = data["result"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    ref = {int(i): v for i, v in r["curves"]["bf16"].items()}
    for n, (name, curve) in enumerate(r["curves"].items()):
        c = {int(i): v for i, v in curve.items()}
        its = sorted(c)
        top.plot(its, [c[i] for i in its], label=name, linewidth=0.8, color=f"C{n}")
        if name != "bf16":
            common = [i for i in its if i in ref]
            gap = [100 * (c[i] - ref[i]) / ref[i] for i in common]
            smooth = [statistics.mean(gap[max(0, k - 19):k + 1]) for k in range(len(gap))]
            bottom.plot(common, smooth, label=f"{name} - bf16", linewidth=0.8, color=f"C{n}")
    if r.get("floor_nats"):
        top.axhline(r["floor_nats"], color="grey", linestyle=":", label=f"loss floor {r['floor_nats']:.3f}")
    top.set_ylabel("training loss (nats)")
    top.set_title(f"{data['device']}: bf16 and fp8 from the same seed and data")
    top.legend()
    bottom.axhline(0, color="grey", linewidth=0.5)
    for sign in (1, -1):
        bottom.axhline(sign * 100 * r["rtol"], color="red", linestyle="--", linewidth=0.6)
    bottom.set_ylabel("gap to bf16, % (20-iter mean)")
    bottom.set_xlabel("iteration")
    bottom.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("gemm", "e2e", "loss", "plot"), default="gemm")
    parser.add_argument("--png", type=Path, help="--stage plot: the figure to write from OUT/fp8_loss.json")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--recipe", default="train/llama3-1b")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mb", type=int, default=1)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--per-case", type=int, default=1, help="GPUs per case (cases run side by side where they fit)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: all of this node's)")
    parser.add_argument("--sets", type=lambda v: [x for x in v.split(",") if x], default=[],
                        help="overrides for every case, comma-separated (e.g. the layout)")
    parser.add_argument("--data", default=None, help="--stage loss: a corpus prefix from bench/entropy_corpus.py")
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (H100/H200 SXM)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "fp8")
    a = parser.parse_args()
    if a.stage == "plot":  # no GPU needed: the loss stage's JSON, drawn
        plot(a.out / "fp8_loss.json", a.png or a.out / "fp8_loss.png")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    a.gpus = a.gpus or torch.cuda.device_count()
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    print(f"== fp8 {a.stage} on {device} (torch {torch.__version__})", flush=True)
    result: Any = stage_gemm() if a.stage == "gemm" else stage_e2e(a) if a.stage == "e2e" else stage_loss(a)
    (a.out / f"fp8_{a.stage}.json").write_text(json.dumps({"device": device, "result": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
