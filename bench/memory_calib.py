"""Memory model calibration: estimated vs measured max allocated memory, and step time, per layout.

    PYTHONPATH=src python bench/memory_calib.py --cases 1b-s4k,1b-s8k,...   # see --list
    PYTHONPATH=src python bench/memory_calib.py --list

Each case is a real megalaunch run (`python -m megalaunch.runtime.train RUN`, one process per GPU, the
local backend's environment) of a few iterations on mock data. Megatron's own memory report after the
first log interval ("max allocated", torch.cuda.max_memory_allocated, MB) gives the measured peak of
every reporting rank (the maximum is taken); the step time comes from the later log lines. One-GPU
cases run two at a time on a 2-GPU machine. Prints a table and writes OUT/memory_calib.json."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if p not in ("", str(Path(__file__).resolve().parent))]
REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
sys.path.insert(0, str(SRC))

MEM_RE = re.compile(r"\[Rank (\d+)\].*?max allocated: ([\d.]+)")
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)"
                     r"(?:.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+))?")

BASE = ["cluster.backend=local", "cluster.nodes=1", "training.lr_warmup_iters=1", "training.train_iters=100000",
        "training.eval_iters=0", "training.log_interval=2", "training.precision=bf16", "training.attention=sdpa",
        "parallel.use_distributed_optimizer=true", "checkpoint.save_interval=1000000", "chain.hang_timeout_s=900",
        "megatron_args.log-throughput=true", "data.num_workers=1"]
L8B8 = ["model.num_layers=8"]  # llama3-8b's width with 8 of its 32 layers (2.8B): fits one or two H100s

# name -> (recipe, GPUs, overrides)
CASES: dict[str, tuple[Any, ...]] = {
    "1b-s4k": ("train/llama3-1b", 1, ["model.seq_length=4096", "training.micro_batch_size=1", "training.global_batch_size=4"]),
    "1b-s8k": ("train/llama3-1b", 1, ["training.micro_batch_size=1", "training.global_batch_size=4"]),
    "1b-s4k-mb2-full": ("train/llama3-1b", 1, ["model.seq_length=4096", "training.micro_batch_size=2",
                                               "training.global_batch_size=4", "training.recompute=full"]),
    "1b-s8k-sel": ("train/llama3-1b", 1, ["training.micro_batch_size=1", "training.global_batch_size=4",
                                          "training.recompute=selective"]),
    "1b-s8k-tp2": ("train/llama3-1b", 2, ["training.micro_batch_size=1", "training.global_batch_size=4",
                                          "parallel.tensor_model_parallel_size=2"]),
    "1b-s8k-dp2-mb2": ("train/llama3-1b", 2, ["training.micro_batch_size=2", "training.global_batch_size=8"]),
    "8b8l-dp2": ("train/llama3-8b", 2, [*L8B8, "training.micro_batch_size=1", "training.global_batch_size=8",
                                        "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]),
    "8b8l-tp2": ("train/llama3-8b", 2, [*L8B8, "training.micro_batch_size=1", "training.global_batch_size=8",
                                        "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=false"]),
    "8b8l-tp2-sp": ("train/llama3-8b", 2, [*L8B8, "training.micro_batch_size=1", "training.global_batch_size=8",
                                           "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    "8b8l-pp2": ("train/llama3-8b", 2, [*L8B8, "training.micro_batch_size=1", "training.global_batch_size=8",
                                        "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
                                        "parallel.pipeline_model_parallel_size=2"]),
    "8b8l-dp2-full": ("train/llama3-8b", 2, [*L8B8, "training.micro_batch_size=1", "training.global_batch_size=8",
                                             "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
                                             "training.recompute=full"]),
}
# One GPU, llama3-8b's width, TP 1, seq 8192 unless named, micro-batch 1: Megatron's kernels (`m`) against
# `kernels: auto` (`a`: liger's RoPE, SwiGLU and fused loss), without the fused kernels (`u`), at micro-batch 2
# (`-mb2`) and liger's ops one at a time; 8 or 4 layers (the per-layer slope), seq 4096 (the per-token slope).
# `--share-gib` runs several on one GPU (docs/results.md, "The memory model at TP 1").
ONE = ["training.micro_batch_size=1", "training.global_batch_size=4", "parallel.tensor_model_parallel_size=1",
       "parallel.sequence_parallel=false", "training.fused_kernels=true"]
for _layers in (8, 4):
    for _seq in (8192, 4096):
        _tag = f"8b{_layers}l{'' if _seq == 8192 else '-s4k'}"
        _sets = [f"model.num_layers={_layers}", f"model.seq_length={_seq}", *ONE]
        CASES[f"{_tag}-m"] = ("train/llama3-8b", 1, [*_sets, "training.kernels=megatron"])
        CASES[f"{_tag}-a"] = ("train/llama3-8b", 1, [*_sets, "training.kernels=auto"])
        CASES[f"{_tag}-u"] = ("train/llama3-8b", 1, [*_sets, "training.kernels=megatron", "training.fused_kernels=false"])
        for _k in ("m", "a"):
            CASES[f"{_tag}-{_k}-mb2"] = (*CASES[f"{_tag}-{_k}"][:2], [*CASES[f"{_tag}-{_k}"][2], "training.micro_batch_size=2"])
        for _op in ("rope", "swiglu", "linear_ce"):
            CASES[f"{_tag}-{_op}"] = ("train/llama3-8b", 1, [*_sets, "training.kernels=liger"],
                                      {"MEGALAUNCH_LIGER_OPS": _op})

CASES["1b-s2k-mb4-a"] = ("train/llama3-1b", 1, ["model.seq_length=2048", "training.micro_batch_size=4",
                                                "training.global_batch_size=8", "training.kernels=auto",
                                                "training.fused_kernels=true"])
CASES["1b-s8k-mb1-a"] = ("train/llama3-1b", 1, ["model.seq_length=8192", "training.micro_batch_size=1",
                                                "training.global_batch_size=16", "training.kernels=auto",
                                                "training.fused_kernels=true"])


def prepare(root: Path, recipe: str, gpus: int, sets: list[str], name: str) -> tuple[Path, Any]:
    """A run directory and the recipe's memory estimate (config/planner/memory.py)."""
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.planner.fit import model_shape, recipe_layout
    from megalaunch.config.planner.memory import estimate
    from megalaunch.config.topology import topology
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    all_sets = [*BASE, f"cluster.gpus_per_node={gpus}", "cluster.gpu=null", *sets]
    loaded = load_recipe(recipe, all_sets, name=run_name(name), cluster="local")
    r = loaded.recipe
    topo = topology(r)
    on_gpu = on_this_gpu(r)
    est = estimate(model_shape(on_gpu, r.data.vocab_size), recipe_layout(on_gpu, topo.dp, topo.num_microbatches))
    return write_run(prepare_run(loaded, root=root)).root, est


