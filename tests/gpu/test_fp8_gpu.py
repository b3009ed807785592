"""`training.precision: fp8` on a GPU (runtime/model/fp8.py; skipped without CUDA or FP8 tensor cores): the
tiny recipe in fp8, tensorwise and rowwise, with torch.compile'd casts, stopped twice by SIGUSR2 and resumed
at the iteration it stopped, with the losses of an uninterrupted fp8 run; the ledger names the path. The speed
and the 1B loss curves are bench/fp8.py (docs/results.md, "FP8 without transformer-engine").

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_fp8_gpu.py -s"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)", allow_module_level=True)
pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from harness import ledger, losses, make_run  # noqa: E402
from test_train_gpu import GPU, _segments  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_signal_resume(tmp_path: Path, recipe: str) -> None:
    sets = (*GPU, "training.precision=fp8", f"training.fp8_recipe={recipe}", "training.train_iters=40",
            "checkpoint.save_interval=1000", "training.attention=sdpa", "training.lr_warmup_iters=2")
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "chain.jsonl"
    straight = make_run(tmp_path / "a", *sets, name="straight")
    (ref,) = _segments(straight, ref_log, (None,), 100)
    [choice] = ledger(straight, "fp8")
    assert (choice["path"], choice["recipe"], choice["fused_casts"]) == ("torch_scaled_mm", recipe, True)
    assert ledger(straight, "fp8_layers")[0]["fp8"] == 8
    chain = make_run(tmp_path / "b", *sets, name="chain")
    outs = _segments(chain, log, (10, 10, None), 200)
    assert ref["status"] == outs[-1]["status"] == "finished"
    stops = [o["iteration"] for o in outs[:2]]
    assert [r["iteration"] for r in ledger(chain, "resumed")] == stops
    a, b = losses(ref_log), losses(log)
    assert sorted(a) == sorted(b) == list(range(1, 41))
    worst = max(abs(a[i] - b[i]) / abs(a[i]) for i in a)
    print(f"\n[tiny fp8 {recipe}] stops at {stops}; max relative loss difference vs uninterrupted: {worst:.2e}")
    assert worst < 2e-2  # as bf16's (tests/gpu/test_train_gpu.py): GPU kernels need not be bit-reproducible


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("shape", [(8192, 2048), (1000, 3000), (64, 16)])
def test_triton_casts_are_torchs(dtype: str, shape: tuple[int, int], rowwise: bool) -> None:
    """The Triton kernels (runtime/model/fp8_cast.py) give torch's cast bit for bit, in both layouts (rowwise:
    each with its own scales), at shapes that fill, overhang and undershoot their tiles."""
    from megalaunch.runtime.model import fp8_cast

    t = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 7
    t[1] *= 40  # a loud row and column: the rowwise scales differ
    t[:, 2] *= 25
    fmt = getattr(torch, dtype)
    q, qt, inv, inv_t = fp8_cast.cast_both_triton(t, fmt, rowwise)
    q0, qt0, inv0, inv_t0 = fp8_cast.cast_both_torch(t, fmt, rowwise)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), qt0.view(torch.uint8))
    assert inv.shape == inv0.shape and inv_t.shape == inv_t0.shape
    assert torch.allclose(inv, inv0, rtol=1e-6) and torch.allclose(inv_t, inv_t0, rtol=1e-6)
