"""Code that runs inside the job. Small, explicit, rank-aware; imports nothing from the CLI or
launcher, and nothing heavy at import time."""
