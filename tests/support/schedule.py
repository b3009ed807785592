"""How `pytest -n N --dist loadgroup` hands tests to its workers (tests/conftest.py installs it).

xdist's own loadgroup scheduler sends work units in collection order and queues two or three behind
each running test. This suite's time goes to a few long tests (Slurm chains that mostly wait on
Slurm's 30 s signal granularity, Megatron on the CPU) and many short ones, on 2 cores, so:

* longest first: the unit with the largest estimated duration (tests/durations.json; unknown tests
  count 0.5 s) goes to a free worker, so the long tests start at once and the short ones fill the
  gaps;
* a worker runs a test only once it knows the next one (xdist): behind a long test it gets the
  shortest unit, so nothing long waits behind another long test;
* the long tests (>= 10 s) that keep cores busy share a CPU budget, MEGALAUNCH_TEST_CPUS (default:
  the machine's cores): each counts its measured CPU load (CPU seconds / wall seconds, from
  tests/durations.json; a test without a CPU figure counts one core outside tests/slurm; inside, where
  the work runs under slurmd and no test process can measure it, half a core for a module that runs the
  real trainer (its `megatron` marker: paced chains and Slurm's clock keep it below one) and none for
  the stand-in workloads), and a worker waits rather than start one that would overrun the budget, unless no long test
  runs. More would only slow each other down, and many of them time things (signal leads, hang
  timers) that a starved CPU stretches. A long test that mostly waits (on Slurm's clock, a paced
  chain, the local backend's timer) costs little of the budget, so it runs beside two busy ones;
* at most half the workers hold a test that mostly waits (>= WAIT_S long, load < WAIT_LOAD) while
  other work is left: with every worker on a Slurm chain the cores sat idle;
* xdist_group units (one group for the Slurm tests that need the second cluster, one per module
  for short modules with module-scoped fixtures, see tests/conftest.py) stay on one worker.

Group membership and the tests' own isolation decide correctness; this only decides the order.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadGroupScheduling

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
GROUPS_ENV = "MEGALAUNCH_TEST_GROUPS"  # tests/conftest.py: the directory the workers write their groups into
UNKNOWN_S = 0.5
HEAVY_S = 10.0  # a test estimated at least this long counts against the CPU budget
LONG_S = 20.0   # a head test this long gets the shortest unit as the one queued behind it
WAIT_S, WAIT_LOAD = 30.0, 0.35  # a test this long with less load mostly waits (Slurm's clock, a paced chain)
# (30, not 60: in CI run 20 the 34-66 s Slurm tests of the node-taking cluster, load <= 0.1, counted as work, and with
# the two long chains they held every worker for two minutes with the cores ~62 % busy)


def _entries() -> dict[str, Any]:
    """tests/durations.json: {test id: [wall seconds, CPU seconds]} (or a bare number: wall only)."""
    try:
        return dict(json.loads(DURATIONS.read_text()))
    except (OSError, ValueError):
        return {}


def load_durations() -> dict[str, float]:
    return {k: float(v[0] if isinstance(v, list) else v) for k, v in _entries().items()}


def load_cpu_loads() -> dict[str, float]:
    """{test id: CPU seconds per wall second} where measured."""
    return {k: float(v[1]) / max(float(v[0]), 0.1) for k, v in _entries().items() if isinstance(v, list)}


@functools.cache
def _runs_the_trainer(module: str) -> bool:
    try:
        return "pytest.mark.megatron" in (DURATIONS.parent.parent / module).read_text()
    except OSError:
        return False


def default_load(nodeid: str) -> float:
    module = nodeid.split("::")[0]
    if module.startswith("tests/slurm/"):
        return 0.5 if _runs_the_trainer(module) else 0.0
    return 1.0


def base_nodeid(nodeid: str) -> str:
    """The test's id without the `@group` suffix loadgroup appends."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[0]
    return nodeid


