"""The CPU tests that run Megatron (`-m megatron`; their harness is tests/megatron/harness.py): collected
only where the [train] extra is installed."""

from __future__ import annotations

import importlib.util

# Without the [train] extra nothing here is collected. Checked without importing torch or Megatron (~7 CPU-s
# in every pytest-xdist worker's collection; the tests that need them in the test process import them).
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None:
    collect_ignore_glob = ["*.py"]
