"""Where a CI run's CPU goes, by kind of process: sample /proc once a second while `.ci/run` runs, then sum.

    python3 bench/ci_cpu.py --out /tmp/cpu.jsonl &      # beside a CI run (stops when --stop-file appears)
    touch /tmp/cpu.jsonl.stop                           # after it
    python3 bench/ci_cpu.py --summary /tmp/cpu.jsonl    # CPU-seconds by kind, the machine's busy total

Each process is classed once, when first seen: where it runs (`slurmjob`: a descendant of a slurmstepd; `slurmd`:
Slurm's daemons; `other`: the tests' own processes) and what it is, from its command line (`trainer`: the
training entry, `task`: the rank supervisor, `cli`: a `megalaunch` command, `pytest`, `pip`, `mypy`, ...).
Its CPU (utime + stime) is added as it grows; a process that lives under a second between two samples is missed
(its CPU shows in the machine's busy total, not in a kind). Standard library only: it runs under any Python."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
SLURM = ("slurmd", "slurmctld", "slurmstepd", "slurmdbd")
TOOLS = ("srun", "sbatch", "squeue", "sacct", "scontrol", "salloc", "scancel")
# pip (`-m pip`, bin/pip, the isolated build env's `.../site-packages/pip install`) and its build backend
PIP = re.compile(r"(^|[ /])pip( |$)|-m pip\b|pyproject_hooks|pep517")


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(comm, ppid, utime + stime ticks, start time) of a process, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    close = text.rfind(")")
    fields = text[close + 2:].split()
    return text[text.find("(") + 1:close], int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kind(pid: int, procs: dict[int, tuple[str, int, int, int]]) -> str:
    """`where:what` of one process (see the module's docstring)."""
    chain, p = [], pid
    for _ in range(40):
        if p not in procs:
            break
        chain.append(procs[p][0])
        p = procs[p][1]
    where = "slurmjob" if "slurmstepd" in chain[1:] else "slurmd" if chain and chain[0] in SLURM else "other"
    cmd = _cmdline(pid)
    argv = cmd.split(" ")
    if "megalaunch.runtime.train" in cmd and "megalaunch.runtime.task" not in cmd:
        what = "trainer"
    elif "megalaunch.runtime.task" in cmd:
        what = "task"
    elif "megalaunch.cli" in cmd or (len(argv) > 1 and argv[1].endswith("/megalaunch")):
        what = "cli"
    elif PIP.search(cmd):  # before pytest: `pip install ... pytest`
        what = "pip"
    elif "pytest" in cmd:
        what = "pytest"
    elif "mypy" in cmd:
        what = "mypy"
    elif chain and chain[0] in SLURM + TOOLS:
        what = chain[0]
    elif chain and chain[0].startswith("python"):
        what = "python"  # pytest-xdist workers (execnet), conversions, workloads
    else:
        what = chain[0] if chain else "?"
    return f"{where}:{what}"


def sample(out: Path, stop: Path, interval: float) -> None:
    seen: dict[tuple[int, int], list[object]] = {}  # (pid, start) -> [ticks counted, kind]
    totals: dict[str, int] = {}
    t0 = time.monotonic()
    with out.open("a") as f:
        while True:
            procs = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d)))}
            alive = set()
            for pid, (_, _, ticks, start) in procs.items():
                key = (pid, start)
                alive.add(key)
                entry = seen.setdefault(key, [ticks, kind(pid, procs)])  # CPU before the first sight: not counted
                totals[str(entry[1])] = totals.get(str(entry[1]), 0) + ticks - int(entry[0])  # type: ignore[call-overload]
                entry[0] = ticks
            for key in [k for k in seen if k not in alive]:
                del seen[key]
            cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
            f.write(json.dumps({"t": round(time.monotonic() - t0, 1), "busy_s": busy / HZ,
                                "by": {k: round(v / HZ, 2) for k, v in totals.items()}}) + "\n")
            f.flush()
            if stop.exists():
                return
            time.sleep(interval)


def summary(path: Path, top: int) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first, last = rows[0], rows[-1]
    busy = last["busy_s"] - first["busy_s"]
    by = {k: v - first["by"].get(k, 0) for k, v in last["by"].items()}
    print(f"{last['t'] - first['t']:.0f} s sampled; the machine was busy {busy:,.0f} CPU-s "
          f"({busy / (last['t'] - first['t']) / (os.cpu_count() or 1):.0%} of {os.cpu_count()} cores)")
    listed = 0.0
    for name, cpu in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
        listed += cpu
        print(f"  {cpu:8.1f} CPU-s {100 * cpu / busy:5.1f} %  {name}")
    print(f"  {busy - listed:8.1f} CPU-s in the rest (other kinds, processes shorter than a sample, the kernel)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="sample into this JSONL file until --stop-file exists")
    parser.add_argument("--stop-file", type=Path, help="default: OUT.stop")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--summary", type=Path, help="sum a sampled file")
    parser.add_argument("--top", type=int, default=15)
    a = parser.parse_args()
    if a.summary:
        summary(a.summary, a.top)
        return 0
    if not a.out:
        parser.error("--out or --summary")
    sample(a.out, a.stop_file or a.out.with_name(a.out.name + ".stop"), a.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
