"""Per-segment overhead of a real chain, before and after megalaunch's fast exit, side by side.

Runs `train/llama3-1b` (shapes of Llama 3.2 1B, sdpa, bf16, distributed optimizer) as a chain on the
local backend, twice at the same time on separate GPUs: `before` with MEGALAUNCH_FAST_EXIT=0 (the
trainer leaves through Python's teardown: process-group destruction, data-loader joins, interpreter
shutdown), `after` with the default (it leaves as soon as the outcome is written). Each chain has
three segments: the first two end on the local timer's stop signal, the third on an `exit` trigger.
For each segment it prints, from the run directory (timeline, ledger, task records):

  start->1st iter   `job begin` to the end of the first iteration
  signal->exit      the stop signal (or the trigger's decision) to the last rank's process exit
  save              the blocking time of the save made on the way out
  exit-save         signal->exit minus save: what leaving costs beyond the save

    python bench/goodput.py --gpus-per-variant 2 --out gpu-out/goodput      # on a 4-GPU machine

It also writes `megalaunch report` for the `after` chain into OUT/after-report (figures for docs/)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from megalaunch.launcher.accounting.goodput import chain_goodput  # noqa: E402
from megalaunch.rundir.files import read_json  # noqa: E402
from megalaunch.rundir.ledger import Ledger  # noqa: E402
from megalaunch.rundir.paths import RunPaths  # noqa: E402

SETS = ["training.attention=sdpa", "model.seq_length=2048", "training.micro_batch_size=2",
        "training.global_batch_size=16", "training.train_iters=100000", "training.lr_warmup_iters=5",
        "training.log_interval=1", "training.eval_iters=0", "checkpoint.save_interval=100000",
        "checkpoint.save_time_estimate_s=30", "chain.step_time_estimate_s=2", "chain.signal_margin_s=10",
        "chain.min_train_time_s=10", "chain.hang_timeout_s=600"]


def start_chain(variant: str, out: Path, devices: str, gpus: int, time_limit: str, port: int,
                recipe: str, extra: list[str], profile: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "PYTHONPATH": str(REPO / "src")}
    if profile:  # cProfile of every rank up to its first iteration (runtime/observation/startup_profile.py)
        env["MEGALAUNCH_PROFILE_STARTUP"] = str(out / f"profile-{variant}")
    if variant == "before":  # megalaunch's start-up and exit fixes off
        env["MEGALAUNCH_FAST_EXIT"] = "0"
        env["MEGALAUNCH_DEFER_COMPILE"] = "0"
    root = out / variant
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megalaunch.cli.main", "submit", recipe, "--cluster", "local",
           "--name", f"goodput-{variant}", "--set", f"cluster.gpus_per_node={gpus}", "--set", f"cluster.time={time_limit}",
           "--set", f"run.root={root}", "--set", f"cluster.python={sys.executable}", "--set", f"cluster.master_port={port}",
           *[a for s in extra for a in ("--set", s)]]
    log = open(out / f"{variant}-submit.txt", "w")  # noqa: SIM115 (the chain outlives this function)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)


def run_dir(out: Path, variant: str) -> RunPaths | None:
    found = [p for p in (out / variant).glob("goodput-*") if (p / "state" / "ledger.jsonl").exists()]
    return RunPaths(found[0]) if found else None


def segment_rows(paths: RunPaths) -> list[dict[str, float | str | None]]:
    rows = []
    for seg in Ledger(paths).segments():
        tl = read_json(paths.timeline(seg.job_id)) or {}
        ph = tl.get("phases") or {}
        start = (seg.started or {}).get("time")
        records = [read_json(f) for f in sorted(paths.tasks(seg.job_id).glob("rank-*.json"))]
        exits = [float(r["ended"]) for r in records if isinstance(r, dict) and r.get("ended")]
        saves = tl.get("saves") or []
        last_save = saves[-1] if saves else None
        last_iter = ph.get("last_iteration_end")
        exit_save = last_save if last_save and last_iter and last_save[1] >= last_iter - 0.5 else None
        save_s = (exit_save[2] - exit_save[1]) if exit_save else None
        # the signal's arrival, or for a trigger the moment it was acted on (its save began)
        candidates = [t for t in (ph.get("signal_received"), exit_save[1] if exit_save else None) if t]
        stop = min(candidates) if candidates else ph.get("decision")
        rows.append({
            "job": seg.job_id, "outcome": seg.outcome,
            "start_to_first": (ph["first_iteration_end"] - start) if start and ph.get("first_iteration_end") else None,
            "signal_to_exit": (max(exits) - stop) if exits and stop else None, "save": save_s,
            "phases": {k: round(v - start, 2) for k, v in sorted(ph.items(), key=lambda kv: kv[1])} if start else {},
        })
    for r in rows:
        s2e, save = r["signal_to_exit"], r["save"]
        r["exit_minus_save"] = (s2e - save) if isinstance(s2e, float) and isinstance(save, float) else None
    return rows


def drive(procs: dict[str, subprocess.Popen[str]], out: Path, opts: argparse.Namespace) -> None:
    """Wait for the chains, stopping each with an `exit` trigger once its last segment trains."""
    deadline = time.monotonic() + opts.timeout
    triggered: set[str] = set()
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        for v in procs:
            paths = run_dir(out, v)
            if paths is None or v in triggered:
                continue
            segs = Ledger(paths).segments()
            if len(segs) >= opts.segments and segs[-1].started and (read_json(paths.progress) or {}).get("job_id") == segs[-1].job_id:
                subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "trigger", "exit", str(paths.root),
                                "--reason", "bench: last segment"], env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                               capture_output=True, timeout=60)
                triggered.add(v)
        time.sleep(1)
    for p in procs.values():
        if p.poll() is None:
            p.kill()


PROFILED = ("parse_and_validate_args", "set_global_variables", "_build_tokenizer", "_initialize_distributed",
            "init_process_group", "initialize_model_parallel", "_compile_dependencies", "_set_random_seed",
            "setup_model_and_optimizer", "load_checkpoint", "build_train_valid_test_data_iterators", "import_megatron")


def profile_summary(folder: Path) -> list[str]:
    """Cumulative seconds of the start-up functions that matter, per profiled rank and segment; the
    .prof files are removed afterwards (many and large), the .txt tops stay."""
    import pstats

    lines = []
    for prof in sorted(folder.glob("*.prof")):
        stats = pstats.Stats(str(prof)).stats  # type: ignore[attr-defined]
        best: dict[str, float] = {}
        for (_, _, name), (_, _, _, cum, _) in stats.items():
            if name in PROFILED:
                best[name] = max(best.get(name, 0.0), cum)
        lines.append(f"{prof.stem}: " + ", ".join(f"{k} {best[k]:.2f}" for k in PROFILED if k in best))
        prof.unlink()
    return lines


def fmt(v: object) -> str:
    return f"{v:7.1f}" if isinstance(v, float) else f"{'-':>7}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus-per-variant", type=int, default=2)
    ap.add_argument("--time", default="00:01:40", help="segment time limit (the signal comes 42 s before it)")
    ap.add_argument("--segments", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("gpu-out/goodput"))
    ap.add_argument("--timeout", type=float, default=560)
    ap.add_argument("--recipe", default="train/llama3-1b")
    ap.add_argument("--only", choices=["before", "after"], help="one variant on the first GPUs (no side by side)")
    ap.add_argument("--sequential", action="store_true",
                    help="run the variants one after the other on the same GPUs (for machines with too few GPUs)")
    ap.add_argument("--profile", action="store_true", help="cProfile each rank's start-up into OUT/profile-VARIANT")
    ap.add_argument("--smoke", action="store_true", help="the tiny recipe on the CPU: checks this script, no figures")
    opts = ap.parse_args()
    extra = SETS
    if opts.smoke:
        opts.recipe, extra = "train/tiny", ["training.train_iters=100000", "training.log_interval=1",
                                            "checkpoint.save_time_estimate_s=5", "chain.step_time_estimate_s=1",
                                            "chain.signal_margin_s=5", "chain.min_train_time_s=10",
                                            "cluster.env={MEGALAUNCH_TEST_STEP_SLEEP_S: '0.2', OMP_NUM_THREADS: '1'}"]
    out = opts.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    g = opts.gpus_per_variant
    variants = {"before": ",".join(map(str, range(g))), "after": ",".join(map(str, range(g, 2 * g)))}
    if opts.sequential:
        variants = {v: ",".join(map(str, range(g))) for v in variants}
    if opts.only:
        variants = {opts.only: ",".join(map(str, range(g)))}
    port = {v: 29500 + 17 * i for i, v in enumerate(variants)}

    def launch(v: str) -> subprocess.Popen[str]:
        return start_chain(v, out, variants[v], 0 if opts.smoke else g, opts.time, port[v], opts.recipe, extra,
                           opts.profile)

    if opts.sequential:  # one after the other on the same GPUs: `after` first (it warms nothing for itself)
        for v in sorted(variants, reverse=True):
            drive({v: launch(v)}, out, opts)
    else:
        drive({v: launch(v) for v in variants}, out, opts)
    results = {}
    for v in variants:
        paths = run_dir(out, v)
        results[v] = segment_rows(paths) if paths else []
        if paths:
            chain = chain_goodput(paths, time.time())
            results[v + "_goodput"] = {"goodput": chain["goodput"], "totals": chain["totals"]}
    (out / "goodput.json").write_text(json.dumps(results, indent=1, default=str))
    import torch

    print(f"llama3-1b shapes, seq 2048, 16 x 2048 tokens per step, {g} GPU(s) per chain "
          f"({torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}); seconds")
    print(f"{'segment':>8} | {'before: start->1st':>18} {'sig->exit':>9} {'save':>7} {'exit-save':>9} | "
          f"{'after: start->1st':>17} {'sig->exit':>9} {'save':>7} {'exit-save':>9}")
    for i in range(max(len(results.get("before", [])), len(results.get("after", [])))):
        cells = []
        for v in ("before", "after"):
            if v not in variants:
                cells.append(f"{'(not run)':>18} {'':>9} {'':>7} {'':>9}")
                continue
            r = results[v][i] if i < len(results[v]) else {}
            cells.append(f"{fmt(r.get('start_to_first')):>18} {fmt(r.get('signal_to_exit')):>9} "
                         f"{fmt(r.get('save'))} {fmt(r.get('exit_minus_save')):>9}")
        print(f"{i + 1:>8} | {cells[0]} | {cells[1]}")
    for v in variants:
        for r in results[v]:
            print(f"{v} {r['job']} {r['outcome']}: phases after job begin {r['phases']}")
        gp = results.get(v + "_goodput")
        if gp:
            print(f"{v}: goodput {gp['goodput']:.1%}; " + ", ".join(f"{k} {s:.1f}" for k, s in gp["totals"].items() if s))
    for v in variants:
        if (out / f"profile-{v}").is_dir():
            print(f"{v} profile (cumulative s):", *profile_summary(out / f"profile-{v}"), sep="\n  ")
    import shutil

    for v in variants:  # the run directories without their checkpoints, for a report made elsewhere
        found = run_dir(out, v)
        if found:
            keep = out / "runs" / found.root.name
            shutil.copytree(found.root, keep, ignore=shutil.ignore_patterns("checkpoints", "iter_*"), dirs_exist_ok=True)
            shutil.rmtree(found.checkpoints, ignore_errors=True)
    paths = run_dir(out, "after")
    if paths:
        rep = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "report", str(paths.root), "--out",
                              str(out / "after-report")], env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                             capture_output=True, text=True, timeout=120)
        print(rep.stdout[-500:], rep.stderr[-500:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
