"""The model's shape beyond the dense transformer: mixture-of-experts fields, their rules and their Megatron flags
(moe.py). Standard library only: the CLI imports it on the login node."""
