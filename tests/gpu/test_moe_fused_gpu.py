"""The fused expert paths on the GPU (runtime/model/experts/permute.py and activation.py), at moe-3b's shape (4096
tokens, 64 experts, top-8, hidden 2048, expert ffn 768), bf16: the gather-based permutation against Megatron's
`permute`/`unpermute` (same rows bit for bit; the sums within bf16 rounding: Megatron's scatter rounds once per
copy, the bag once per token) and the compiled SwiGLU x probabilities against MLP's unfused arithmetic (relative
error < 1 %, forward and both gradients); each pair's time printed (forward + backward, median of 10).

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_moe_fused_gpu.py -s"""

from __future__ import annotations

import statistics

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

from megalaunch.runtime.model.experts import activation  # noqa: E402
from megalaunch.runtime.model.experts import permute as ours  # noqa: E402

pytestmark = pytest.mark.gpu
T, E, K, H, F = 4096, 64, 8, 2048, 768


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def ms(fn) -> float:
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def test_permutation_on_the_gpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g)
    routing = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, logits.topk(K, -1).indices, True)
    probs = torch.softmax(logits, -1) * routing
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    up = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)

    def megatron() -> tuple:
        xi = x.clone().requires_grad_()
        rows, _, idx, _, _ = moe_utils.permute(xi, routing, probs=probs, num_out_tokens=T * K)
        out = moe_utils.unpermute(rows * 0.5, idx, restore_shape=x.shape)
        out.backward(up)
        return rows, out, xi.grad

    def fused() -> tuple:
        xi = x.clone().requires_grad_()
        rows, _, idx = ours.permute_dropless(xi, routing, probs, K)
        out = ours.combine_dropless(rows * 0.5, idx)
        out.backward(up)
        return rows, out, xi.grad

    (r1, o1, g1), (r2, o2, g2) = megatron(), fused()
    assert torch.equal(r1, r2)
    assert rel(o2, o1) < 1e-2 and rel(g2, g1) < 1e-2, (rel(o2, o1), rel(g2, g1))
    print(f"\npermute + unpermute, fwd + bwd: Megatron {ms(megatron):.3f} ms, gathers {ms(fused):.3f} ms")


def test_fused_activation_on_the_gpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(T * K, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g)
    p = torch.rand(T * K, device="cuda", generator=g)
    grad = torch.randn(T * K, F, device="cuda", dtype=torch.bfloat16, generator=g)

    def unfused() -> tuple:
        hi, pi = h.clone().requires_grad_(), p.clone().requires_grad_()
        gate, upv = torch.chunk(hi, 2, -1)
        out = (torch.nn.functional.silu(gate) * upv * pi.unsqueeze(-1)).to(torch.bfloat16)
        out.backward(grad)
        return out, hi.grad, pi.grad

    def fused() -> tuple:
        hi, pi = h.clone().requires_grad_(), p.clone().requires_grad_()
        out = activation.swiglu_probs(hi, pi)
        out.backward(grad)
        return out, hi.grad, pi.grad

    ref, got = unfused(), fused()
    errs = [rel(a, b) for a, b in zip(got, ref, strict=True)]
    assert max(errs) < 1e-2, errs
    assert got[2].dtype == p.dtype and got[1].dtype == h.dtype
    print(f"\nSwiGLU x probs, fwd + bwd: unfused {ms(unfused):.3f} ms, fused {ms(fused):.3f} ms (errors {errs})")



@pytest.mark.parametrize("rows", [0, 1, 17, 4096])
def test_fused_activation_any_row_count(rows: int) -> None:
    """The kernels are compiled for any number of rows (an EP rank receives a different count each micro-batch,
    none at all sometimes): each count gives MLP's unfused arithmetic, forward and both gradients."""
    g = torch.Generator(device="cuda").manual_seed(3 + rows)
    h = torch.randn(rows, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    p = torch.rand(rows, device="cuda", generator=g).requires_grad_()
    grad = torch.randn(rows, F, device="cuda", dtype=torch.bfloat16, generator=g)
    out = activation.swiglu_probs(h, p)
    out.backward(grad)
    hr, pr = h.detach().clone().requires_grad_(), p.detach().clone().requires_grad_()
    gate, upv = torch.chunk(hr.float(), 2, -1)
    ref = (torch.nn.functional.silu(gate) * upv * pr.unsqueeze(-1)).to(torch.bfloat16)
    ref.backward(grad)
    assert out.shape == (rows, F) and h.grad is not None and p.grad is not None
    if rows:
        errs = [rel(out, ref), rel(h.grad, hr.grad), rel(p.grad, pr.grad)]
        assert max(errs) < 1e-2, errs
