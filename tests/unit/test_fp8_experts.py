"""FP8 grouped experts (runtime/model/experts/fp8.py) on the CPU: the padded layout (device ops only), the scaled
grouped GEMM's operands against torch's own meta checks of `_scaled_grouped_mm`, the three GEMMs and the expert
layer against the bf16 grouped path (the kernel emulated in fp32 here; tests/gpu/test_fp8_experts.py runs CUTLASS's),
the weight cast once per optimizer step, and where fp8_linear.install gives the experts FP8 or keeps them in bf16.

Bounds (relative Frobenius error against bf16, as tests/unit/test_fp8.py measures): one e4m3 GEMM with per-row
scales lands at ~3.5 % (its bound there 6 %); the expert layer chains two (fc1, fc2) and its gradients two or three,
measured at 6-6.5 %: bounds 10 % for the layer's output and 12 % for the gradients (the dense layer's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "_scaled_grouped_mm"):
    pytest.skip("this torch has no _scaled_grouped_mm", allow_module_level=True)

from megalaunch.runtime.model.experts import fp8 as F  # noqa: E402
from megalaunch.runtime.model.experts import gmm as G  # noqa: E402
from megalaunch.runtime.model.experts.grouped import fp8_forward, glu  # noqa: E402
from megalaunch.runtime.model.fp8 import Formats  # noqa: E402

COUNTS = [[0, 37, 5, 0, 100, 1, 16, 33], [16, 32, 48, 64], [0, 0, 0, 9], [7], [0, 0, 0], [3, 0, 0, 0]]
OUT_BOUND, GRAD_BOUND = 0.10, 0.12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("counts", COUNTS)
def test_the_layout_pads_every_expert_to_a_multiple_of_16(counts: list[int]) -> None:
    lay = F.layout(torch.tensor(counts), sum(counts))
    ends = lay.offs.tolist()
    starts = [0, *ends[:-1]]
    assert lay.offs.dtype == torch.int32 and lay.offs.stride() == (1,)
    assert lay.rows == F.padded_rows(sum(counts), len(counts)) and lay.rows % 16 == 0 and ends[-1] == lay.rows
    assert all(e % 16 == 0 and e - s >= 16 for s, e in zip(starts, ends, strict=True))  # empty experts get 16 zeros
    dest, first = lay.dest.tolist(), 0
    for e, n in enumerate(counts):  # each expert's rows, in order, at the start of its padded group
        assert dest[first:first + n] == list(range(starts[e], starts[e] + n))
        first += n


def test_the_layout_runs_on_the_device_alone() -> None:
    """Meta tensors have no values: a host read (`tolist`, `item`, a data-dependent shape) would raise. The buffer's
    size comes from the shapes (T + 16 E rounded up to 16)."""
    lay = F.layout(torch.empty(64, dtype=torch.int64, device="meta"), 32768)
    assert lay.dest.device.type == "meta" and lay.dest.shape == (32768,) and lay.rows == 32768 + 16 * 64
    x = torch.empty(32768, 2048, device="meta")
    assert F.unpad(F.pad(x, lay), lay).shape == x.shape


def test_padding_round_trips_and_its_gradient_skips_the_padding() -> None:
    counts = torch.tensor([0, 5, 17])
    lay = F.layout(counts, 22)
    x = torch.randn(22, 16, requires_grad=True)
    p = F.pad(x, lay)
    mask = torch.zeros(lay.rows, dtype=torch.bool)
    mask[lay.dest] = True
    assert torch.equal(F.unpad(p, lay), x) and torch.count_nonzero(p[~mask]) == 0
    p.backward(torch.ones_like(p))
    assert torch.equal(x.grad, torch.ones_like(x))


def _gemm_case(counts: list[int], k: int = 64, n: int = 48, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    w = (torch.randn(len(counts), n, k, generator=g) * 0.05).bfloat16()
    dy = torch.randn(sum(counts), n, generator=g).bfloat16()
    return x, w, dy


@pytest.mark.parametrize("counts", [[0, 37, 5, 0, 100, 1, 16, 33], [64, 64]])
def test_the_three_gemms_match_bf16(counts: list[int]) -> None:
    x, w, dy = _gemm_case(counts)
    lay = F.layout(torch.tensor(counts), sum(counts))
    xf, wf = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
    y = F.unpad(F.fp8_gmm(F.pad(xf, lay), wf, lay.offs, fused=False), lay)
    y.backward(dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = G.gmm(xr, wr, torch.tensor(counts).cumsum(0).to(torch.int32))
    yr.backward(dy)
    assert y.dtype == torch.bfloat16 and wf.grad.dtype == torch.bfloat16
    assert rel_err(y, yr) < 0.06 and rel_err(xf.grad, xr.grad) < 0.06 and rel_err(wf.grad, wr.grad) < 0.06
    for e, c in enumerate(counts):
        if c == 0:  # an empty expert's weight gradient sums its 16 zero rows
            assert torch.count_nonzero(wf.grad[e]) == 0


def test_the_operands_pass_torchs_checks_and_a_row_major_weight_would_not() -> None:
    """Off CUDA every call goes through torch's meta checks of _scaled_grouped_mm first (shapes, strides, dtypes,
    scale shapes): the autograd function's three calls pass them; the second operand row-major is refused."""
    x, w, _ = _gemm_case([20, 12])
    lay = F.layout(torch.tensor([20, 12]), 32)
    wq, sw, _, _ = F.weight_cast(torch.nn.Parameter(w.clone()))
    xq, sx = F.rowwise_last(F.pad(x, lay)[None])
    F._meta_check(xq[0], wq.transpose(1, 2), sx[0], sw, lay.offs)  # the forward's call, as the function makes it
    with pytest.raises(RuntimeError, match="column major"):
        F._meta_check(xq[0], wq.transpose(1, 2).contiguous(), sx[0], sw, lay.offs)


