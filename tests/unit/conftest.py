"""Fixtures shared by modules of tests/unit."""

from __future__ import annotations

import pytest

from megalaunch.rundir.paths import RunPaths

#: the tests that read the report chain (tests/unit/report_chain.py) run on one worker, which builds it once
REPORT_CHAIN_GROUP = pytest.mark.xdist_group("report-chain")


@pytest.fixture(scope="session")
def report_chain(tmp_path_factory: pytest.TempPathFactory) -> RunPaths:
    """A real 3-segment local chain of the counter workload (~20 s of paced steps): read it, or copy it first
    (`copy_run`) to write into it."""
    from tests.unit.report_chain import build_chain

    return build_chain(tmp_path_factory.mktemp("report-chain"))