class LongestFirstScheduling(LoadGroupScheduling):
    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.durations = load_durations()
        self.loads = load_cpu_loads()
        # the cores, not more: a budget of 1.25 x the cores (CI run 23: 17:41) did no better than 1.0 (run 22: 17:24)
        self.cpu_budget = float(os.environ.get("MEGALAUNCH_TEST_CPUS") or os.cpu_count() or 2)
        self.groups: dict[str, str] = {}

    # --- groups
    def _split_scope(self, nodeid: str) -> str:
        """The unit a test belongs to: its group as the workers wrote it (tests/conftest.py work_groups), or
        pytest-xdist's "@group" suffix where the pytest in use still carries it, or the test alone."""
        if nodeid.rfind("@") > nodeid.rfind("]"):
            return super()._split_scope(nodeid)
        return self.groups.get(nodeid, nodeid)

    def _read_groups(self) -> dict[str, str]:
        directory = os.environ.get(GROUPS_ENV)
        groups: dict[str, str] = {}
        for path in sorted(Path(directory).glob("*.json")) if directory else ():
            groups.update(json.loads(path.read_text()))
        return {test: "group:" + name for test, name in groups.items()}

    # --- estimates
    def estimate(self, nodeid: str) -> float:
        return self.durations.get(base_nodeid(nodeid), UNKNOWN_S)

    def load(self, nodeid: str) -> float:
        """The cores a long test keeps busy (0 for a short one: short tests fill the gaps)."""
        if self.estimate(nodeid) < HEAVY_S:
            return 0.0
        base = base_nodeid(nodeid)
        return self.loads.get(base, default_load(base))

    def _unit_cost(self, unit: dict[str, bool]) -> float:
        return sum(self.estimate(n) for n, done in unit.items() if not done)

    def _unit_load(self, unit: dict[str, bool]) -> float:
        return max((self.load(n) for n, done in unit.items() if not done), default=0.0)

    # --- state
    def _pending_ids(self, node: Any) -> list[str]:
        return [n for unit in self.assigned_work.get(node, {}).values() for n, done in unit.items() if not done]

    def _load_assigned(self) -> float:
        return sum(self.load(n) for node in self.assigned_work for n in self._pending_ids(node))

    def waits(self, nodeid: str) -> bool:
        """A long test that mostly waits: it holds a worker for minutes and keeps little of a core busy."""
        return self.estimate(nodeid) >= WAIT_S and self.load(nodeid) < WAIT_LOAD

    def _waiting_assigned(self) -> int:
        return sum(1 for node in self.assigned_work for n in self._pending_ids(node) if self.waits(n))

    # --- scheduling
    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:
            for node in self.nodes:
                self._reschedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = list(next(iter(self.registered_collections.values())))
        if not self.collection:
            return
        self.groups = self._read_groups()  # every worker has written them: each has sent its collection
        for nodeid in self.collection:
            self.workqueue.setdefault(self._split_scope(nodeid), {})[nodeid] = False
        for node in self.nodes:
            self._reschedule(node)
        self._reschedule_all()

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        nodeid = self.registered_collections[node][item_index]
        self.assigned_work[node][self._split_scope(nodeid)][nodeid] = True
        self._reschedule_all()

    def _reschedule_all(self) -> None:
        for node in list(self.assigned_work):
            self._reschedule(node)

    def _pick(self, head: str | None) -> str | None:
        """The scope to send next: the longest unit, or the shortest behind a long head; no unit whose
        load would overrun the CPU budget while long tests run (None: wait, unless the node needs a test
        behind its head)."""
        busy = self._load_assigned()
        scopes = [s for s, unit in self.workqueue.items()
                  if busy == 0 or busy + self._unit_load(unit) <= self.cpu_budget + 1e-9]
        # waiting tests on every worker leave the cores idle (CI run 15: ~45 % busy for its first 6 minutes,
        # its three workers each on a Slurm chain): at most half the workers wait, while other work is left
        if self._waiting_assigned() >= max(1, len(self.nodes) // 2):
            working = [s for s in scopes if not any(self.waits(n) for n in self.workqueue[s])]
            scopes = working or scopes
        if not scopes:
            if head is None:
                return None
            scopes = list(self.workqueue)
        costs = {s: self._unit_cost(self.workqueue[s]) for s in scopes}
        if head is not None and self.estimate(head) >= LONG_S:
            return min(scopes, key=lambda s: costs[s])
        return max(scopes, key=lambda s: costs[s])

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        self.assigned_work.setdefault(node, {})
        while self.workqueue:
            pending = self._pending_ids(node)
            if len(pending) >= 2:
                return
            scope = self._pick(pending[0] if pending else None)
            if scope is None:
                return
            unit = self.workqueue.pop(scope)
            self.assigned_work[node][scope] = unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(n) for n, done in unit.items() if not done])
        node.shutdown()


