"""What megalaunch's training runtime costs on a GPU, measured in one session on one machine.

    PYTHONPATH=src python bench/train_overhead.py [--recipe train/llama3-1b] [--out DIR] [--stage all]

Stages (each a few minutes on an H100; run them separately to stay under a command time limit):
- `throughput`: megalaunch's entry (`python -m megalaunch.runtime.train RUN`) and a bare
  `megatron.training.pretrain` call (same Megatron arguments, model, data and step; no megalaunch
  seams, watchdog, progress or triggers) run alternately, `--rounds` times each, on fresh run
  directories. Tokens/s and TFLOP/s per GPU come from Megatron's own log lines, averaged after
  the warm-up intervals; overhead = 1 - megalaunch / bare.
- `save`: one run with synchronous and one with asynchronous checkpointing: a regular save at
  iteration 10, then SIGUSR2: blocking save times (megalaunch's log) and signal-to-exit time.
Results: a table on stdout and OUT/train_overhead.json. Needs CUDA, megatron-core 0.19.2, psutil."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# A script in bench/ named like a standard-library module would shadow it (torch imports `inspect`,
# which imports `tokenize`): take bench/ off the path before anything imports it.
sys.path[:] = [p for p in sys.path if p not in ("", str(Path(__file__).resolve().parent))]

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                     r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+))?")
SAVE_RE = re.compile(r"\] checkpoint at iteration (\d+): ([\d.]+) s blocking")

# ~1.2B Llama (Llama 3.2 1B shapes), 2048-token sequences, 16 x 2048 = 32k tokens per step on one GPU.
DEFAULT_SETS = [
    "cluster.backend=local", "cluster.nodes=1", "cluster.gpus_per_node=1", "cluster.tasks_per_node=1",
    "model.seq_length=2048", "model.max_position_embeddings=8192",
    "training.micro_batch_size=2", "training.global_batch_size=16", "training.lr_warmup_iters=5",
    "training.eval_iters=0", "training.log_interval=5", "training.precision=bf16",
    "parallel.use_distributed_optimizer=true", "chain.hang_timeout_s=900", "megatron_args.log-throughput=true",
]


def make_run(root: Path, recipe: str, sets: list[str], name: str) -> Path:
    sys.path.insert(0, str(SRC))
    from megalaunch.config.loader import load_recipe
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    loaded = load_recipe(recipe, sets, name=name, cluster="local")
    return write_run(prepare_run(loaded, root=root)).root


def env_for(run: Path, job_id: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "MEGALAUNCH_RUN_DIR": str(run), "MEGALAUNCH_JOB_ID": job_id,
            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(29500 + int(job_id) % 1000)}


def start(run: Path, job_id: str, *, bare: bool, log: Path) -> subprocess.Popen[bytes]:
    cmd = ([sys.executable, str(Path(__file__).resolve()), "--bare-run", str(run)] if bare
           else [sys.executable, "-m", "megalaunch.runtime.train", str(run)])
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, env=env_for(run, job_id), stdout=f, stderr=subprocess.STDOUT)


def iteration_stats(log_text: str, warmup_intervals: int) -> dict[str, float]:
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3) or "nan")) for m in ITER_RE.finditer(log_text)]
    rows = rows[warmup_intervals:]
    if not rows:
        raise RuntimeError("no iteration lines after the warm-up in the log")
    ms = statistics.mean(r[1] for r in rows)
    return {"ms_per_iteration": ms, "tflops_per_gpu": statistics.mean(r[2] for r in rows), "intervals": len(rows)}


def stage_throughput(out: Path, recipe: str, sets: list[str], iters: int, rounds: int) -> dict[str, Any]:
    # A long schedule, stopped once `iters` iterations are logged: no final save (15+ GB for 1B).
    sets = [*sets, "training.train_iters=100000", "checkpoint.save_interval=1000000"]
    results: dict[str, list[dict[str, float]]] = {"bare": [], "megalaunch": []}
    tokens_per_step = None
    for r in range(rounds):
        for kind in ("bare", "megalaunch") if r % 2 == 0 else ("megalaunch", "bare"):
            run = make_run(out / "runs", recipe, sets, name=f"tp-{kind}-{r}")
            log = out / f"throughput-{kind}-{r}.log"
            p = start(run, str(100 + 10 * r + (kind == "bare")), bare=kind == "bare", log=log)
            while not any(int(m.group(1)) >= iters for m in ITER_RE.finditer(log.read_text(errors="replace"))):
                if p.poll() is not None:
                    raise RuntimeError(f"{kind} run ended early, see {log}")
                time.sleep(0.5)
            p.kill()
            p.wait()
            stats = iteration_stats(log.read_text(errors="replace"), warmup_intervals=2)
            results[kind].append(stats)
            if tokens_per_step is None:
                args = (run / "megatron.args").read_text().split()
                tokens_per_step = int(args[args.index("--global-batch-size") + 1]) * \
                    int(args[args.index("--seq-length") + 1])
            print(f"  {kind:10s} round {r}: {stats['ms_per_iteration']:.1f} ms/iteration, "
                  f"{tokens_per_step / stats['ms_per_iteration'] * 1000:.0f} tokens/s, "
                  f"{stats['tflops_per_gpu']:.1f} TFLOP/s/GPU", flush=True)
    summary: dict[str, Any] = {"tokens_per_step": tokens_per_step, "rounds": rounds, "iters": iters}
    for kind, rows in results.items():
        ms = statistics.mean(x["ms_per_iteration"] for x in rows)
        summary[kind] = {"ms_per_iteration": ms, "tokens_per_s": tokens_per_step / ms * 1000,
                         "tflops_per_gpu": statistics.mean(x["tflops_per_gpu"] for x in rows),
                         "per_round_ms": [x["ms_per_iteration"] for x in rows]}
    summary["overhead_pct"] = 100.0 * (1 - summary["megalaunch"]["tokens_per_s"] / summary["bare"]["tokens_per_s"])
    return summary


def stage_save(out: Path, recipe: str, sets: list[str], modes: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in modes:
        run_sets = [*sets, "training.train_iters=100000", "checkpoint.save_interval=10", "checkpoint.keep_last=1",
                    f"checkpoint.async_save={'true' if mode == 'async' else 'false'}"]
        run = make_run(out / "runs", recipe, run_sets, name=f"save-{mode}")
        log = out / f"save-{mode}.log"
        p = start(run, "300" if mode == "sync" else "301", bare=False, log=log)
        progress = run / "state" / "progress.json"
        deadline = time.monotonic() + 540
        while time.monotonic() < deadline:
            data = _read_json(progress)
            if data and data.get("iteration", 0) >= 17 and SAVE_RE.search(log.read_text(errors="replace")):
                break
            if p.poll() is not None:
                raise RuntimeError(f"{mode} run ended early, see {log}")
            time.sleep(0.05)
        sent = time.monotonic()
        p.send_signal(signal.SIGUSR2)
        code = p.wait(timeout=600)
        signal_to_exit = time.monotonic() - sent
        outcome = _read_json(run / "state" / "outcome.json") or {}
        saves = [(int(i), float(s)) for i, s in SAVE_RE.findall(log.read_text(errors="replace"))]
        summary[mode] = {"exit_code": code, "outcome": outcome.get("status"), "saves": saves,
                         "first_save_s": saves[0][1] if saves else None,
                         "signal_save_s": saves[-1][1] if len(saves) > 1 else None,
                         "signal_to_exit_s": signal_to_exit,
                         "checkpoint_bytes": _dir_size(run / "checkpoints")}
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # 15+ GB each for a 1B model
        print(f"  {mode:5s}: saves {saves}, signal-to-exit {signal_to_exit:.1f} s, outcome {outcome.get('status')}",
              flush=True)
    return summary


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bare_run(run: Path) -> None:
    """`megatron.training.pretrain` with megalaunch's model, data and step but none of its runtime:
    only the dataset-helper fix without which Megatron cannot start from the wheel."""
    sys.path.insert(0, str(SRC))
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.runtime.loop import megatron_seams
    from megalaunch.runtime.loop.step import megatron_argv, run_pretrain
    from megalaunch.runtime.rank.settings import RuntimeSettings

    paths = RunPaths(run)
    settings = RuntimeSettings.load(paths)
    import torch

    if not torch.cuda.is_available():  # only for a smoke test of this script on a machine without a GPU
        from megalaunch.runtime.model import cpu_compat

        cpu_compat.enable()
    megatron_seams.skip_helper_compilation()
    run_pretrain(megatron_argv(paths), attention=settings.attention, session=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="train/llama3-1b")
    parser.add_argument("--set", action="append", default=[], help="extra recipe overrides")
    parser.add_argument("--attention", default="sdpa", choices=["local", "sdpa"])
    parser.add_argument("--iters", type=int, default=40, help="iterations per throughput run")
    parser.add_argument("--rounds", type=int, default=2, help="throughput runs of each kind")
    parser.add_argument("--stage", default="all", choices=["all", "throughput", "save"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "train_overhead")
    parser.add_argument("--save-modes", default="sync,async", help="sync,async (async needs a GPU)")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-test this script without a GPU")
    parser.add_argument("--bare-run", type=Path, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.bare_run:
        bare_run(a.bare_run)
        return 0
    import torch

    if not torch.cuda.is_available() and not a.allow_cpu:
        print("needs a CUDA GPU (or --allow-cpu for a smoke test)", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    sets = [*DEFAULT_SETS, f"training.attention={a.attention}", *a.set]
    result_file = a.out / "train_overhead.json"
    results: dict[str, Any] = _read_json(result_file) or {}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results.update({"device": device, "torch": torch.__version__, "recipe": a.recipe,
                    "sets": sets})
    if a.stage in ("all", "throughput"):
        print(f"throughput: {a.recipe} on {results['device']}", flush=True)
        results["throughput"] = stage_throughput(a.out, a.recipe, sets, a.iters, a.rounds)
    if a.stage in ("all", "save"):
        print("save and signal:", flush=True)
        results["save"] = stage_save(a.out, a.recipe, sets, a.save_modes.split(","))
    result_file.write_text(json.dumps(results, indent=2) + "\n")
    report(results)
    return 0


def report(r: dict[str, Any]) -> None:
    print(f"\n== megalaunch training overhead on {r['device']} (torch {r['torch']}, {r['recipe']}) ==")
    tp = r.get("throughput")
    if tp:
        for kind in ("bare", "megalaunch"):
            k = tp[kind]
            print(f"{kind:11s} {k['tokens_per_s']:10.0f} tokens/s  {k['tflops_per_gpu']:6.1f} TFLOP/s/GPU  "
                  f"{k['ms_per_iteration']:8.1f} ms/iteration  rounds {[f'{x:.1f}' for x in k['per_round_ms']]}")
        print(f"overhead    {tp['overhead_pct']:+.2f} % tokens/s (acceptance: <= 0.5 %)")
    sv = r.get("save")
    if sv:
        for mode, m in sv.items():
            print(f"save {mode:5s}  first {m['first_save_s']} s, on signal {m['signal_save_s']} s blocking, "
                  f"signal-to-exit {m['signal_to_exit_s']:.1f} s, {m['checkpoint_bytes'] / 1e9:.2f} GB on disk, "
                  f"outcome {m['outcome']}")


if __name__ == "__main__":
    sys.exit(main())
