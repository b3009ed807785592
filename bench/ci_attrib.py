"""Every process of a CI run charged to the test that caused it, from the kernel's process accounting.

    accton /tmp/pacct                                   # root; before `MEGALAUNCH_TEST_CPU_LOG=DIR .ci/run`
    accton off                                          # after it
    dump-acct /tmp/pacct > /tmp/pacct.txt
    python3 bench/ci_attrib.py /tmp/pacct.txt DIR       # prints the top; writes DIR/machine_cpu.json

The CPU log (tests/conftest.py) measures a test's own process, the children it waited for and the fork server's
children; it cannot see a Slurm job's processes (slurmd starts them). Accounting sees every process that ended.
A process is charged to the test its pytest-xdist worker ran when it started (found through its parents: the
worker, or the worker's fork server), or, under a slurmstepd, to the Slurm test(s) running then (shared equally
when several were). The workers' own CPU is not split (the CPU log has it per test). Output:
{test id: CPU seconds of its processes outside the worker}; `schedule.py --cpu DIR` reads it for tests/slurm.
Standard library only."""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import sys
import time
from pathlib import Path


def read_accounting(path: str) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        f = [x.strip() for x in line.split("|")]
        if "v3" not in f:  # a command name with a line break in it: the rest of its record is on the next line
            continue
        i = f.index("v3")
        cmd, f = "|".join(f[:i]), f[i - 1:]
        start = time.mktime(datetime.datetime.strptime(f[14], "%a %b %d %H:%M:%S %Y").timetuple())
        rows.append({"cmd": cmd, "cpu": (float(f[2]) + float(f[3])) / 100, "e": float(f[4]) / 100,
                     "pid": int(f[9]), "ppid": int(f[10]), "start": start})
    return rows


def main(pacct: str, cpu_dir: str) -> None:
    rows = read_accounting(pacct)
    by_pid: dict[int, list[dict]] = collections.defaultdict(list)  # pids wrap (pid_max 32768): all holders
    for r in rows:
        by_pid[r["pid"]].append(r)

    def parent(r: dict) -> dict | None:
        """The process that held the parent's pid when `r` started (alive then: started before, ended after)."""
        alive = [p for p in by_pid.get(r["ppid"], ()) if p["start"] - 1 <= r["start"] <= p["start"] + p["e"] + 1]
        return max(alive, key=lambda p: p["start"], default=None)
    tests = {p.stem: [json.loads(x) for x in p.read_text().splitlines()] for p in Path(cpu_dir).glob("*.jsonl")}
    longs = {r["pid"] for r in rows if r["cmd"] == "python" and r["e"] > 600}
    workers = [r for r in rows if r["pid"] in longs and r["ppid"] in longs]  # the controller's children

    def owner(r: dict) -> int | str | None:
        seen = {id(r)}
        while (r := parent(r)) is not None and id(r) not in seen:  # type: ignore[assignment]
            seen.add(id(r))
            if r["cmd"] == "slurmstepd":
                return "slurm"
            if r in workers:
                return r["pid"]
        return None

    def test_at(worker: str, t: float) -> str | None:
        return next((x["test"] for x in tests[worker] if x["start"] - 1 <= t <= x["start"] + x["wall"] + 1), None)

    owners = {id(r): owner(r) for r in rows}
    best: tuple[int, dict] = (-1, {})
    for perm in itertools.permutations(sorted(tests), len(workers)):  # which worker wrote which log
        m = dict(zip([w["pid"] for w in workers], perm, strict=True))
        score = sum(1 for r in rows if owners[id(r)] in m and r["cpu"] >= 1 and test_at(m[owners[id(r)]], r["start"]))
        best = max(best, (score, m), key=lambda b: b[0])
    m = best[1]
    slurm_tests = [x for w in tests.values() for x in w if x["test"].startswith("tests/slurm/")]
    per: collections.Counter[str] = collections.Counter()
    for r in rows:
        o = owners[id(r)]
        if any(r is w for w in workers):
            per["(workers themselves)"] += r["cpu"]
        elif o in m:
            per[test_at(m[o], r["start"]) or "(between tests)"] += r["cpu"]
        elif o == "slurm":
            running = [x["test"] for x in slurm_tests if x["start"] - 1 <= r["start"] <= x["start"] + x["wall"] + 1]
            for t in running or ["(slurm, no test running)"]:
                per[t] += r["cpu"] / max(len(running), 1)
        else:
            per["(other: " + r["cmd"] + ")"] += r["cpu"]
    print(f"{sum(per.values()):.0f} CPU-s in {len(rows)} processes; workers {[w['pid'] for w in workers]} -> {m}")
    for k, v in per.most_common(60):
        print(f"{v:8.1f} {k[:150]}")
    (Path(cpu_dir) / "machine_cpu.json").write_text(json.dumps({k: round(v, 1) for k, v in per.items()}, indent=0))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