def durations_from_junit(xml_path: Path, root: Path) -> dict[str, float]:
    """{test id: seconds} from a `pytest --junitxml` report (setup + call + teardown per test)."""
    import xml.etree.ElementTree as ET

    out: dict[str, float] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        for cut in range(len(parts), 0, -1):  # the module is the longest prefix that is a file
            module = "/".join(parts[:cut]) + ".py"
            if (root / module).is_file():
                nodeid = "::".join([module, *parts[cut:], case.get("name") or ""])
                out[nodeid] = round(float(case.get("time") or 0.0), 2)
                break
    return out


def measured_from_cpu_log(directory: Path) -> dict[str, list[float]]:
    """{test id: [wall, cpu]} from the files MEGALAUNCH_TEST_CPU_LOG=DIR wrote (tests/conftest.py)."""
    out: dict[str, list[float]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["test"]] = [round(float(row["wall"]), 1), round(float(row["cpu"]), 1)]
    return out


if __name__ == "__main__":
    # python tests/support/schedule.py --cpu DIR: refresh tests/durations.json from a run with
    # MEGALAUNCH_TEST_CPU_LOG=DIR (scripts/test); a test measured as 0 CPU (its work ran under slurmd,
    # which no test waits for) keeps the wall time only, so it counts as the default load.
    import sys

    if sys.argv[1:2] != ["--cpu"] or len(sys.argv) != 3:
        sys.exit("usage: python tests/support/schedule.py --cpu DIR")
    measured = measured_from_cpu_log(Path(sys.argv[2]))
    # DIR/machine_cpu.json (bench/ci_attrib.py, from process accounting beside the run): what each test's
    # processes outside its worker cost, Slurm jobs' included; for tests/slurm it replaces the hand-set load
    machine_file = Path(sys.argv[2]) / "machine_cpu.json"
    machine = json.loads(machine_file.read_text()) if machine_file.exists() else {}
    before = _entries()
    kept: dict[str, Any] = {}
    for k, (wall, cpu) in sorted(measured.items()):
        if wall < 1.0:  # shorter ones: UNKNOWN_S is close enough
            continue
        old = before.get(k)
        if k.startswith("tests/slurm/") and k in machine:
            # the worker's own part is in `cpu`; a Slurm process is shared among the Slurm tests that ran
            # when it started, which can overcharge a short one: at most one core
            kept[k] = [wall, round(min(max(cpu, machine[k]), wall), 1)]
        elif isinstance(old, list) and (k.startswith("tests/slurm/") or old[1] >= old[0]):
            # set by hand: a Slurm test's work (under slurmd) no test process measures; a test whose ranks
            # start together and whose timing a busy CPU stretches (a chain of 2 ranks) counts 1.5 cores
            kept[k] = [wall, round(wall * old[1] / max(old[0], 0.1), 1)]
        else:
            kept[k] = [wall, cpu] if not k.startswith("tests/slurm/") else wall
    DURATIONS.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in kept.items()) + "\n}\n")
    total = sum(w for w, _ in measured.values())
    print(f"{DURATIONS}: {len(measured)} tests, {total:.0f} s in all; {len(kept)} of >= 1 s kept")
