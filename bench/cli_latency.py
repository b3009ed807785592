"""Median wall time of common CLI commands on this machine (login-node responsiveness).

    python bench/cli_latency.py [--runs 10]

Each command runs as a fresh process, as a user would type it. Target: each <= 0.25 s."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 0.25


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    exe = shutil.which("megalaunch") or str(Path(sys.executable).with_name("megalaunch"))
    tmp = Path(tempfile.mkdtemp(prefix="ml-bench-"))
    env = dict(os.environ, XDG_STATE_HOME=str(tmp / "state"))
    # a run to ask the status of (local backend, no jobs: status reads the run directory)
    recipe = tmp / "r.yaml"
    recipe.write_text(f"include: [tiny]\nname: bench\nrun: {{root: {tmp / 'runs'}}}\n"
                      "workload: [/bin/true]\n")
    subprocess.run([exe, "submit", str(recipe)], env=env, capture_output=True, check=True)
    run_dir = next(p for p in (tmp / "runs").iterdir() if not p.name.startswith("."))
    commands = {
        "megalaunch --help": [exe, "--help"],
        "megalaunch recipes list": [exe, "recipes", "list"],
        "megalaunch submit llama3-8b --dry-run": [exe, "submit", "llama3-8b", "--dry-run"],
        "megalaunch status RUN": [exe, "status", str(run_dir)],
        "megalaunch status (all runs)": [exe, "status"],
    }
    print(f"{'command':<40} {'median':>8} {'min':>8} {'max':>8}  (n={args.runs}, target <= {TARGET_S} s)")
    worst = 0.0
    for label, argv in commands.items():
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            proc = subprocess.run(argv, env=env, capture_output=True)
            times.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                print(f"{label}: failed: {proc.stderr.decode().strip()}")
                return 1
        med = statistics.median(times)
        worst = max(worst, med)
        print(f"{label:<40} {med:8.3f} {min(times):8.3f} {max(times):8.3f}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"worst median {worst:.3f} s: {'OK' if worst <= TARGET_S else 'OVER TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
