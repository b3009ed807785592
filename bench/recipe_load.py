"""What `megalaunch submit` spends before it talks to Slurm: loading a recipe and preparing the run (run.yaml
with its provenance comments, the job script, megatron.args), in one process, median of --runs.

    python bench/recipe_load.py [--runs 50] [--recipe tiny] [--cluster clusters/slurm]

Side by side in the same run: run.yaml written with `explain._scalar` (its short cut for common scalars)
and with `explain._scalar_dumped` (PyYAML's emitter for every key and value, as before the short cut).
The first call in a process also evaluates the schema's type hints and lists the shipped recipes (both
cached afterwards): it is printed apart."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from megalaunch.config.loader import load_recipe
from megalaunch.launcher.prepare import explain
from megalaunch.launcher.prepare.prepare import prepare_run


def _ms(fn, runs: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--cluster", default="clusters/slurm")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        Path("r.yaml").write_text(f"include: [{args.recipe}, {args.cluster}]\nname: bench\nrun: {{root: {tmp}/runs}}\n")
        t0 = time.perf_counter()
        loaded = load_recipe("r.yaml")
        first = 1000 * (time.perf_counter() - t0)
        load = _ms(lambda: load_recipe("r.yaml"), args.runs)
        prepare = _ms(lambda: prepare_run(loaded, created="2026-01-01T00:00:00"), args.runs)
        fast = prepare_run(loaded, created="2026-01-01T00:00:00").files["run.yaml"]
        short_cut = explain._scalar
        explain._scalar = explain._scalar_dumped  # type: ignore[assignment]
        try:
            slow = prepare_run(loaded, created="2026-01-01T00:00:00").files["run.yaml"]
            prepare_dumped = _ms(lambda: prepare_run(loaded, created="2026-01-01T00:00:00"), args.runs)
        finally:
            explain._scalar = short_cut  # type: ignore[assignment]
    print(f"recipe {args.recipe} + {args.cluster}, median of {args.runs}")
    print(f"load_recipe, first in the process   {first:7.1f} ms")
    print(f"load_recipe                         {load:7.1f} ms")
    print(f"prepare_run (short cut)             {prepare:7.1f} ms")
    print(f"prepare_run (PyYAML for every leaf) {prepare_dumped:7.1f} ms   ({prepare_dumped / prepare:.1f}x)")
    print(f"run.yaml identical both ways: {fast == slow}")
    return 0 if fast == slow else 1


if __name__ == "__main__":
    sys.exit(main())
