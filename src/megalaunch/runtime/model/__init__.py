"""The model Megatron's loop trains: layer specs and the provider with its attention choice (`model`),
which library computes each op (`kernels`: Megatron's or liger-kernel's, `liger_layers`), the weight
gradient accumulated in fp32 without apex (`wgrad_fusion`), and everything that lets it run on a machine
without a GPU (`cpu_compat`).

May use: runtime.rank."""
