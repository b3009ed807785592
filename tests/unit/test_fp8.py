"""`training.precision: fp8` without transformer-engine (runtime/model/fp8.py, fp8_linear.py): the scaling
logic, the GEMMs through torch._scaled_mm (its CPU kernels here; the GPU's are the same contract), the autograd
function that Megatron's linear layers call, and where the job refuses fp8. The wiring into a trained Megatron
model is tests/megatron/test_fp8_training.py."""

from __future__ import annotations

import pytest

from megalaunch.runtime.model import fp8
from megalaunch.runtime.rank.failures import ConfigFailure

torch = pytest.importorskip("torch")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_tensorwise_scale_maps_the_amax_onto_the_formats_largest_value(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 96, generator=g) * 3e-3  # far below fp8's range: the scale brings it up
    q, inv = fp8.quantize(t, dtype, rowwise=False)
    assert q.dtype == dtype and q.is_contiguous() and inv.shape == ()
    assert q.float().abs().max() == torch.finfo(dtype).max
    step = 2.0 ** -(3 if dtype == E4M3 else 2)  # mantissa bits: the rounding error is at most half a step
    assert (q.float() * inv - t).abs().max() <= step / 2 * t.abs().max() + 1e-12
    assert rel_err(q.float() * inv, t) < (0.04 if dtype == E4M3 else 0.08)


def test_rowwise_scales_each_row_and_a_zero_row_stays_zero() -> None:
    t = torch.randn(4, 32)
    t[1] *= 1e5  # an outlier row: under one scale the others fall into e4m3's subnormals
    t[2] = 0.0
    q, inv = fp8.quantize(t, E4M3, rowwise=True)
    assert inv.shape == (4, 1) and torch.isfinite(inv).all()
    amax_q = q.float().abs().amax(dim=1)
    assert amax_q[[0, 1, 3]].eq(torch.finfo(E4M3).max).all()
    assert q[2].float().eq(0).all()
    assert rel_err(q.float() * inv, t) < 0.04
    # one scale for the whole tensor loses the small rows to the outlier's range
    qt, invt = fp8.quantize(t, E4M3, rowwise=False)
    assert rel_err((qt.float() * invt)[0], t[0]) > 5 * rel_err((q.float() * inv)[0], t[0])


def test_a_transposed_view_is_cast_into_a_contiguous_tensor_with_the_same_scale() -> None:
    t = torch.randn(48, 80)
    q, inv = fp8.quantize(t.t(), E4M3, rowwise=False)
    q0, inv0 = fp8.quantize(t, E4M3, rowwise=False)
    assert q.is_contiguous() and q.shape == (80, 48)
    assert torch.equal(q.float(), q0.float().t()) and torch.equal(inv, inv0)


@pytest.mark.parametrize("rowwise", [False, True])
def test_both_layouts_are_scaled_along_their_own_rows_and_multiply_back(rowwise) -> None:
    """cast_both: the row-major cast and the transposed one, each with the scales its GEMM reduces along (rowwise:
    per row of the tensor, and per column for the transpose; tensorwise: one for both); each layout's product
    through `_scaled_mm` is the float product within FP8 rounding."""
    from megalaunch.runtime.model.fp8_cast import cast_both

    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 128, generator=g), torch.randn(32, 128, generator=g)
    a[3] *= 1e5  # one loud row: tensorwise pushes the others under e4m3's smallest values, rowwise does not
    qa, qat, sa, sat = cast_both(a, E4M3, triton=False, rowwise=rowwise)
    q0, s0 = fp8.quantize(a, E4M3, rowwise)
    assert torch.equal(qa.float(), q0.float()) and torch.equal(sa, s0)
    qt0, st0 = fp8.quantize(a.t(), E4M3, rowwise)
    assert qat.is_contiguous() and torch.equal(qat.float(), qt0.float()) and torch.equal(sat, st0)
    assert (sa.shape, sat.shape) == (((64, 1), (128, 1)) if rowwise else ((), ()))
    qb, _, sb, _ = cast_both(b, E4M3, triton=False, rowwise=rowwise)

    def col(s):
        return s.reshape(1, -1) if rowwise else s

    out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=col(sb), out_dtype=torch.float32)  # a @ b.T
    assert out.shape == (64, 32) and rel_err(out, a @ b.t()) < 0.06
    quiet = [i for i in range(64) if i != 3]
    quiet_err = rel_err(out[quiet], (a @ b.t())[quiet])
    assert quiet_err < 0.06 if rowwise else quiet_err > 0.06  # tensorwise: the loud row's scale costs the rest
    c = torch.randn(64, 48, generator=g)  # a.T @ c: the transposed layout, reduced over a's rows
    qc, _, sc, _ = cast_both(c.t().contiguous(), E4M3, triton=False, rowwise=rowwise)
    prod = torch._scaled_mm(qat, qc.t(), scale_a=sat, scale_b=col(sc), out_dtype=torch.float32)
    assert prod.shape == (128, 48) and rel_err(prod, a.t() @ c) < 0.06


