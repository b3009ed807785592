"""liger-kernel's fused ops against Megatron's unfused ones, forward and backward, and a short training run
with each kernel choice (run on the device; one GPU; liger's Triton kernels need CUDA).

Tolerances (max abs difference over the reference's max abs value, per output and per gradient):
fp32 1e-5 (norm, rotation, SwiGLU: the same arithmetic in another order; the fused loss 1e-4: its chunked
logits sum in another order), bf16 2e-2 (one to a few bf16 roundings, 2^-8 = 3.9e-3 each, in
different places). Training: the tiny model, 30 iterations, liger's losses within 1e-4 relative of
Megatron's in fp32 and 2e-2 in bf16, at every iteration.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_kernels_gpu.py -s"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")
pytest.importorskip("liger_kernel")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from harness import Trainer, ledger, losses, make_run  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _compare(name: str, dtype: torch.dtype, ref: list[torch.Tensor], got: list[torch.Tensor], tol: float) -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        err = ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-12)).item()
        print(f"[{name} {str(dtype).split('.')[-1]} #{i}] relative max error {err:.2e} (bound {tol:.0e})")
        assert err <= tol, (name, dtype, i, err)


def _grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(7)
    total = sum((o.float() * torch.randn_like(o.float())).sum() for o in outs)
    total.backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm(dtype: torch.dtype) -> None:
    """torch's RMSNorm (what Megatron's local spec builds) vs liger's, as megalaunch builds it."""
    from megalaunch.runtime.model import liger_layers

    class Cfg:
        normalization, layernorm_zero_centered_gamma, sequence_parallel = "RMSNorm", False, False

    x = torch.randn(256, 2, 2048, device="cuda", dtype=dtype)
    w = 1 + 0.1 * torch.randn(2048, device="cuda", dtype=dtype)

    def run(norm: torch.nn.Module) -> list[torch.Tensor]:
        norm = norm.cuda().to(dtype)
        norm.weight.data.copy_(w)
        leaf = x.detach().clone().requires_grad_()
        out = norm(leaf)
        torch.manual_seed(7)
        (out.float() * torch.randn_like(out.float())).sum().backward()
        return [out.detach(), leaf.grad, norm.weight.grad]

    ref = run(torch.nn.RMSNorm(2048, eps=1e-5))
    _compare("rmsnorm", dtype, ref, run(liger_layers.norm_class()(Cfg(), 2048, eps=1e-5)), TOL[dtype])


@pytest.fixture
def parallel_state():
    """Megatron's one-process parallel state: the rotary embedding and its application ask for the CP group."""
    from megalaunch.runtime.model.standalone import megatron_parallel_state

    with megatron_parallel_state():
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "groups", "d"), [(32, 8, 64), (32, 8, 128), (28, 4, 128), (16, 16, 64), (14, 2, 64)])
def test_rope(dtype: torch.dtype, heads: int, groups: int, d: int, parallel_state: None) -> None:
    """Megatron's split of the fused QKV and its unfused rotation vs the seam liger fills: llama3-1b's GQA
    (32/8, d 64), llama3-8b's (d 128), Qwen2.5-7B's 7:1, multi-head (16/16) and 7:1 at d 64."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megalaunch.runtime.model import liger_layers

    s, b, per = 512, 2, heads // groups
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups)
    freqs = RotaryEmbedding(d, rotary_percent=1.0, rotary_base=500000).cuda()(s)
    split = [per * d, d, d]
    mixed = torch.randn(s, b, groups, (per + 2) * d, device="cuda", dtype=dtype)

    def megatron(m: torch.Tensor):
        q, k, v = torch.split(m, split, dim=3)
        q = q.reshape(s, b, -1, d)
        return apply_rotary_pos_emb(q, freqs, cfg), apply_rotary_pos_emb(k, freqs, cfg), v

    def liger(m: torch.Tensor):
        return liger_layers.rope_qkv(m, freqs, freqs, split)

    _compare("rope", dtype, _grads(megatron, mixed), _grads(liger, mixed), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype: torch.dtype) -> None:
    """Megatron's fused (torch.compile'd) bias-SwiGLU and its unfused glu vs liger's fused gate-up."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from megalaunch.runtime.model import liger_layers

    y = torch.randn(512, 2, 2 * 8192, device="cuda", dtype=dtype)

    def unfused(t: torch.Tensor):
        gate, up = torch.chunk(t, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    ref = _grads(unfused, y)
    _compare("swiglu-megatron-fused", dtype, ref, _grads(lambda t: bias_swiglu_impl(t, None), y), TOL[dtype])
    _compare("swiglu", dtype, ref, _grads(liger_layers.swiglu, y), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 128256, 151936])
