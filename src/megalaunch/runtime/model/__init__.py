"""The model Megatron's loop trains: layer specs, the model class and the provider (`model`), the attention
implementations (`attention`: SDPA, flash-attn), megalaunch's norms in a spec (`norms`: the
sequence-parallel torch norm), which library computes each op (`kernels`: Megatron's or liger-kernel's,
`liger_layers`), the weight gradient accumulated in fp32 without apex (`wgrad_fusion`), FP8 GEMMs without
transformer-engine (`fp8`: the path and the scaling, `fp8_cast`: the Triton casts, `fp8_linear`: Megatron's
linear layers calling them), a one-process
parallel state for building the model outside the loop (`standalone`), Megatron imported without what
training does not need (`megatron_import`: compilation deferred, wandb kept out), and everything that
lets it run on a machine without a GPU (`cpu_compat`).

May use: runtime.rank."""