def _layer(e: int = 8, h: int = 64, ffn: int = 32, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                          activation_func_clamp_value=None, glu_linear_offset=0.0)
    return SimpleNamespace(weight1=torch.nn.Parameter((torch.randn(e, 2 * ffn, h, generator=g) * 0.05).bfloat16()),
                           weight2=torch.nn.Parameter((torch.randn(e, h, ffn, generator=g) * 0.05).bfloat16()),
                           config=cfg, fp8_format=Formats.of("tensorwise", fused=False), grouped=True)


def test_the_expert_layer_in_fp8_matches_the_bf16_grouped_layer() -> None:
    counts = torch.tensor([0, 37, 5, 0, 100, 1, 16, 33])
    layer, t = _layer(), int(counts.sum())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, 64, generator=g).bfloat16().requires_grad_()
    probs = torch.rand(t, generator=g).requires_grad_()
    dy = torch.randn(t, 64, generator=g).bfloat16()
    y = fp8_forward(layer, x, counts, probs)
    y.backward(dy)
    xr, pr = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    w1, w2 = (w.detach().clone().requires_grad_() for w in (layer.weight1, layer.weight2))
    offs = counts.cumsum(0).to(torch.int32)
    yr = G.gmm((glu(G.gmm(xr, w1, offs), layer.config) * pr[:, None]).bfloat16(), w2, offs)
    yr.backward(dy)
    assert y.shape == yr.shape and rel_err(y, yr) < OUT_BOUND
    for got, ref in ((x.grad, xr.grad), (probs.grad, pr.grad), (layer.weight1.grad, w1.grad),
                     (layer.weight2.grad, w2.grad)):
        assert rel_err(got, ref) < GRAD_BOUND


def test_the_fp8_weight_is_cast_once_per_optimizer_step() -> None:
    w = torch.nn.Parameter(torch.randn(2, 32, 16).bfloat16())
    first = F.weight_cast(w)
    assert F.weight_cast(w)[0] is first[0]  # another micro-batch of the step
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()  # any torch optimizer's step
    w.data.mul_(2)
    again = F.weight_cast(w)
    assert again[0] is not first[0] and torch.allclose(again[1], 2 * first[1])
    assert first[0].shape == (2, 32, 16) and first[2].shape == (2, 16, 32) and first[2].is_contiguous()
    assert first[1].shape == (2, 32) and first[3].shape == (2, 16)


@pytest.mark.parametrize(("change", "capability", "says"), [
    ({}, (9, 0), None),
    ({}, (10, 0), None),
    ({}, (8, 9), "9.0 and 10.x"),
    ({}, (12, 0), "9.0 and 10.x"),
    ({}, None, "CUDA-only"),
    ({"dtype": torch.float32}, (9, 0), "bf16 only"),
    ({"ffn": 24}, (9, 0), "multiples of 16"),
    ({"grouped": False}, (9, 0), "grouped GEMM cannot"),
])
def test_where_the_experts_can_take_fp8(change: dict, capability: tuple[int, int] | None, says: str | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(F.OFF_ENV, "on")  # these tiny experts are fine-grained: forced (the rule below)
    layer = _layer(ffn=change.get("ffn", 32))
    layer.grouped = change.get("grouped", True)
    if "dtype" in change:
        layer.weight1 = torch.nn.Parameter(layer.weight1.float())
    why = F.refusal(layer, capability)
    assert why is None if says is None else says in (why or "")


def test_install_gives_the_experts_fp8_where_they_can_and_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core")
    from megalaunch.runtime.model import fp8_linear

    class Experts(torch.nn.Module):
        megalaunch_grouped_experts = True

        def __init__(self) -> None:
            super().__init__()
            layer = _layer()
            self.weight1, self.weight2, self.grouped, self.fp8_format = layer.weight1, layer.weight2, True, None

    model = torch.nn.Module()
    model.experts = Experts()
    fmt = Formats.of("tensorwise", fused=False)
    done, kept = fp8_linear.install(model, fmt)  # the CPU: kept in bf16, and why
    assert done == [] and "bf16 grouped GEMM (torch's scaled grouped GEMM is CUDA-only)" in kept["experts"]
    assert model.experts.fp8_format is None
    monkeypatch.setattr(F, "refusal", lambda module: None)  # a node that can (an H100/H200)
    done, kept = fp8_linear.install(model, fmt)
    assert done == ["experts"] and kept == {} and model.experts.fp8_format is fmt
    assert sorted(k for k, _ in model.experts.named_parameters()) == ["weight1", "weight2"]  # the checkpoint's
    monkeypatch.undo()
    monkeypatch.setenv(F.OFF_ENV, "off")
    assert "MEGALAUNCH_FP8_EXPERTS=off" in (F.refusal(model.experts, (9, 0)) or "")


def test_fine_grained_experts_stay_bf16_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 was measured slower for fine-grained experts (moe-3b's shape) and faster for Mixtral's."""
    monkeypatch.delenv(F.OFF_ENV, raising=False)
    fine = _layer(ffn=32)
    assert "fine-grained experts" in (F.refusal(fine, (9, 0)) or "")
    monkeypatch.setenv(F.OFF_ENV, "on")
    assert F.refusal(fine, (9, 0)) is None
    monkeypatch.delenv(F.OFF_ENV)
    coarse = torch.nn.Module()
    coarse.weight1 = torch.nn.Parameter(torch.empty(2, 4096, 2 * 4096, dtype=torch.bfloat16, device="meta"))
    coarse.weight2 = torch.nn.Parameter(torch.empty(2, 4096, 4096, dtype=torch.bfloat16, device="meta"))
    assert F.refusal(coarse, (9, 0)) is None
