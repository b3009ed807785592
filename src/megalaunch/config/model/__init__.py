"""The model's shape beyond the dense transformer: mixture-of-experts fields (moe.py) and multi-latent attention
(mla.py), their rules and their Megatron flags. Standard library only: the CLI imports it on the login node."""
