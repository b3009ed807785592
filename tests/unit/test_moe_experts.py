"""The grouped experts' GEMM (runtime/model/experts/gmm.py) against a loop over the experts, on the CPU in fp32:
forward, input and weight gradients, empty experts, unaligned shapes (the loop fallback). No Megatron."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from megalaunch.runtime.model.experts import gmm as gmm_mod  # noqa: E402
from megalaunch.runtime.model.experts.grouped import glu, refusal  # noqa: E402


def _reference(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.cat([chunk @ w[e].t() for e, chunk in enumerate(torch.split(x, sizes))])


def _case(sizes: list[int], k: int = 16, n: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), k, generator=g, requires_grad=True)
    w = torch.randn(len(sizes), n, k, generator=g, requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return x, w, offs


@pytest.mark.parametrize("sizes", [[3, 5, 2, 6], [0, 7, 0, 9], [4, 0, 0, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("grouped", [True, False])
def test_gmm_matches_a_loop_forward_and_backward(sizes: list[int], grouped: bool) -> None:
    x, w, offs = _case(sizes)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dy = torch.randn(sum(sizes), w.shape[1], generator=torch.Generator().manual_seed(1))
    y = gmm_mod.gmm(x, w, offs, grouped)
    ref = _reference(xr, wr, sizes) if sum(sizes) else xr @ wr[0].t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y * dy).sum().backward()
    (ref * dy).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    # an expert without tokens gets a zero weight gradient (the reference's is None or zero for it)
    torch.testing.assert_close(w.grad, wr.grad if wr.grad is not None else torch.zeros_like(w), rtol=1e-5, atol=1e-5)
    for e, n in enumerate(sizes):
        if n == 0:
            assert torch.count_nonzero(w.grad[e]) == 0


def test_unaligned_shapes_take_the_loop() -> None:
    """Rows of 6 fp32 values (24 bytes) are not 16-byte aligned: grouped_mm refuses them, the loop computes."""
    x, w, offs = _case([2, 3], k=6, n=3)
    assert not gmm_mod.shapes_fit(6, 3, torch.float32) and gmm_mod.shapes_fit(64, 32, torch.bfloat16)
    y = gmm_mod.gmm(x, w, offs)
    torch.testing.assert_close(y, _reference(x, w, [2, 3]))
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


def test_the_grouped_call_runs_without_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Aligned operands never reach the loop (whose `tolist` is the host sync the grouped call avoids)."""
    if gmm_mod.grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped_mm")

    def no_sync(offs: torch.Tensor) -> list[int]:
        raise AssertionError("the loop ran")

    monkeypatch.setattr(gmm_mod, "_sizes", no_sync)
    x, w, offs = _case([3, 5, 0, 6])
    gmm_mod.gmm(x, w, offs).sum().backward()
    assert x.grad is not None and w.grad is not None


class _Cfg:
    gated_linear_unit = True
    activation_func = staticmethod(torch.nn.functional.silu)
    activation_func_clamp_value = None
    glu_linear_offset = 0.0
    add_bias_linear = False
    moe_latent_size = None


def test_glu_is_mlps_swiglu_and_biases_are_refused() -> None:
    h = torch.randn(4, 8)
    torch.testing.assert_close(glu(h, _Cfg()), torch.nn.functional.silu(h[:, :4]) * h[:, 4:])
    assert refusal(_Cfg()) is None
    biased = _Cfg()
    biased.add_bias_linear = True
    assert "disable_bias_linear" in (refusal(biased) or "")


def test_fp8_keeps_the_grouped_experts_in_bf16_and_says_so() -> None:
    """training.precision: fp8 installs FP8 GEMMs on Megatron's linear layers; the grouped experts have none (FP8
    grouped GEMMs are not implemented yet), and fp8's kept-list in the ledger names them with why."""
    pytest.importorskip("megatron.core")
    from megalaunch.runtime.model import fp8_linear
    from megalaunch.runtime.model.fp8 import Formats

    class Experts(torch.nn.Module):
        megalaunch_grouped_experts = True

    model = torch.nn.Module()
    model.experts = Experts()
    done, kept = fp8_linear.install(model, Formats.of("rowwise", fused=False))
    assert done == [] and "bf16 grouped GEMM" in kept["experts"]
