"""The gather-based dropless permutation (runtime/model/experts/permute.py) against Megatron's own `permute` /
`unpermute`: the same rows in the same expert order, the same probabilities, each token's output the sum of its k
rows, and the same gradients (fp32 on the CPU); only the all-to-all dispatcher's dropless calls take it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

from megalaunch.runtime.model.experts import permute as ours  # noqa: E402

pytestmark = [pytest.mark.megatron]


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[object, object]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    top = logits.topk(k, dim=-1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(logits, -1) * routing
    return routing, probs


@pytest.mark.parametrize(("tokens", "experts", "k"), [(37, 8, 2), (64, 64, 8), (5, 4, 4), (1, 16, 1)])
def test_dropless_permutation_equals_megatrons(tokens: int, experts: int, k: int) -> None:
    routing, probs = _routing(tokens, experts, k, seed=tokens + experts)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    rows1, p1, idx1, _, _ = moe_utils.permute(x1, routing, probs=probs, num_out_tokens=tokens * k)
    rows2, p2, idx2 = ours.permute_dropless(x2, routing, probs, k)
    assert torch.equal(idx1, idx2) and torch.equal(rows1, rows2) and torch.equal(p1, p2)
    weight = torch.randn(rows1.shape, generator=torch.Generator().manual_seed(2))  # what the experts would do
    out1 = moe_utils.unpermute(rows1 * weight, idx1, restore_shape=x.shape)
    out2 = ours.combine_dropless(rows2 * weight, idx2)
    torch.testing.assert_close(out2, out1, rtol=1e-6, atol=1e-6)
    up = torch.randn(out1.shape, generator=torch.Generator().manual_seed(3))
    (out1 * up).sum().backward()
    (out2 * up).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-6, atol=1e-6)


def test_only_the_all_to_all_dropless_calls_are_taken() -> None:
    td = pytest.importorskip("megatron.core.transformer.moe.token_dispatcher")
    assert ours.install() and ours.install()  # idempotent
    routing, probs = _routing(12, 4, 2, seed=0)
    x = torch.randn(12, 8)
    # outside the all-to-all dispatcher's preprocess (the all-gather dispatcher, token dropping): Megatron's
    _, _, idx, _, _ = td.permute(x, routing, probs=probs, num_out_tokens=24)
    assert getattr(idx, ours.INVERSE, None) is None
    ours._ROUTING.topk = 2
    try:
        _, _, idx, _, _ = td.permute(x, routing, probs=probs, num_out_tokens=24)
        assert getattr(idx, ours.INVERSE).shape == (12, 2)
        _, _, idx, _, _ = td.permute(x, routing, probs=probs, num_out_tokens=20)  # a count that is not T x k
        assert getattr(idx, ours.INVERSE, None) is None
    finally:
        ours._ROUTING.topk = None


def test_fused_swiglu_probs_matches_the_unfused_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused activation's hand-written backward (runtime/model/experts/activation.py) against autograd of
    MLP's unfused SwiGLU times the probabilities (fp64 on the CPU; torch.compile left out: the GPU compiles it)."""
    from megalaunch.runtime.model.experts import activation

    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    monkeypatch.setattr(activation, "_FUNCTION", [])
    g = torch.Generator().manual_seed(4)
    h = torch.randn(29, 2 * 12, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(29, generator=g, dtype=torch.float64, requires_grad=True)
    h2, probs2 = h.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    gate, up = torch.chunk(h, 2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up * probs.unsqueeze(-1)
    out = activation.swiglu_probs(h2, probs2)
    torch.testing.assert_close(out, ref)
    up_grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref * up_grad).sum().backward()
    (out * up_grad).sum().backward()
    torch.testing.assert_close(h2.grad, h.grad)
    torch.testing.assert_close(probs2.grad, probs.grad)


def test_the_identity_chunk_sort_is_skipped_and_a_real_one_is_not() -> None:
    td = pytest.importorskip("megatron.core.transformer.moe.token_dispatcher")
    assert ours.install()
    rows, probs = torch.randn(10, 4), torch.rand(10)
    out, out_probs = td.sort_chunks_by_idxs(rows, torch.tensor([3, 0, 7]), torch.arange(3), probs=probs)
    assert out is rows and out_probs is probs  # no copy
    out, out_probs = td.sort_chunks_by_idxs(rows, torch.tensor([3, 0, 7]), torch.tensor([2, 0, 1]), probs=probs)
    assert torch.equal(out, torch.cat([rows[3:], rows[:3]])) and torch.equal(out_probs, torch.cat([probs[3:], probs[:3]]))
