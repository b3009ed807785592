"""Shared fixtures: every test gets its own registry of runs, so nothing leaks into ~/.local; and the
order in which `pytest -n N --dist loadgroup` (scripts/test) runs the suite in parallel."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _private_state_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state-home")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))  # rundir/appended.py's cache
    monkeypatch.setattr("megalaunch.rundir.appended.CACHE_JSON", False)  # `status` turns it on for its process


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """What a test writes into os.environ outside monkeypatch (megalaunch's runtime exports RANK,
    WORLD_SIZE, ... for Megatron) ends with the test: in a worker that runs tests in another order
    than a serial run, it would otherwise reach the next test (Megatron's rank-0 printing, say)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


def _sigint_ignored() -> bool:
    """Whether this process ignores SIGINT, as the kernel sees it (C code can set it past Python's getsignal)."""
    with open("/proc/self/status") as f:
        mask = next((line.split()[1] for line in f if line.startswith("SigIgn:")), "0")
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


@pytest.fixture(autouse=True)
def _restore_sigint(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves SIGINT ignored (or handled otherwise) in the worker is undone after it: every process
    a later test starts would inherit SIG_IGN and ignore Ctrl-C (CI runs of 2026-12-02: the ssh client's Ctrl-C
    and the hang watcher's two SIGINTs to a stand-in srun went unheard). Said on stderr with the test's name."""
    before = signal.getsignal(signal.SIGINT)
    yield
    if _sigint_ignored() or signal.getsignal(signal.SIGINT) is not before:
        print(f"\n[conftest] {request.node.nodeid} left SIGINT changed; restored", file=sys.stderr)
        signal.signal(signal.SIGINT, before if callable(before) else signal.default_int_handler)


@pytest.fixture(autouse=True)
def _restore_umask(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves the worker's umask changed (megalaunch's local chain sets 027 for its segments: run in
    the worker's own process, it stayed) is undone after it: every file a later test writes for another user
    would be unreadable to them (CI run of 2026-12-02: sbatch as mlalice "Unable to open file" its test's
    script). Said on stderr with the test's name."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    now = os.umask(before)
    if now != before:
        print(f"\n[conftest] {request.node.nodeid} left the umask {now:03o} (was {before:03o}); restored",
              file=sys.stderr)


# --- parallel runs (pytest-xdist) -------------------------------------------------------------------

def _schedule_module() -> Any:
    spec = importlib.util.spec_from_file_location("_megalaunch_test_schedule", HERE / "support" / "schedule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: the core-only venv has none
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: xdist's groups, sent longest first (tests/support/schedule.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return _schedule_module().LongestFirstScheduling(config, log)


#: a module whose tests share a module-scoped fixture runs on one worker (the fixture is built once)
#: when its tests together are estimated shorter than this; longer modules spread their tests. The
#: estimates come from a parallel run, where every worker that ran one of the module's tests built the
#: fixture again (tests/unit/test_report.py: 68 s estimated, ~25 s on one worker).
MODULE_GROUP_MAX_S = 90.0


#: where the workers tell the scheduler their groups: pytest-xdist's own way (a "@group" suffix on the test's
#: id, set through `item._nodeid`) stopped working with pytest 9.2 (ids are `item._id` now), silently: every
#: group was split, so module fixtures were built once per worker and the SFT journey's three times.
GROUPS_ENV = "MEGALAUNCH_TEST_GROUPS"


def pytest_configure(config: pytest.Config) -> None:
    """The controller of a `--dist loadgroup` run makes the directory its workers write their groups into
    (they inherit the environment: pytest-xdist starts them after this)."""
    if config.getoption("dist", None) == "loadgroup" and not hasattr(config, "workerinput"):
        directory = tempfile.mkdtemp(prefix="megalaunch-test-groups-")
        os.environ[GROUPS_ENV] = directory
        config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))


def work_groups(items: list[pytest.Item]) -> dict[str, str]:
    """{test id: group} for the tests that must run on one worker: an `xdist_group` marker, a private Slurm
    cluster (tests/slurm/conftest.py), or a short module whose tests share a module-scoped fixture."""
    durations = _schedule_module().load_durations()
    groups: dict[str, str] = {}
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        names = sorted(str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                       for m in item.iter_markers("xdist_group"))
        if names:
            groups[item.nodeid] = "_".join(names)
        elif (mark := item.get_closest_marker("private_cluster")) is not None:
            groups[item.nodeid] = f"private-cluster-{mark.args[0] if mark.args else 'ctld'}"
        else:
            by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    for module, its in by_module.items():
        shared = any(d.scope in ("module", "class", "package")
                     for it in its for defs in it._fixtureinfo.name2fixturedefs.values() for d in defs
                     if d.baseid.startswith(module))
        if shared and sum(durations.get(it.nodeid, 0.5) for it in its) < MODULE_GROUP_MAX_S:
            groups.update((it.nodeid, module) for it in its)
    return groups


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A worker of a `--dist loadgroup` run writes its tests' groups for the scheduler (schedule.py)."""
    directory = os.environ.get(GROUPS_ENV)
    worker = getattr(config, "workerinput", {}).get("workerid")
    if not directory or not worker or not config.getoption("loadgroup", None):
        return
    path = Path(directory) / f"{worker}.json"
    path.with_suffix(".part").write_text(json.dumps(work_groups(items)))
    path.with_suffix(".part").replace(path)


# --- CPU time per test (MEGALAUNCH_TEST_CPU_LOG=DIR) ------------------------------------------------
# The scheduler (tests/support/schedule.py) needs to know which tests keep a core busy and which mostly
# wait (on Slurm's clock, a paced chain, a timer): wall time alone cannot tell. With the variable set,
# every test appends its wall and CPU seconds (its own process and the children it waited for: the
# trainers of the local backend, the CLI's subprocesses) to DIR/<worker>.jsonl;
# `python tests/support/schedule.py --cpu DIR` folds them into tests/durations.json.
_CPU_LOG = os.environ.get("MEGALAUNCH_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not _CPU_LOG:
        yield
        return
    import json
    import time

    def forked() -> float:  # ranks forked by tests/support/forkserver.py are the server's children, not ours
        server = sys.modules.get("tests.support.forkserver")
        return float(getattr(getattr(server, "Server", None), "cpu_s", 0.0))

    t0, w0, f0, start = os.times(), time.monotonic(), forked(), time.time()
    yield
    t1, w1 = os.times(), time.monotonic()
    cpu = sum(getattr(t1, f) - getattr(t0, f) for f in ("user", "system", "children_user", "children_system"))
    cpu += forked() - f0
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(_CPU_LOG).mkdir(parents=True, exist_ok=True)
    with open(Path(_CPU_LOG) / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall": round(w1 - w0, 2), "cpu": round(cpu, 2),
                            "start": round(start, 1)}) + "\n")
