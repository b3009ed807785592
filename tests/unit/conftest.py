"""Fixtures shared by modules of tests/unit."""

from __future__ import annotations

import pytest

from megalaunch.rundir.paths import RunPaths


@pytest.fixture(scope="session")
def report_chain(tmp_path_factory: pytest.TempPathFactory) -> RunPaths:
    """A real local chain of the counter workload (~20 s of paced steps), built once per worker: its readers
    carry `report_chain.REPORT_CHAIN_GROUP` (one worker); a test that writes into it copies it first."""
    from tests.unit.report_chain import build_chain

    return build_chain(tmp_path_factory.mktemp("report-chain"))
