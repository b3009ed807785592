"""Fixtures for the CPU tests that run Megatron's loop (`-m megatron`): run directories for the
`tiny` recipe made with the launcher's own functions, and trainer processes started the way the
launcher starts them (one process per rank, RANK/WORLD_SIZE/MASTER_* in the environment)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