def _linear(recipe: str, fusion: bool = False):
    from megalaunch.runtime.model.fp8_linear import forward_impl

    calls: list[str] = []

    def megatrons(input, weight, bias=None, **kw):
        calls.append("megatron")
        out = input @ weight.t()
        return out + bias if bias is not None else out

    return forward_impl(fp8.Formats.of(recipe, fused=False), megatrons), calls


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_layer_computes_the_linear_and_its_gradients_in_fp8(recipe) -> None:
    impl, calls = _linear(recipe)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 2, 64, generator=g, requires_grad=True)  # [sequence, batch, hidden]: 32 tokens
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    bias = torch.randn(48, generator=g, requires_grad=True)
    y = impl(input=x, weight=w, bias=bias)
    dy = torch.randn(16, 2, 48, generator=g)
    y.backward(dy)
    assert calls == []  # FP8, not Megatron's
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, bias))
    yr = xr @ wr.t() + br
    yr.backward(dy)
    assert y.shape == yr.shape and rel_err(y, yr) < 0.06
    assert rel_err(x.grad, xr.grad) < 0.12 and rel_err(w.grad, wr.grad) < 0.12
    assert torch.allclose(bias.grad, br.grad)  # the bias gradient is a sum, not a GEMM
    assert w.grad.dtype == w.dtype


def test_the_weight_gradient_accumulates_into_main_grad() -> None:
    impl, _ = _linear("tensorwise")
    x = torch.randn(32, 64)
    w = torch.randn(48, 64, requires_grad=True)
    w.main_grad = torch.zeros(48, 64)
    w.grad_added_to_main_grad = False
    for _ in range(2):  # two micro-batches
        impl(input=x, weight=w, gradient_accumulation_fusion=True).sum().backward()
    expected = 2 * torch.ones(32, 48).t() @ x
    assert rel_err(w.main_grad, expected) < 0.06
    assert w.grad_added_to_main_grad is True


def test_calls_it_does_not_cover_go_to_megatrons_implementation() -> None:
    impl, calls = _linear("tensorwise")
    w = torch.randn(48, 64, requires_grad=True)
    impl(input=torch.randn(10, 64), weight=w)  # 10 tokens: not a multiple of 16
    impl(input=torch.randn(32, 64), weight=w.detach())  # a frozen weight
    impl(input=torch.randn(32, 64), weight=w, grad_output_buffer=[])  # deferred embedding gradients
    assert calls == ["megatron"] * 3


@pytest.mark.parametrize(("recipe", "argv", "cpu", "capability", "path"), [
    (None, [], False, (9, 0), "off"),
    ("tensorwise", [], True, None, "torch_scaled_mm"),
    ("rowwise", [], False, (9, 0), "torch_scaled_mm"),
    ("tensorwise", [], False, (8, 9), "torch_scaled_mm"),
    ("tensorwise", ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], False, (9, 0), "transformer_engine"),
])
def test_the_fp8_path_per_node(recipe, argv, cpu, capability, path) -> None:
    choice = fp8.resolve_fp8(recipe, argv, cpu=cpu, capability=capability)
    assert choice.path == path and choice.why
    assert choice.fused_casts == (path == "torch_scaled_mm" and not cpu)
    record = choice.ledger()
    assert record["path"] == path and record["recipe"] == recipe


