"""Tests against the local Slurm cluster (``sudo .ci/slurm-up``).

Every test under tests/slurm gets the ``slurm`` marker. Without a cluster they are skipped,
unless ``MEGALAUNCH_REQUIRE_SLURM=1`` (CI), where a missing cluster fails them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import cluster_available

HERE = Path(__file__).resolve().parent
#: Base for run directories that other users (mlalice, mlbob, mleve) must reach: pytest's own
#: tmp_path (/tmp/pytest-of-root, mode 0700) is not traversable by them.
SLURM_TMP_BASE = Path(os.environ.get("MEGALAUNCH_SLURM_TMP", "/tmp/megalaunch-slurm-tests"))

_REQUIRE = os.environ.get("MEGALAUNCH_REQUIRE_SLURM") == "1"
_available: bool | None = None


def _cluster_up() -> bool:
    global _available
    if _available is None:
        _available = cluster_available()
    return _available


def _is_ours(item: pytest.Item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _is_ours(item)]
    if not ours:
        return
    for item in ours:
        item.add_marker(pytest.mark.slurm)
    if not _REQUIRE and not _cluster_up():
        skip = pytest.mark.skip(
            reason="no local Slurm cluster (sinfo shows no usable node): run `sudo .ci/slurm-up`"
        )
        for item in ours:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _require_cluster() -> None:
    if _REQUIRE and not _cluster_up():
        pytest.fail(
            "MEGALAUNCH_REQUIRE_SLURM=1 but no local Slurm cluster answers "
            "(sinfo shows no usable node within 5 s): run `sudo .ci/slurm-up`",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def slurm_tmp(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory (mode 1777, like /tmp) under a base every user can traverse.

    Use it as the cwd / run directory of jobs submitted as mlalice, mlbob or mleve; chmod it
    yourself for permission tests. Removed after a passing test, kept after a failure.
    """
    SLURM_TMP_BASE.mkdir(parents=True, exist_ok=True)
    # Like /tmp: anyone may create, only owners delete. Made by another user earlier: already so.
    with contextlib.suppress(PermissionError):
        SLURM_TMP_BASE.chmod(0o1777)
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.name)[:60]
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=SLURM_TMP_BASE))
    path.chmod(0o1777)  # sticky: a run root nobody else can rename is what megalaunch requires (docs/security.md)
    yield path
    _cancel_leftover_chains(path)
    if not request.node.stash.get(_FAILED, True):
        shutil.rmtree(path, ignore_errors=True)
    else:
        print(f"slurm_tmp kept: {path}")


def _cancel_leftover_chains(path: Path) -> None:
    """A failed test must not leave a self-requeuing chain behind: cancel every job named like a
    run directory the test created (chain names are unique per run)."""
    import subprocess

    names = [p.name for p in path.glob("runs/*") if p.is_dir() and not p.name.startswith(".")]
    if not names:
        return
    out = subprocess.run(["squeue", "-h", "-o", "%i", "--name", ",".join(names)], capture_output=True,
                         text=True, timeout=30)
    ids = out.stdout.split()
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, timeout=30)


@pytest.fixture
def node_names_resolve() -> None:
    """Jobs that run torch.distributed: their MASTER_ADDR is the first node's Slurm name (as on any real
    cluster), so every node name must resolve."""
    import socket
    import subprocess

    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=15,
                           check=True).stdout.split()
    for node in sorted(set(nodes)):
        try:
            socket.gethostbyname(node)
        except OSError:
            pytest.fail(f"Slurm node name {node!r} does not resolve, so the job's MASTER_ADDR is unreachable "
                        f"and torch.distributed cannot rendezvous: add '127.0.0.1 {' '.join(sorted(set(nodes)))}' "
                        "to /etc/hosts (as real clusters resolve their node names)", pytrace=False)