def test_linear_cross_entropy(dtype: torch.dtype, vocab: int) -> None:
    """The output layer and the cross entropy unfused (logits materialised, fp32 softmax, as Megatron's)
    vs liger's fused linear cross entropy through megalaunch's loss (runtime/liger_layers.fused_loss),
    10 % of the labels masked."""
    from megalaunch.runtime.model import liger_layers

    s, b, h = 1000, 2, 2048  # 2000 rows: a full chunk of 1024 and a partial one
    torch.manual_seed(0)
    hidden = torch.randn(s, b, h, device="cuda", dtype=dtype)
    weight = 0.02 * torch.randn(vocab, h, device="cuda", dtype=dtype)
    labels = torch.randint(0, vocab, (b, s), device="cuda")
    mask = (torch.rand(b, s, device="cuda") > 0.1).float()

    def unfused(x: torch.Tensor, w: torch.Tensor):
        logits = (x @ w.t()).float()  # [s, b, vocab]
        losses = torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
        return (losses * mask).sum()

    def liger(x: torch.Tensor, w: torch.Tensor):
        return (liger_layers.fused_loss(x, w, labels.masked_fill(mask == 0, -100)) * mask).sum()

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
        out = fn(*leaves)
        out.backward()
        return [out.detach(), *(t.grad for t in leaves)]

    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    _compare("linear_ce", dtype, grads(unfused), grads(liger), tol)


def _train(root: Path, kernels: str, precision: str) -> tuple[dict[int, float], list]:
    paths = make_run(root, "cluster.gpus_per_node=1", f"training.precision={precision}", "training.attention=sdpa",
                     f"training.kernels={kernels}", "training.train_iters=30", "training.lr=3e-3",
                     "training.lr_warmup_iters=2", "checkpoint.save_interval=1000", name=f"k-{kernels}")
    log = root / "loss.jsonl"
    t = Trainer(paths, world=1, env={"MEGALAUNCH_LOSS_LOG": str(log)})
    assert t.wait(timeout=300) == [0], t.log()[-4000:]
    assert t.outcome()["status"] == "finished", t.log()[-4000:]
    return losses(log), ledger(paths, "kernels")


@pytest.mark.parametrize(("precision", "bound"), [("fp32", 1e-4), ("bf16", 2e-2)])
def test_training_with_liger_matches_megatron(tmp_path: Path, precision: str, bound: float) -> None:
    plain, plain_ledger = _train(tmp_path / "megatron", "megatron", precision)
    fused, fused_ledger = _train(tmp_path / "liger", "liger", precision)
    assert plain_ledger[-1]["chosen"] == "megatron"
    assert fused_ledger[-1]["chosen"] == "liger"
    assert sorted(fused_ledger[-1]["liger_ops"]) == ["linear_ce", "rmsnorm", "rope", "swiglu"]
    # liger's run also takes the weight gradients straight into fp32 main_grad (runtime/model/wgrad_fusion.py)
    assert fused_ledger[-1]["wgrad_fusion"].startswith("on") and plain_ledger[-1]["wgrad_fusion"].startswith("off")
    assert sorted(plain) == sorted(fused) == list(range(1, 31))
    worst = max(abs(plain[i] - fused[i]) / abs(plain[i]) for i in plain)
    print(f"\n[tiny model, {precision}, {torch.cuda.get_device_name()}] loss {plain[1]:.4f} -> {plain[30]:.4f}; "
          f"liger vs megatron: max relative loss difference {worst:.2e} (bound {bound:.0e})")
    assert plain[30] < plain[1] - 0.5  # it learns
    assert worst < bound
