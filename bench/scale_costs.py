"""What megalaunch's own machinery costs per segment at 8, 16, 32 and 64 nodes (issue 33, docs/scale.md).

    sudo python bench/scale_costs.py [--nodes 8 16 32 64] [--iters 40]

On the scale cluster (`.ci/slurm-up scale`, booted here with MEGALAUNCH_SCALE_NODES = the largest count),
one chain per node count, one task per node, the stand-in trainer (MEGALAUNCH_TEST_STAND_IN=1: the
trainer's own Session, decisions, checkpoints, outcome, without torch), `--iters` iterations with a
periodic save and the final one; each chain runs one segment to its end. Printed per node count, from
the run's own records (ledger, timeline) and files:

- begin: the job's start (`started`) to the step's start (`step_started`): `job begin` + `job step-nodes`;
- start-up: the step's start to the first iteration (srun launching every rank + the stand-in's start:
  on this 2-core host this grows with the ranks it must start; on a cluster it is the trainer's start-up);
- iter overhead: the mean iteration minus the stand-in's sleep: the per-iteration collective (a TCP star
  here, rank 0 answering every rank; NCCL's all-reduce of the decision is tens of microseconds);
- end: the last iteration to the `ended` record: the final save, the outcome, `job step-end`, `job end`;
- the bytes each segment leaves: ledger, task records (one per rank), the segment log.

The figures grow with the ranks on 2 cores because every rank is a process here; the per-rank files
and the ledger bytes are what carries over to a real 1,000-node job."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CONF = "/etc/slurm-scale/slurm.conf"
SLEEP_S = 0.2


def _ledger(run: Path) -> list[dict[str, Any]]:
    try:
        lines = (run / "state" / "ledger.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _event(events: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((e for e in events if e["event"] == name), None)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def one_chain(tmp: Path, nodes: int, iters: int, env: dict[str, str]) -> dict[str, Any]:
    root = tmp / f"n{nodes}"
    root.mkdir()
    recipe = {
        "include": ["tiny"], "name": f"scale{nodes}", "run": {"root": str(root / "runs")},
        "cluster": {"backend": "slurm", "nodes": nodes, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": "00:10:00", "python": sys.executable,
                    "megalaunch": str(Path(sys.executable).with_name("megalaunch")),
                    "env": {"MEGALAUNCH_TEST_STAND_IN": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": str(SLEEP_S),
                            "PYTHONDONTWRITEBYTECODE": "", "PYTHONPATH": str(REPO / "src")}},
        "training": {"train_iters": iters, "log_interval": 10, "micro_batch_size": 1, "global_batch_size": nodes,
                     "lr_warmup_iters": 1},
        "checkpoint": {"save_interval": iters // 2, "save_time_estimate_s": 1},
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 29, "min_train_time_s": 20, "restarts_per_segment": 0,
                  "startup_timeout_s": 300},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    sub = subprocess.run([recipe["cluster"]["megalaunch"], "submit", str(path)], env=env, capture_output=True,
                         text=True, timeout=120)
    if sub.returncode != 0:
        raise SystemExit(f"submit failed: {sub.stderr.strip()}")
    run = next(p for p in (root / "runs").iterdir() if not p.name.startswith("."))
    deadline = time.monotonic() + 600
    while not _event(_ledger(run), "chain_stopped"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{run}: no chain_stopped after 600 s")
        time.sleep(1)
    events = _ledger(run)
    started, step, ended = (_event(events, n) for n in ("started", "step_started", "ended"))
    assert started and step and ended, events
    job = str(started["job_id"])
    timeline = json.loads((run / "state" / "timeline" / f"{job}.json").read_text())
    ph = timeline["phases"]
    first, last = float(ph["first_iteration_end"]), float(ph["last_iteration_end"])
    its = timeline["iterations"]
    n_its = int(its["last"]) - int(its["first"])
    return {
        "nodes": nodes, "outcome": ended.get("outcome"),
        "begin_s": step["time"] - started["time"], "startup_s": first - step["time"],
        "iter_overhead_ms": 1000 * ((last - first) / max(1, n_its) - SLEEP_S),
        "end_s": ended["time"] - last,
        "ledger_kb": _size(run / "state" / "ledger.jsonl") / 1e3,
        "task_records": len(list((run / "state" / "tasks" / job).glob("rank-*.json"))),
        "tasks_kb": _size(run / "state" / "tasks" / job) / 1e3,
        "log_kb": _size(run / "logs") / 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (it boots the scale cluster): sudo python bench/scale_costs.py", file=sys.stderr)
        return 2
    boot_env = dict(os.environ, MEGALAUNCH_SCALE_NODES=str(max(args.nodes)))
    subprocess.run([str(REPO / ".ci" / "slurm-up"), "scale"], env=boot_env, check=True)
    env = dict(os.environ, SLURM_CONF=CONF)
    tmp = Path(tempfile.mkdtemp(prefix="ml-scale-costs-"))
    os.chmod(tmp, 0o755)
    rows = [one_chain(tmp, n, args.iters, env) for n in args.nodes]
    cols = ["nodes", "outcome", "begin_s", "startup_s", "iter_overhead_ms", "end_s", "ledger_kb", "task_records",
            "tasks_kb", "log_kb"]
    print(" ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>16.2f}" if isinstance(r[c], float) else f"{r[c]!s:>16}" for c in cols))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
