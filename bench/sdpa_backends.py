"""torch SDPA backends side by side on one GPU: forward + backward of causal attention at a model's shape.

    python bench/sdpa_backends.py                      # llama3-8b: 32 heads, 8 KV heads, head 128, seq 8192
    python bench/sdpa_backends.py --heads 16 --kv-heads 4 --seq 4096

Each backend runs alone (torch.nn.attention.sdpa_kernel), with GQA native (enable_gqa) and with the KV
heads expanded; one that cannot take the inputs says why. TFLOP/s counts the causal half of the
score and value matmuls, forward (2) and backward (5 with recompute of the scores)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def cuda_ms(step: Callable[[], None], iters: int) -> float:
    """Milliseconds per call of `step`, timed with CUDA events over `iters` calls."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--contiguous", action="store_true", help="[b, heads, s, d] tensors, not Megatron's views")
    p.add_argument("--model", action="store_true", help="also megalaunch's SDPA module, both backend orders")
    a = p.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    b, h, kvh, d, s = a.batch, a.heads, a.kv_heads, a.head_dim, a.seq
    # As Megatron's attention hands them over: [s, b, heads, d] viewed as [b, heads, s, d] (--contiguous: not)
    shape = (b, h, s, d) if a.contiguous else (s, b, h, d)
    order = (0, 1, 2, 3) if a.contiguous else (1, 2, 0, 3)
    q = torch.randn(*shape, device=dev, dtype=torch.bfloat16).permute(*order).requires_grad_()
    k = torch.randn(*shape[:2], kvh, d, device=dev, dtype=torch.bfloat16).permute(*order).requires_grad_() \
        if not a.contiguous else torch.randn(b, kvh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k).requires_grad_()
    grad = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
    flops = 4 * b * h * s * s * d * 0.5 * (1 + 2.5)  # causal: half of QK^T and PV; backward 2.5x forward
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: batch {b}, heads {h}/{kvh}, head {d}, seq {s}, "
          f"{'contiguous' if a.contiguous else 'views of [s, b, heads, d] as Megatron hands them over'}")
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1))

            def step(name: str = name, kk: torch.Tensor = kk, vv: torch.Tensor = vv, gqa: bool = gqa) -> None:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa and h != kvh)
                out.backward(grad)

            label = f"{name.lower():22s} {'GQA native' if gqa else 'KV expanded':12s}"
            try:
                step()
                torch.cuda.synchronize()
            except RuntimeError as e:
                print(f"{label} unavailable: {str(e).splitlines()[0][:100]}")
                continue
            ms = cuda_ms(step, a.iters)
            print(f"{label} {ms:8.2f} ms fwd+bwd  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    if a.model:
        model_attention(a)
    return 0


def model_attention(a: argparse.Namespace) -> None:
    """megalaunch's SDPA core attention as the model runs it (Megatron's [s, b, heads, d] inputs), with
    torch's default backend order and with MEGALAUNCH_SDPA_BACKENDS=cudnn first: time and kernels. (The
    5.61 ms of docs/results.md for the second was measured with a KV-head expansion since dropped.)"""
    import os

    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
    from megalaunch.runtime.model import attention, standalone

    with standalone.megatron_parallel_state():
        cfg = TransformerConfig(num_layers=1, hidden_size=a.heads * a.head_dim, num_attention_heads=a.heads,
                                num_query_groups=a.kv_heads, bf16=True, params_dtype=torch.bfloat16)
        shape = (a.seq, a.batch, a.heads, a.head_dim)
        q = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(a.seq, a.batch, a.kv_heads, a.head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        for env in ("", "cudnn_attention,flash_attention,efficient_attention"):
            os.environ[attention.SDPA_BACKENDS_ENV] = env
            attn = attention.sdpa_attention_class()(cfg, 1, AttnMaskType.causal, "self")

            def step(attn: torch.nn.Module = attn) -> None:
                out = attn(q, k, v, None)
                out.backward(torch.ones_like(out))

            step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            kernels = sorted({e.name[:60] for e in prof.events() if "attention" in e.name.lower()
                              or "fmha" in e.name.lower() or "cudnn" in e.name.lower() or "flash" in e.name.lower()})
            print(f"model SDPA, {attention.SDPA_BACKENDS_ENV}={env or '(unset)'}: {cuda_ms(step, a.iters):.2f} ms "
                  f"fwd+bwd; kernels: {kernels}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