@pytest.mark.parametrize(("recipe", "capability", "has", "says", "fix"), [
    ("tensorwise", (8, 0), True, "compute capability 8.9 or later", "training.precision=bf16"),
    ("tensorwise", (9, 0), False, "torch._scaled_mm", "training.precision=bf16"),
    ("blockwise", (9, 0), True, "training.fp8_recipe", "training.fp8_recipe=tensorwise"),
])
def test_fp8_that_cannot_run_is_a_config_error_with_its_fix(recipe, capability, has, says, fix) -> None:
    with pytest.raises(ConfigFailure) as e:
        fp8.resolve_fp8(recipe, [], cpu=False, capability=capability, has_scaled_mm=has)
    assert says in str(e.value) and fix in (e.value.fix or "")


def test_the_cached_fp8_weight_is_recast_after_every_optimizer_step() -> None:
    """Tensorwise layers cast their weight once per optimizer step (micro-batches share it). As in Megatron's
    mixed precision, the optimizer updates a main copy and the model's weight is overwritten through `.data`
    (no version bump): the step of any torch optimizer makes the cache stale all the same."""
    impl, _ = _linear("tensorwise")
    w = torch.nn.Parameter(torch.randn(48, 64))
    main = torch.nn.Parameter(w.detach().clone())
    opt = torch.optim.SGD([main], lr=0.5)
    x = torch.randn(32, 64)
    for _ in range(3):
        y = impl(input=x, weight=w)
        assert rel_err(y, x @ w.detach().t()) < 0.06  # the weight of this step, not a cached older one
        y.square().sum().backward()
        main.grad = w.grad
        opt.step()
        w.data.copy_(main.data)
        w.grad = None
    impl(input=x, weight=w)
    cached = w._megalaunch_fp8[1][0]
    impl(input=x, weight=w)
    assert w._megalaunch_fp8[1][0] is cached  # within a step (no optimizer step since): cast once


@pytest.mark.parametrize("fmt", ["fp8e4nv", "fp8e5"])
def test_the_triton_cast_kernels_compile_for_hopper(fmt) -> None:
    """The GPU's casts (runtime/model/fp8_cast.py), tensorwise and rowwise, compiled to PTX for compute capability
    9.0 without a GPU: what Triton refuses (an unknown global, a bad annotation) fails here, not in the job. Their results are
    compared with torch's bit for bit on a GPU (tests/gpu/test_fp8_gpu.py)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megalaunch.runtime.model import fp8_cast

    amax, cast = fp8_cast._kernels()
    target = GPUTarget("cuda", 90, 32)
    ptx: list[str] = []
    sig = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    assert ".entry amax_kernel" in triton.compile(ASTSource(amax, sig, constexprs={"BLOCK": 4096}), target=target).asm["ptx"]
    sig = {"x_ptr": "*bf16", "q_ptr": f"*{fmt}", "qt_ptr": f"*{fmt}", "amax_ptr": "*fp32", "inv_ptr": "*fp32",
           "rows": "i32", "cols": "i32", "FMAX": "constexpr", "EPS": "constexpr", "T": "constexpr"}
    consts = {"FMAX": 448.0, "EPS": 1e-12, "T": fp8_cast.TILE}
    ptx.append(triton.compile(ASTSource(cast, sig, constexprs=consts), target=target).asm["ptx"])
    assert ".entry cast_kernel" in ptx[-1]
    amax_rc, cast_rc = fp8_cast._rowwise_kernels()
    sig = {"x_ptr": "*bf16", "ramax_ptr": "*fp32", "camax_ptr": "*fp32", "rows": "i32", "cols": "i32",
           "T": "constexpr"}
    src = ASTSource(amax_rc, sig, constexprs={"T": fp8_cast.TILE})
    assert ".entry amax_rc_kernel" in triton.compile(src, target=target).asm["ptx"]
    sig = {"x_ptr": "*bf16", "q_ptr": f"*{fmt}", "qt_ptr": f"*{fmt}", "ramax_ptr": "*fp32", "camax_ptr": "*fp32",
           "rinv_ptr": "*fp32", "cinv_ptr": "*fp32", "rows": "i32", "cols": "i32", "FMAX": "constexpr",
           "EPS": "constexpr", "T": "constexpr"}
    ptx.append(triton.compile(ASTSource(cast_rc, sig, constexprs=consts), target=target).asm["ptx"])
    assert ".entry cast_rc_kernel" in ptx[-1]
    # the scales divide as torch does (IEEE, div.rn): Triton's `/` is the approximate div.full.f32, whose scale
    # moved a few e4m3 values across a rounding boundary against torch's on an H200
    assert all("div.rn.f32" in p and "div.full.f32" not in p for p in ptx)
