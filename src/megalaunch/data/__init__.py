"""Megatron `.bin/.idx` datasets: index headers, validation, blends and mixtures.

Nothing here imports torch; `index` and `blend` need only the standard library, so the training
submit can resolve a blend on a login node."""
