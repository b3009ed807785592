"""megalaunch's own mixture-of-experts expert layer for Megatron's `MoELayer` on the local spec (no
transformer-engine): all local experts' weights in one 3D parameter per linear layer and torch's grouped GEMM
(`torch.nn.functional.grouped_mm`) instead of `SequentialMLP`'s Python loop of one GEMM per expert and its
host sync (`tokens_per_expert.tolist()`).

- `gmm`:     the grouped GEMM as an autograd function (forward, input and weight gradients), with a per-group
             loop where torch has no grouped GEMM for these operands (old torch, unaligned strides);
- `grouped`: `GroupedExperts`, the module (weights, initialisation, forward) that replaces `SequentialMLP`;
- `fp8`:     the same GEMMs in FP8 under `precision: fp8` (torch's scaled grouped GEMM, rowwise e4m3), with the
             rows padded per expert to multiples of 16 on the device;
- `sharded`: its distributed-checkpoint layout, which is `SequentialMLP`'s key for key, so a checkpoint
             saved with either class loads into the other.

Which class a model gets is decided with the other kernels (runtime/model/kernels.py, `KernelChoice.experts`).

May use: runtime.rank (like the rest of runtime/model). Heavy imports (torch, megatron) inside functions."""
