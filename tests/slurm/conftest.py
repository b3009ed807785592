"""Tests against the local Slurm cluster (``sudo .ci/slurm-up``).

Every test under tests/slurm gets the ``slurm`` marker. Without a cluster they are skipped,
unless ``MEGALAUNCH_REQUIRE_SLURM=1`` (CI), where a missing cluster fails them.

Tests run in parallel (pytest-xdist) on the main cluster, except those marked
``private_cluster("ctld")`` (they stop the controller) or ``private_cluster("nodes")`` (blocker jobs
take whole nodes away), which would break or starve every other test's jobs. They run on one of
.ci/slurm-up's other clusters (SLURM_CONF=/etc/slurm-iso/... or /etc/slurm-iso2/..., the same node
names and layout), one test at a time per cluster: a lock on the host (other checkouts' runs too),
and one xdist group per cluster so that one worker runs them in turn (tests/conftest.py).
``private_cluster("scale")`` runs on the many-node cluster (SLURM_CONF=/etc/slurm-scale/slurm.conf,
nodes snode[1-N], tests/slurm/scale.py), which .ci/slurm-up starts only when asked: when it does not
answer and this is root, the first such test boots it (``.ci/slurm-up scale``, a few seconds; a file
lock keeps xdist workers from booting it twice).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import ON_DEMAND, PRIVATE_CONFS, SLURM_STATE, cluster_available, resume_kill_task_drains

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: Base for run directories that other users (mlalice, mlbob, mleve) must reach: pytest's own
#: tmp_path (/tmp/pytest-of-root, mode 0700) is not traversable by them.
SLURM_TMP_BASE = Path(os.environ.get("MEGALAUNCH_SLURM_TMP", "/tmp/megalaunch-slurm-tests"))

_REQUIRE = os.environ.get("MEGALAUNCH_REQUIRE_SLURM") == "1"
_available: dict[str | None, bool] = {}
_boot_failed: dict[str, str] = {}  # on-demand cluster -> why booting it failed (for the skip message)
PRIVATE_LOCK_WAIT_S = 1800
BOOT_TIMEOUT_S = 300


def private_cluster(item: pytest.Item) -> str | None:
    """The private cluster a test asks for ("ctld", "nodes", "scale"), None for the main one."""
    mark = item.get_closest_marker("private_cluster")
    if mark is None:
        return None
    name = mark.args[0] if mark.args else "ctld"
    assert name in PRIVATE_CONFS, f"private_cluster({name!r}): one of {sorted(PRIVATE_CONFS)}"
    return str(name)


def _private_lock(name: str) -> Path:
    """Held while a test runs on private cluster `name`: it serves one test at a time."""
    path = SLURM_STATE / PRIVATE_CONFS[name].parent.name.removeprefix("slurm-") / ".test.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _private_answers(name: str) -> bool:
    conf = PRIVATE_CONFS[name]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        return conf.is_file() and cluster_available()
    finally:
        if old is None:
            del os.environ["SLURM_CONF"]
        else:
            os.environ["SLURM_CONF"] = old


def _boot_on_demand(name: str) -> bool:
    """`.ci/slurm-up NAME` for a cluster it starts only when asked, as root and with Slurm installed
    (slurm-up would otherwise install the packages). Under a file lock: of several xdist workers, the
    first boots it and the others find it up. True when it answers afterwards."""
    if os.geteuid() != 0 or shutil.which("slurmd") is None:
        _boot_failed[name] = "not root, or Slurm not installed: not booted"
        return False
    SLURM_STATE.mkdir(parents=True, exist_ok=True)
    with open(SLURM_STATE / f".{name}-boot.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the boot takes seconds; a worker that waited finds it up
        if _private_answers(name):
            return True
        try:
            res = subprocess.run([str(REPO / ".ci" / "slurm-up"), ON_DEMAND[name]], capture_output=True,
                                 text=True, timeout=BOOT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            _boot_failed[name] = f".ci/slurm-up {ON_DEMAND[name]} ran longer than {BOOT_TIMEOUT_S} s"
            return False
        print(res.stderr.strip(), res.stdout.strip(), sep="\n")  # what it did; its summary: the boot time
        if res.returncode != 0:
            _boot_failed[name] = f".ci/slurm-up {ON_DEMAND[name]} failed (rc {res.returncode}): " + \
                " | ".join(res.stderr.strip().splitlines()[-5:])
            return False
        return _private_answers(name)


def _cluster_up(private: str | None = None) -> bool:
    if private not in _available:
        if private:
            up = _private_answers(private)
            if not up and private in ON_DEMAND:
                up = _boot_on_demand(private)
            _available[private] = up
        else:
            _available[private] = cluster_available()
    return _available[private]


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
def _require_cluster(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fails without the cluster (CI); for a private_cluster test, points every Slurm client (this
    process's, run_as's, the jobs': sbatch exports the environment) at the second cluster and holds
    its lock for the test's whole life (autouse: set up before, torn down after slurm_tmp). The scale
    cluster is booted first when it does not answer (_boot_on_demand)."""
    private = private_cluster(request.node)
    if not _cluster_up(private):
        which = f"the private cluster {PRIVATE_CONFS[private]}" if private else "no local Slurm cluster"
        up = f"sudo .ci/slurm-up {ON_DEMAND[private]}" if private in ON_DEMAND else "sudo .ci/slurm-up"
        why = f" ({_boot_failed[private]})" if private in _boot_failed else ""
        if _REQUIRE:
            pytest.fail(f"MEGALAUNCH_REQUIRE_SLURM=1 but {which} answers (sinfo shows no usable node "
                        f"within 5 s){why}: run `{up}`", pytrace=False)
        pytest.skip(f"{which} answers{why}: run `{up}`")
    if not private:
        resume_kill_task_drains(f"a test before {request.node.nodeid} (one still running, maybe)")
        yield
        resume_kill_task_drains(request.node.nodeid)
        return
    lock_path = _private_lock(private)
    with open(lock_path, "a") as lock:
        deadline = time.monotonic() + PRIVATE_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{lock_path} still held after {PRIVATE_LOCK_WAIT_S} s", pytrace=False)
                time.sleep(1)
        monkeypatch.setenv("SLURM_CONF", str(PRIVATE_CONFS[private]))
        try:
            yield
            if private != "scale":  # the scale tests resume what their node deaths drain themselves
                resume_kill_task_drains(request.node.nodeid)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
    yourself for permission tests. Removed after a passing test (MEGALAUNCH_KEEP_SLURM_TMP=1: kept), kept after
    a failure.
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
    if not request.node.stash.get(_FAILED, True) and os.environ.get("MEGALAUNCH_KEEP_SLURM_TMP") != "1":
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
