"""How `pytest -n N --dist loadgroup` hands tests to its workers (tests/conftest.py installs it).

xdist's own loadgroup scheduler sends work units in collection order and queues two or three behind
each running test. This suite's time goes to a few long tests (Slurm chains that mostly wait on
Slurm's 30 s signal granularity, Megatron on the CPU) and many short ones, on 2 cores, so:

* longest first: the unit with the largest estimated duration (tests/durations.json; unknown tests
  count 0.5 s) goes to a free worker, so the long tests start at once and the short ones fill the
  gaps;
* a worker runs a test only once it knows the next one (xdist): behind a long test it gets the
  shortest unit, so nothing long waits behind another long test;
* at most MEGALAUNCH_TEST_HEAVY (default 2, the cores) CPU-heavy tests (outside tests/slurm, >= 10 s)
  at a time: more would only slow each other down, and many of them time things (signal leads,
  hang timers) that a starved CPU stretches; a worker waits rather than start a third one;
* xdist_group units (one group for the Slurm tests that need the second cluster, one per module
  for short modules with module-scoped fixtures, see tests/conftest.py) stay on one worker.

Group membership and the tests' own isolation decide correctness; this only decides the order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadGroupScheduling

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
UNKNOWN_S = 0.5
HEAVY_S = 10.0  # outside tests/slurm, an estimate at least this long: the test keeps a core busy
LONG_S = 20.0   # a head test this long gets the shortest unit as the one queued behind it


def load_durations() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def base_nodeid(nodeid: str) -> str:
    """The test's id without the `@group` suffix loadgroup appends."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[0]
    return nodeid


class LongestFirstScheduling(LoadGroupScheduling):
    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.durations = load_durations()
        self.heavy_cap = int(os.environ.get("MEGALAUNCH_TEST_HEAVY", "2"))

    # --- estimates
    def estimate(self, nodeid: str) -> float:
        return self.durations.get(base_nodeid(nodeid), UNKNOWN_S)

    def heavy(self, nodeid: str) -> bool:
        return not base_nodeid(nodeid).startswith("tests/slurm/") and self.estimate(nodeid) >= HEAVY_S

    def _unit_cost(self, unit: dict[str, bool]) -> float:
        return sum(self.estimate(n) for n, done in unit.items() if not done)

    def _unit_heavy(self, unit: dict[str, bool]) -> bool:
        return any(self.heavy(n) for n, done in unit.items() if not done)

    # --- state
    def _pending_ids(self, node: Any) -> list[str]:
        return [n for unit in self.assigned_work.get(node, {}).values() for n, done in unit.items() if not done]

    def _heavy_assigned(self) -> int:
        return sum(self.heavy(n) for node in self.assigned_work for n in self._pending_ids(node))

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
        """The scope to send next: the longest unit, or the shortest behind a long head; no heavy unit
        while the cap is reached (None: wait, unless the node needs a test behind its head)."""
        allow_heavy = self._heavy_assigned() < self.heavy_cap
        scopes = [s for s, unit in self.workqueue.items() if allow_heavy or not self._unit_heavy(unit)]
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


if __name__ == "__main__":  # python tests/support/schedule.py REPORT.xml: refresh tests/durations.json
    import sys

    measured = durations_from_junit(Path(sys.argv[1]), DURATIONS.parents[1])
    kept = {k: v for k, v in sorted(measured.items()) if v >= 1.0}  # shorter ones: UNKNOWN_S is close enough
    DURATIONS.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"{DURATIONS}: {len(measured)} tests, {sum(measured.values()):.0f} s in all; {len(kept)} of >= 1 s kept")
