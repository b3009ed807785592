"""megalaunch: launch Megatron-core training chains on Slurm clusters."""

__version__ = "0.1.0"