def on_this_gpu(recipe: Any) -> Any:
    """The recipe with `cluster.gpu` naming this machine's GPU, for the estimate only (the runs keep cluster.gpu null so
    that preflight's memory check lets every case run): what the job builds on it (the grouped experts on compute
    capability 9.0+, config/planner/fit.py) counts in the estimate as it does where a cluster profile names the GPU."""
    import dataclasses

    from megalaunch.config.planner.gpus import gpu_spec

    try:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        name = None
    spec = gpu_spec(name)
    return dataclasses.replace(recipe, cluster=dataclasses.replace(recipe.cluster, gpu=spec.name)) if spec else recipe


def run_name(case: str) -> str:
    """A case's run name: its letters, digits, dots and dashes (a case may name ops: liger:rope+linear_ce)."""
    return re.sub(r"[^A-Za-z0-9.-]+", "-", case)


TRACE = REPO / "bench" / "memory_trace.py"  # --trace: each rank through it (the peak's blocks, MEMTRACE_OUT)


def launch(run: Path, devices: list[int], log: Path, port: int,
           extra_env: dict[str, str] | None = None, trace: bool = False) -> list[subprocess.Popen[bytes]]:
    procs = []
    f = open(log, "wb")  # noqa: SIM115 (shared by the ranks, closed with the process)
    for rank in range(len(devices)):
        env = {**os.environ, **(extra_env or {}), "PYTHONPATH": str(SRC), "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices)),
               # as the local backend and the job script set it (TP needs 1); Megatron-FSDP refuses 1 (BENCH_MAX_CONNECTIONS)
               "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("BENCH_MAX_CONNECTIONS", "1"),
               "MEGALAUNCH_RUN_DIR": str(run), "MEGALAUNCH_JOB_ID": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(devices)), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        if trace:
            env["MEMTRACE_OUT"] = str(log.with_suffix(f".peak{rank}.txt"))
        entry = [str(TRACE)] if trace else ["-m", "megalaunch.runtime.train"]
        procs.append(subprocess.Popen([sys.executable, *entry, str(run)], env=env,
                                      stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def measure(log: Path, iters: int) -> dict[str, Any] | None:
    text = log.read_text(errors="replace")
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3) or "nan")) for m in ITER_RE.finditer(text)]
    mems = [float(m.group(2)) for m in MEM_RE.finditer(text)]
    if not mems or not rows or rows[-1][0] < iters:
        return None
    later = [r for r in rows if 2 < r[0] <= iters] or rows  # later ones may be a profiler's
    return {"max_allocated_gib": max(mems) / 1024, "ms_per_iteration": statistics.mean(r[1] for r in later),
            "tflops_per_gpu": statistics.mean(r[2] for r in later)}


def _wait_gpu_free(devices: list[int], timeout: float = 60.0) -> None:
    """Until no process holds memory on `devices` (a killed case's memory is freed a little later)."""
    def query(what: str, fields: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False)
        return [[f.strip() for f in line.split(",")] for line in out.stdout.splitlines() if line.strip()]

    buses = {bus for index, bus in query("gpu", "index,pci.bus_id") if index.isdigit() and int(index) in devices}
    deadline = time.monotonic() + timeout
    while buses and any(bus in buses for _, bus in query("compute-apps", "pid,gpu_bus_id")):
        if time.monotonic() > deadline:
            print(f"  GPU memory still held after {timeout:g} s: the next case may be slower", flush=True)
            return
        time.sleep(1)


