"""Gradient-accumulation fusion without apex (runtime/model/wgrad_fusion.py): Megatron's linear layers, wrapped in its
DistributedDataParallel as training wraps them, put the same gradients into `main_grad` over two accumulated
micro-batches with the fusion (megalaunch's module under apex's name) as without it (a weight gradient in the
parameters' dtype, then the add into fp32). fp32 parameters: the same sums in another order (bound 1e-5);
bf16: the fp32-output matmul against a bf16 gradient rounded before the add (bound 2e-2). On the GPU (Megatron's
fused path allocates its placeholder gradient on CUDA)."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("megatron.core")
pytestmark = pytest.mark.gpu


def _main_grads(fusion: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megalaunch.config.schema import ModelConfig
    from megalaunch.conversion.model import build_gpt_model
    from megalaunch.runtime.model.standalone import megatron_parallel_state

    shape = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                        seq_length=32, max_position_embeddings=32, make_vocab_size_divisible_by=64,
                        normalization="RMSNorm", swiglu=True, position_embedding_type="rope")
    with megatron_parallel_state():
        torch.manual_seed(0)
        model = build_gpt_model(shape, vocab_size=200, params_dtype=dtype, gradient_accumulation_fusion=fusion).cuda()
        ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True), module=model)
        ddp.zero_grad_buffer()
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):  # two micro-batches accumulate into main_grad
            tokens = torch.randint(0, 200, (2, 32), generator=gen).cuda()
            labels = torch.randint(0, 200, (2, 32), generator=gen).cuda()
            logits = ddp(tokens, torch.arange(32, device="cuda").expand(2, 32), None)
            torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels).backward()
        ddp.finish_grad_sync()
        return {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_weight_gradients_equal_megatron_s_accumulated_ones(monkeypatch, dtype, bound) -> None:
    from megalaunch.runtime.model import wgrad_fusion

    layers = pytest.importorskip("megatron.core.tensor_parallel.layers")
    monkeypatch.delitem(sys.modules, wgrad_fusion.MODULE, raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    calls = []
    plain = _main_grads(fusion=False, dtype=dtype)
    assert wgrad_fusion.install()
    module = sys.modules[wgrad_fusion.MODULE]
    monkeypatch.setattr(module, "wgrad_gemm_accum_fp32",
                        lambda *a: calls.append(1) or wgrad_fusion.wgrad_gemm_accum_fp32(*a))
    fused = _main_grads(fusion=True, dtype=dtype)
    monkeypatch.delitem(sys.modules, wgrad_fusion.MODULE)
    # every linear layer's weight (qkv, proj, fc1, fc2 per layer, and the output layer) per micro-batch
    assert len(calls) == 2 * (4 * 2 + 1), len(calls)
    assert sorted(plain) == sorted(fused)
    for name in plain:
        scale = plain[name].abs().max().clamp(min=1e-12)
        err = ((plain[name] - fused[name]).abs().max() / scale).item()
        print(f"[wgrad fusion {str(dtype).split('.')[-1]}] {name}: relative max difference {err:.1e} (bound {bound:.0e})")
        assert err < bound, name
