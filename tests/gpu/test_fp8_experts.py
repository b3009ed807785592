"""FP8 grouped experts on the GPU (runtime/model/experts/fp8.py: torch._scaled_grouped_mm, CUTLASS on sm90 /
sm100, the dense path's Triton casts; skipped elsewhere): one expert layer, forward and backward, against the bf16
grouped path (torch's grouped_mm) on the same weights and rows, with top-k routing that leaves some experts without
tokens and loads others unevenly, at moe-3b's shape (64 experts of 768, hidden 2048, 4096 tokens top-8) and a
Mixtral-like one (8 experts of 14336, hidden 4096, top-2):
- the relative error (Frobenius, as tests/unit/test_fp8.py) of the output < 10 % and of every gradient (input,
  routing probabilities, both weights) < 12 % (two chained e4m3 GEMMs, ~3.5 % each; tests/unit/test_fp8_experts.py);
  the weight gradient of an expert without tokens exactly zero;
- forward and backward under torch.cuda.set_sync_debug_mode("error"): no host sync (padding included);
- the Triton casts' layer equal to the torch casts' layer (the same scales: a few values may round apart);
- the layer's forward + backward time, bf16 vs fp8 (printed, not asserted; the weight cast once per optimizer step
  is timed apart).

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_fp8_experts.py -s"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
_CAP = torch.cuda.get_device_capability()
if not (_CAP == (9, 0) or _CAP[0] == 10) or not hasattr(torch, "_scaled_grouped_mm"):
    pytest.skip(f"torch's scaled grouped GEMM needs compute capability 9.0 or 10.x (this GPU: {_CAP})",
                allow_module_level=True)
pytest.importorskip("triton")

from megalaunch.runtime.model.experts import fp8 as F  # noqa: E402
from megalaunch.runtime.model.experts import gmm as G  # noqa: E402
from megalaunch.runtime.model.experts.grouped import fp8_forward, glu  # noqa: E402
from megalaunch.runtime.model.fp8 import Formats  # noqa: E402

pytestmark = pytest.mark.gpu
OUT_BOUND, GRAD_BOUND = 0.10, 0.12
SHAPES = {"moe3b": dict(experts=64, hidden=2048, ffn=768, tokens=4096, topk=8),
          "mixtral": dict(experts=8, hidden=4096, ffn=14336, tokens=4096, topk=2)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def _case(experts: int, hidden: int, ffn: int, tokens: int, topk: int, fused: bool = True) -> SimpleNamespace:
    """An expert layer (std 0.02 weights, as Megatron initialises) and one micro-batch's expert-sorted rows: top-k
    of skewed router logits, the last quarter of the experts (at least one) never chosen."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    logits += torch.linspace(2.0, -2.0, experts, device="cuda")  # uneven: early experts busier
    logits[:, experts - max(1, experts // 4):] = float("-inf")  # and some idle
    top, chosen = torch.topk(logits.softmax(-1), topk, dim=-1)
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    rows = int(counts.sum())
    cfg = SimpleNamespace(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                          activation_func_clamp_value=None, glu_linear_offset=0.0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    layer = SimpleNamespace(
        weight1=torch.nn.Parameter(torch.randn(experts, 2 * ffn, hidden, generator=g, **kw) * 0.02),
        weight2=torch.nn.Parameter(torch.randn(experts, hidden, ffn, generator=g, **kw) * 0.02),
        config=cfg, fp8_format=Formats.of("tensorwise", fused=fused), grouped=True)
    return SimpleNamespace(layer=layer, counts=counts, x=torch.randn(rows, hidden, generator=g, **kw),
                           probs=(top / top.sum(-1, keepdim=True)).flatten()[:rows].contiguous(),
                           dy=torch.randn(rows, hidden, generator=g, **kw), ffn=ffn)


def _bf16(c: SimpleNamespace) -> list[torch.Tensor]:
    """The bf16 grouped path (GroupedExperts.forward's arithmetic): output and gradients."""
    x, p = c.x.clone().requires_grad_(), c.probs.clone().requires_grad_()
    w1, w2 = (w.detach().clone().requires_grad_() for w in (c.layer.weight1, c.layer.weight2))
    offs = c.counts.cumsum(0).to(torch.int32)
    inter = glu(G.gmm(x, w1, offs), c.layer.config)
    y = G.gmm((inter * p.unsqueeze(-1)).to(inter.dtype), w2, offs)
    y.backward(c.dy)
    return [y.detach(), x.grad, p.grad, w1.grad, w2.grad]


def _fp8(c: SimpleNamespace) -> list[torch.Tensor]:
    x, p = c.x.clone().requires_grad_(), c.probs.clone().requires_grad_()
    for w in (c.layer.weight1, c.layer.weight2):
        w.grad = None
    y = fp8_forward(c.layer, x, c.counts, p)
    y.backward(c.dy)
    return [y.detach(), x.grad, p.grad, c.layer.weight1.grad, c.layer.weight2.grad]


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_expert_layer_matches_bf16(shape: str) -> None:
    c = _case(**SHAPES[shape])
    ref, got = _bf16(c), _fp8(c)
    names = ("output", "d input", "d probs", "d weight1", "d weight2")
    errs = {n: rel_err(a, b) for n, a, b in zip(names, got, ref, strict=True)}
    idle = (c.counts == 0).nonzero().flatten().tolist()
    print(f"\n[fp8 experts {shape}] {c.counts.numel()} experts, {int(c.counts.sum())} rows, {len(idle)} idle, busiest "
          f"{int(c.counts.max())}: relative error " + ", ".join(f"{n} {e:.4f}" for n, e in errs.items()))
    assert all(t.isfinite().all() for t in got)
    assert got[0].dtype == torch.bfloat16 and got[3].dtype == got[4].dtype == torch.bfloat16
    assert errs["output"] < OUT_BOUND, errs
    assert all(e < GRAD_BOUND for n, e in errs.items() if n != "output"), errs
    assert idle and all(torch.count_nonzero(got[3][e]) == 0 and torch.count_nonzero(got[4][e]) == 0 for e in idle)


def test_fp8_expert_layer_makes_no_host_sync() -> None:
    c = _case(**SHAPES["moe3b"])
    _fp8(c)  # warm-up: Triton compiles its casts, CUTLASS picks its kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _fp8(c)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print("\n[fp8 experts] forward + backward under set_sync_debug_mode('error'): no host sync")
    assert all(t.isfinite().all() for t in got)


def test_triton_casts_give_the_torch_casts_layer() -> None:
    fused, eager = _case(**SHAPES["moe3b"]), _case(**SHAPES["moe3b"], fused=False)
    a, b = _fp8(fused), _fp8(eager)
    errs = [rel_err(x, y) for x, y in zip(a, b, strict=True)]
    print(f"\n[fp8 experts] Triton casts vs torch casts, relative differences: {', '.join(f'{e:.1e}' for e in errs)}")
    assert max(errs) < 1e-2


def _ms(fn, reps: int = 10) -> float:
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


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_expert_layer_speed(shape: str) -> None:
    c = _case(**SHAPES[shape])
    rows, hidden = c.x.shape
    flops = 3 * 2 * rows * hidden * 3 * c.ffn  # forward + backward of fc1 (2 x ffn) and fc2 (ffn)

    def recast() -> None:
        F._STEP[0] += 1  # as after an optimizer step: the weights cast again
        _fp8(c)

    bf16_ms, fp8_ms, recast_ms = _ms(lambda: _bf16(c)), _ms(lambda: _fp8(c)), _ms(recast)
    print(f"\n[fp8 experts {shape}] forward + backward, {rows} rows: bf16 {bf16_ms:.2f} ms "
          f"({flops / bf16_ms / 1e9:.0f} TFLOP/s), fp8 {fp8_ms:.2f} ms ({flops / fp8_ms / 1e9:.0f} TFLOP/s, "
          f"x{bf16_ms / fp8_ms:.2f}), fp8 recasting the weights {recast_ms:.2f} ms (x{bf16_ms / recast_ms:.2f})")
    assert fp8_ms > 0 and bf16_ms > 0
