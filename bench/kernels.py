"""`training.kernels` measured: each op, Megatron's path vs liger-kernel's (forward + backward), then llama3-1b
end to end on one GPU with each choice, side by side on the same machine.

    PYTHONPATH=src python bench/kernels.py --stage ops        # per-op micro-benchmarks (~1 min)
    PYTHONPATH=src python bench/kernels.py --stage e2e        # llama3-1b, seq 2048, GBS 32, each choice

`ops`: the shapes of llama3-1b (hidden 2048, 32/8 heads, ffn 8192, vocab 128256) and llama3-8b (4096, 32/8,
14336) with 8192 tokens per micro-batch; median ms of forward + backward over 20 repetitions (CUDA events,
after 3 warm-ups) and peak memory above the inputs. Megatron's paths are the ones its local layers run with
`fused_kernels` on: torch's RMSNorm, the unfused rotary embedding (rope_utils), the torch.compile'd SwiGLU,
the output layer's matmul + the torch.compile'd cross entropy over materialised logits.
`e2e`: bench/memory_calib.py's runs (real trainer, mock data, sdpa attention); tokens/s, Megatron's TFLOP/s
per GPU, MFU against the dense bf16 peak (`--peak`), max allocated. A case named `...+prof` also records
two more iterations with torch's profiler and prints where their GPU time goes (bench/trace_summary.py).
Writes OUT/kernels_*.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_summary  # noqa: I001 (before memory_calib, which takes bench/ off the path)
import memory_calib as calib  # bench/: it puts src/ on the path and takes bench/ off again

SHAPES = {"1b": dict(h=2048, heads=32, groups=8, ffn=8192, vocab=128256),
          "8b": dict(h=4096, heads=32, groups=8, ffn=14336, vocab=128256)}
TOKENS = 8192  # one micro-batch: seq 2048 x 4, or seq 8192 x 1


def timed(fn: Any, inputs: list[Any], reps: int = 20) -> tuple[float, float, float]:
    """Median ms of forward + backward as the CPU issues them one at a time (launch-bound ops show their
    Python and launch cost), ms per call on the GPU alone (the queue filled behind a sleeping kernel first,
    as in a training step where big GEMMs hide the launches), and peak GiB beyond what was there before."""
    import torch

    def once() -> None:
        leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o for o in outs if o.requires_grad],
                                [torch.ones_like(o) for o in outs if o.requires_grad])

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU cycles: the CPU queues every rep before the GPU reaches them
    start.record()
    for _ in range(reps):
        once()
    end.record()
    torch.cuda.synchronize()
    return statistics.median(times), start.elapsed_time(end) / reps, (torch.cuda.max_memory_allocated() - base) / 2**30


def op_cases(shape: dict[str, int]) -> dict[str, dict[str, Any]]:
    """op -> {"inputs": [...], "megatron": fn, "liger": fn[, "liger-default-chunks": fn]}."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megalaunch.runtime.model import liger_layers

    h, heads, groups, ffn, vocab = (shape[k] for k in ("h", "heads", "groups", "ffn", "vocab"))
    d, s, b = h // heads, 2048, TOKENS // 2048
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    class Cfg:
        normalization, layernorm_zero_centered_gamma, sequence_parallel = "RMSNorm", False, False

    torch_norm = torch.nn.RMSNorm(h, eps=1e-5).to(**bf16)
    liger_norm = liger_layers.norm_class()(Cfg(), h, eps=1e-5).to(**bf16)
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=heads, num_query_groups=groups)
    freqs = RotaryEmbedding(d, rotary_percent=1.0, rotary_base=500000).cuda()(s)
    split = [heads // groups * d, d, d]

    def megatron_rope(m: Any) -> Any:
        q, k, v = torch.split(m, split, dim=3)
        return apply_rotary_pos_emb(q.reshape(s, b, -1, d), freqs, cfg), apply_rotary_pos_emb(k, freqs, cfg), v

    labels = torch.randint(0, vocab, (b, s), device="cuda")
    tp = parallel_state.get_tensor_model_parallel_group()

    def megatron_ce(x: Any, w: Any) -> Any:
        return fused_vocab_parallel_cross_entropy(x @ w.t(), labels.t().contiguous(), tp).sum()

    def liger_ce(x: Any, w: Any, chunks: bool = True) -> Any:
        if chunks:
            return liger_layers.fused_loss(x, w, labels).sum()
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        return LigerFusedLinearCrossEntropyFunction.apply(x.reshape(-1, h), w, labels.t().reshape(-1), None, None,
                                                          -100, 0.0, 0.0, "sum")[0]

    return {
        "rmsnorm": {"inputs": [torch.randn(s, b, h, **bf16)], "megatron": torch_norm, "liger": liger_norm},
        "rope": {"inputs": [torch.randn(s, b, groups, (heads // groups + 2) * d, **bf16)], "megatron": megatron_rope,
                 "liger": lambda m: liger_layers.rope_qkv(m, freqs, freqs, split)},
        "swiglu": {"inputs": [torch.randn(s, b, 2 * ffn, **bf16)], "megatron": lambda y: bias_swiglu_impl(y, None),
                   "liger": liger_layers.swiglu},
        "linear_ce": {"inputs": [torch.randn(s, b, h, **bf16), 0.02 * torch.randn(vocab, h, **bf16)],
                      "megatron": megatron_ce, "liger": liger_ce,
                      "liger-default-chunks": lambda x, w: liger_ce(x, w, chunks=False)},
    }


def stage_ops(out: Path) -> list[dict[str, Any]]:
    import torch

    from megalaunch.runtime.model.standalone import megatron_parallel_state

    rows = []
    with megatron_parallel_state():
        for name, shape in SHAPES.items():
            for op, case in op_cases(shape).items():
                row: dict[str, Any] = {"shape": name, "op": op}
                for impl, fn in case.items():
                    if impl != "inputs":
                        row[f"{impl}_ms"], row[f"{impl}_gpu_ms"], row[f"{impl}_gib"] = timed(fn, case["inputs"])
                row["speedup"] = row["megatron_ms"] / row["liger_ms"]
                row["gpu_speedup"] = row["megatron_gpu_ms"] / row["liger_gpu_ms"]
                rows.append(row)
                print(f"  {name} {op:10s} " + " | ".join(
                    f"{impl} {row[impl + '_ms']:7.3f} ms (GPU {row[impl + '_gpu_ms']:7.3f}) {row[impl + '_gib']:5.2f} GiB"
                    for impl in case if impl != "inputs") + f" | liger x{row['speedup']:.2f} (GPU x{row['gpu_speedup']:.2f})",
                      flush=True)
                torch.cuda.empty_cache()
    return rows


E2E = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false", "training.fused_kernels=true"]
PROFILE_STEPS = 1  # iterations the profiler records, after the timed ones (one step: every micro-batch)


def e2e_case(name: str, a: argparse.Namespace) -> tuple[str, int, list[str], dict[str, str]]:
    """`<kernels>[:op+op]-mb<N>[+prof]`, e.g. megatron-mb2, liger-mb4, liger:rope+linear_ce-mb4+prof: the
    recipe, GPUs, overrides and environment of one run (`:ops` limits liger's ops, MEGALAUNCH_LIGER_OPS)."""
    spec, _, prof = name.partition("+prof")
    kernels, mb = spec.rsplit("-mb", 1)
    kernels, _, ops = kernels.partition(":")
    sets = [*E2E, f"model.seq_length={a.seq}", f"training.global_batch_size={a.gbs}", *a.sets,
            f"training.kernels={kernels}", f"training.micro_batch_size={mb}"]
    if name.endswith("+prof"):  # Megatron's torch profiler: RUN/torch_profile/rank-0.json.gz
        sets += ["logging.tensorboard=true", "megatron_args.profile=true", "megatron_args.use-pytorch-profiler=true",
                 f"megatron_args.profile-step-start={a.iters + 2}",
                 f"megatron_args.profile-step-end={a.iters + 2 + PROFILE_STEPS}"]
    return a.recipe, a.gpus, sets, ({"MEGALAUNCH_LIGER_OPS": ops} if ops else {})


def trace_of(out: Path, name: str) -> Path | None:
    found = sorted((out / "runs").glob(f"*{calib.run_name(name)}*/torch_profile/rank-0.json.gz"))
    return found[-1] if found else None


def stage_e2e(out: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    cases = a.cases.split(",")
    defs = {name: e2e_case(name, a) for name in cases}

    def ready(name: str) -> bool:  # a profiled case ends once its trace is written: an iteration after it logged
        if not name.endswith("+prof"):
            return True
        log = out / f"{calib.run_name(name)}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        logged = [int(m.group(1)) for m in calib.ITER_RE.finditer(text)]
        return trace_of(out, name) is not None and max(logged, default=0) > a.iters + 2 + PROFILE_STEPS

    rows = calib.run_cases(cases, out, a.iters, torch.cuda.device_count(), a.timeout, cases=defs, ready=ready)
    for r in rows:
        if "ms_per_iteration" in r:
            r["tokens_per_s"] = a.gbs * a.seq / (r["ms_per_iteration"] / 1000)
            r["mfu"] = r["tflops_per_gpu"] / a.peak
            print(f"  {r['case']:28s} {r['ms_per_iteration'] / 1000:6.3f} s/iter {r['tokens_per_s']:>9,.0f} tokens/s "
                  f"{r['tflops_per_gpu']:6.1f} TFLOP/s/GPU MFU {100 * r['mfu']:5.1f} % max {r['max_allocated_gib']:5.1f} GiB "
                  f"(estimate {r['estimate_gib']:5.1f})", flush=True)
        else:
            print(f"  {r['case']:28s} {r['error']}", flush=True)
        trace = trace_of(out, r["case"]) if r["case"].endswith("+prof") else None
        if trace is not None:
            try:
                r["profile"] = trace_summary.summarize(trace, PROFILE_STEPS)
                print(trace_summary.render(r["profile"]), flush=True)
            except (OSError, EOFError, ValueError) as e:  # a trace cut short: say so, keep the other rows
                print(f"  {r['case']}: trace unreadable: {e}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("ops", "e2e"), default="ops")
    parser.add_argument("--cases", default="megatron-mb2,liger-mb2,liger-mb4",
                        help="for --stage e2e: <kernels>[:op+op]-mb<N>[+prof], comma-separated")
    parser.add_argument("--recipe", default="train/llama3-1b")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per case")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--gbs", type=int, default=32)
    parser.add_argument("--sets", type=lambda v: [x for x in v.split(",") if x], default=[],
                        help="more overrides for every case, comma-separated (e.g. the layout)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s of one GPU (H100/H200 SXM)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "kernels")
    a = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    print(f"== {a.stage} on {device} (torch {torch.__version__})", flush=True)
    rows = stage_ops(a.out) if a.stage == "ops" else stage_e2e(a.out, a)
    (a.out / f"kernels_{a.stage}.json").write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