def run_cases(names: list[str], out: Path, iters: int, gpus_available: int, timeout: float,
              cases: dict[str, tuple[Any, ...]] = CASES, ready: Any = None, share_gib: float = 0.0,
              trace: bool = False) -> list[dict[str, Any]]:
    """Train each case (recipe, GPUs, overrides[, environment]) until `iters` iterations are logged (and
    `ready(name)`, where given, is true: a profiler's trace written), as many at once as the GPUs allow
    (`share_gib`: one-GPU cases share a GPU while their estimates, + 10 % and 3 GiB each, sum under it);
    one row per case."""
    pending = list(names)
    running: list[tuple[str, list[int], list[subprocess.Popen[bytes]], Path, Any, float, float]] = []
    results = []
    load = [0.0] * gpus_available  # GiB taken per GPU (a whole GPU: inf)
    prepared: dict[str, tuple[Path, Any]] = {}
    port = 29600
    while pending or running:
        for name in list(pending):
            recipe, gpus, sets, *env = cases[name]
            if name not in prepared:
                prepared[name] = prepare(out / "runs", recipe, gpus, sets, name)
            run, est = prepared[name]
            need = est.total / 2**30 * 1.1 + 3 if share_gib and gpus == 1 else float("inf")
            devs = [d for d in range(gpus_available) if load[d] == 0 or load[d] + need <= share_gib][:gpus]
            if len(devs) == gpus:
                for d in devs:
                    load[d] += need
                port += 1
                log = out / f"{run_name(name)}.log"
                running.append((name, devs, launch(run, devs, log, port, *(env or [None]), trace=trace), log, est,
                                time.monotonic(), need))
                pending.remove(name)
        time.sleep(2)
        for item in list(running):
            name, devs, procs, log, est, t0, need = item
            got = measure(log, iters)
            if got and ready is not None and not ready(name):
                got = None
            dead = any(p.poll() is not None for p in procs)
            if got or dead or time.monotonic() - t0 > timeout:
                for p in procs:  # the whole session: a trainer's helpers (checkpoint workers) hold GPU memory too
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                if share_gib:
                    time.sleep(3)  # other cases hold the GPU: nvidia-smi cannot say when this one's memory is free
                else:
                    _wait_gpu_free(devs)
                running.remove(item)
                for d in devs:
                    load[d] = max(0.0, load[d] - need) if need != float("inf") else 0.0
                results.append(_row(name, devs, est, got, log))
    return results


def _row(name: str, devs: list[int], est: Any, got: dict[str, Any] | None, log: Path) -> dict[str, Any]:
    row = {"case": name, "gpus": len(devs), "estimate_gib": est.total / 2**30,
           "breakdown": est.breakdown(), **(got or {"error": f"no result, see {log.name}"})}
    if got:
        row["error_pct"] = 100 * (row["estimate_gib"] / got["max_allocated_gib"] - 1)
    print(f"  {name}: {json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})}",
          flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--share-gib", type=float, default=0.0,
                        help="one-GPU cases share a GPU up to this many GiB of estimates (+10 %% and 3 GiB each)")
    parser.add_argument("--trace", action="store_true", help="what is alive at the peak (bench/memory_trace.py)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")) / "memory_calib")
    a = parser.parse_args()
    if a.list:
        for name, (recipe, gpus, sets, *env) in CASES.items():
            print(f"{name:18s} {gpus} GPU  {recipe}  {' '.join(sets)}{'  ' + str(env[0]) if env else ''}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs CUDA GPUs", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    rows = run_cases([c for c in a.cases.split(",") if c], a.out, a.iters, torch.cuda.device_count(), a.timeout,
                     share_gib=a.share_gib, trace=a.trace)
    result_file = a.out / "memory_calib.json"
    old = json.loads(result_file.read_text()) if result_file.exists() else {"rows": []}
    done = {r["case"] for r in rows}
    data = {"device": device, "torch": torch.__version__, "rows": [r for r in old["rows"] if r["case"] not in done] + rows}
    result_file.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\n== memory model vs measured on {device} ==")
    print(f"{'case':18s} {'GPUs':>4} {'estimate':>9} {'measured':>9} {'error':>7} {'s/iter':>7} {'TFLOP/s':>8}")
    for r in data["rows"]:
        if "max_allocated_gib" in r:
            print(f"{r['case']:18s} {r['gpus']:>4} {r['estimate_gib']:>7.1f} G {r['max_allocated_gib']:>7.1f} G "
                  f"{r['error_pct']:>+6.1f}% {r['ms_per_iteration'] / 1000:>7.2f} {r['tflops_per_gpu']:>8.1f}")
        else:
            print(f"{r['case']:18s} {r['gpus']:>4} {r['estimate_gib']:>7.1f} G  {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
