"""The suite's parallel runs keep a group of tests on one worker (tests/conftest.py, tests/support/schedule.py):
an `xdist_group` marker, and a module whose tests share a module-scoped fixture (built once). pytest 9.2
silently broke pytest-xdist's own grouping (its "@group" id suffix no longer reaches the scheduler): a
real `pytest -n 2` run on a synthetic tree, with this suite's hooks, shows where each test ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")
REPO = Path(__file__).resolve().parents[2]

CONFTEST = """
import tests.conftest as suite
globals().update({name: getattr(suite, name) for name in dir(suite) if name.startswith("pytest_")})  # its hooks
"""
RECORD = """
import json, os, pytest
from pathlib import Path

def record(name):
    with open(os.environ["WHERE"], "a") as f:
        f.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def test_grouped_tests_run_on_one_worker(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "conftest.py").write_text(CONFTEST)
    (tree / "record.py").write_text(RECORD)
    (tree / "test_marked.py").write_text(textwrap.dedent("""
        import pytest
        from record import record
        pytestmark = pytest.mark.xdist_group("marked")
        @pytest.mark.parametrize("i", range(6))
        def test_marked(i):
            record(f"marked{i}")
    """))
    (tree / "test_shared.py").write_text(textwrap.dedent("""
        import pytest
        from record import record
        @pytest.fixture(scope="module")
        def built():
            record("built")
            return 1
        @pytest.mark.parametrize("i", range(6))
        def test_shared(built, i):
            record(f"shared{i}")
    """))
    (tree / "test_free.py").write_text(textwrap.dedent("""
        import pytest
        from record import record
        @pytest.mark.parametrize("i", range(12))
        def test_free(i):
            record(f"free{i}")
    """))
    where = tmp_path / "where.jsonl"
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": f"{REPO}{os.pathsep}{tree}"}
    env.pop("MEGALAUNCH_TEST_CPU_LOG", None)
    env.pop("MEGALAUNCH_TEST_GROUPS", None)  # this run's controller makes its own
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--rootdir", str(tree), "-c", os.devnull, str(tree)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in where.read_text().splitlines()]
    workers: dict[str, set[str]] = {}
    for name, worker in rows:
        workers.setdefault(name.rstrip("0123456789"), set()).add(worker)
    assert len(workers["marked"]) == 1, workers
    assert len(workers["shared"]) == 1, workers
    assert [name for name, _ in rows].count("built") == 1  # the module fixture was built once
    assert len(rows) == 6 + 6 + 1 + 12
