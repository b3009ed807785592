"""The memory-bound operations around the grouped experts, one GPU, side by side in one run: the way back's gather
and sum (runtime/model/experts/permute.py's eager `index_select` + `sum` beside the same sum torch.compile'd into
one kernel, dynamic and static shapes) and the SwiGLU x routing probabilities (activation.py: autograd's unfused
arithmetic beside the compiled forward + backward: torch.compile's automatic shapes (used), any row count with the width
fixed, all sizes dynamic, static). Each op's time (median of `--reps` after warm-up) and its
bandwidth: the bytes it must move at the least (read each input once, write each output once) over the time,
against the card's HBM bandwidth (`--hbm`, 4.8 TB/s for an H200).

    PYTHONPATH=src python bench/moe_ops.py                         # moe-3b's micro-batch 16 (65,536 tokens) and Mixtral-like
    PYTHONPATH=src python bench/moe_ops.py --shapes moe3b --tokens 32768 --out DIR

Writes DIR/moe_ops.json when --out is given. Needs a CUDA GPU."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHAPES = {  # name: (top-k, hidden, expert ffn, experts)
    "moe3b": (8, 2048, 768, 64),
    "mixtral": (2, 4096, 14336, 8),
}


def timed(fn: Callable[[], Any], reps: int) -> float:
    import torch

    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def routing(tokens: int, k: int, experts: int) -> tuple[Any, Any]:
    """Megatron's expert order of a random top-k routing (`order`: the source token of each row) and its inverse map."""
    import torch

    logits = torch.randn(tokens, experts, device="cuda")
    chosen = logits.topk(k, -1).indices
    expert_of_row = chosen.reshape(-1)
    order = torch.argsort(expert_of_row, stable=True) // k
    inv = torch.argsort(order, stable=True).view(tokens, k)
    return order, inv


def bag_cases(tokens: int, k: int, hidden: int, experts: int, reps: int) -> dict[str, tuple[float, float]]:
    import torch

    def eager(x: Any, inv: Any) -> Any:  # runtime/model/experts/permute.py's
        return x.index_select(0, inv.reshape(-1)).view(*inv.shape, x.shape[-1]).sum(1)

    def one_kernel(x: Any, inv: Any) -> Any:  # the same, for torch.compile to fuse
        return x[inv].float().sum(1).to(x.dtype)

    _, inv = routing(tokens, k, experts)
    x = torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16)
    dynamic, static = torch.compile(one_kernel, dynamic=True), torch.compile(one_kernel, dynamic=False)
    ref = eager(x, inv)
    least = float((tokens * k * hidden + tokens * hidden) * 2 + tokens * k * 8)
    out: dict[str, tuple[float, float]] = {}
    for name, fn in (("eager", eager), ("compiled, dynamic", dynamic), ("compiled, static", static)):
        got = fn(x, inv)
        err = float((got.float() - ref.float()).abs().max())
        assert err <= float(ref.float().abs().max()) * 2 ** -7, (name, err)
        out[name] = (timed(partial(fn, x, inv), reps), least)
    return out


def swiglu_cases(rows: int, ffn: int, reps: int) -> dict[str, tuple[float, float]]:
    import torch
    import torch.nn.functional as F

    from megalaunch.runtime.model.experts import activation

    h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    p = torch.rand(rows, device="cuda")
    grad = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)

    def unfused() -> None:
        hi, pi = h.detach().requires_grad_(), p.detach().requires_grad_()
        gate, up = hi.chunk(2, -1)
        (F.silu(gate) * up * pi.unsqueeze(-1)).to(torch.bfloat16).backward(grad)

    def compiled(fwd: Any, bwd: Any) -> Callable[[], None]:
        def run() -> None:
            bwd(grad, h, p)
            fwd(h, p)
        return run

    # forward: h and probs in, the product out; backward: grad, h, probs in, d h and d probs out
    least = 1.0 * rows * (2 * 2 * ffn + 4 + 2 * ffn) + rows * (2 * ffn + 2 * 2 * ffn + 4 + 2 * 2 * ffn + 4)
    def rows_marked(fwd: Any, bwd: Any) -> tuple[Any, Any]:  # any row count from the first call, the width fixed
        def mark(*ts: Any) -> None:
            for t in ts:
                torch._dynamo.maybe_mark_dynamic(t, 0)

        def f(hh: Any, pp: Any) -> Any:
            mark(hh, pp)
            return fwd(hh, pp)

        def b(gg: Any, hh: Any, pp: Any) -> Any:
            mark(gg, hh, pp)
            return bwd(gg, hh, pp)

        return f, b

    return {"unfused (autograd)": (timed(unfused, reps), least),
            "compiled, auto (used)": (timed(compiled(*activation._kernels(None)), reps), least),
            "compiled, any rows": (timed(compiled(*rows_marked(*activation._kernels(None))), reps), least),
            "compiled, dynamic": (timed(compiled(*activation._kernels(True)), reps), least),
            "compiled, static": (timed(compiled(*activation._kernels(False)), reps), least)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="moe3b,mixtral")
    ap.add_argument("--tokens", type=int, default=0, help="tokens of a micro-batch (default: moe3b 65536, mixtral 8192)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hbm", type=float, default=4.8, help="the card's HBM bandwidth, TB/s")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch

    print(f"card: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results: dict[str, Any] = {}
    for shape in a.shapes.split(","):
        k, hidden, ffn, experts = SHAPES[shape]
        tokens = a.tokens or (65536 if shape == "moe3b" else 8192)
        ops = {"bag (way back: gather + sum)": bag_cases(tokens, k, hidden, experts, a.reps),
               "SwiGLU x probs (fwd + bwd)": swiglu_cases(tokens * k, ffn, a.reps)}
        print(f"\n{shape}: {tokens} tokens, top-{k}, hidden {hidden}, expert ffn {ffn}")
        for op, cases in ops.items():
            for case, (ms, least) in cases.items():
                tbps = least / (ms * 1e-3) / 1e12
                print(f"  {op:30s} {case:20s} {ms:8.3f} ms  {tbps:5.2f} TB/s ({tbps / a.hbm:5.1%} of HBM)")
                results[f"{shape}/{op}/{case}"] = {"ms": ms, "least_bytes": least, "tbps": tbps}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "moe_ops.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
