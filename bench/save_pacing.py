"""Save pacing before and after (issue #50, item 6): periodic asynchronous saves closer together than
the disk writes them, then a stop signal while a periodic save is still writing.

One GPU, the real trainer (`python -m megalaunch.runtime.task -- python -m megalaunch.runtime.train RUN`,
Megatron's loop, its persistent writer, megalaunch's pinned staging), llama3-1b's shape (17.3 GB a
checkpoint), from scratch, `checkpoint.keep_last=1`. Per mode (MEGALAUNCH_SAVE_PACING=0 "off": every save
waits behind the write in flight, as Megatron does; "on": runtime/stop/save_pacing.py), one segment:
periodic saves every `--save-interval` iterations until `--saves` of them were handed to the writer,
then SIGUSR2 `--stop-after-s` seconds after the newest one's hand-off, while it is still writing.

    PYTHONPATH=src python bench/save_pacing.py --out DIR [--root /tmp/pacing] [--modes off,on]
        [--save-interval 10] [--saves 8] [--set KEY=VALUE ...] [--json DIR/save_pacing.json]
    PYTHONPATH=src python bench/save_pacing.py --smoke --out DIR   # the tiny recipe on the CPU (checks the script)

Prints, per mode and side by side: each periodic save's blocking seconds (from the timeline: its start
to its return, the space check included), their max and median, the deferrals (ledger `save_deferred`,
`deferred_save_taken`), and the stop: the iteration it was decided at, the save still writing then,
what it left with (`stop_save_replaced` or its own save) and its time from the signal to the outcome
(`signal_received` -> `exit` on the timeline). No assertion: the figures are the result."""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO / "src"))

GPU_SETS = ["cluster.backend=local", "cluster.gpus_per_node=1", "cluster.tasks_per_node=1",
            "model.seq_length=2048", "model.max_position_embeddings=8192", "training.global_batch_size=8",
            "training.micro_batch_size=8", "training.lr_warmup_iters=5", "training.eval_iters=0",
            "training.log_interval=5", "training.train_iters=100000", "checkpoint.keep_last=1",
            "checkpoint.milestone_interval=0", "chain.hang_timeout_s=900"]
SMOKE_SETS = ["cluster.backend=local", "training.micro_batch_size=2", "training.global_batch_size=2",
              "training.log_interval=1", "training.train_iters=100000", "checkpoint.keep_last=1",
              "megatron_args.async_save=true", "megatron_args.use_persistent_ckpt_worker=true",
              "megatron_args.async_strategy=mcore"]
SMOKE_ENV = {"MEGALAUNCH_TEST_CPU_ASYNC_SAVE": "1", "MEGALAUNCH_TEST_SAVE_DELAY_S": "2:periodic",
             "OMP_NUM_THREADS": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": "0.1"}
HANDED = re.compile(r"save at iteration (\d+): state and plan ([\d.]+) s, staging ([\d.]+) s")
SAVED = re.compile(r"successfully saved checkpoint from iteration\s+(\d+) ")


def make_run(root: Path, recipe: str, sets: list[str]) -> Any:
    from megalaunch.config.loader import load_recipe
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    return write_run(prepare_run(load_recipe(recipe, [*sets, f"run.root={root}"], cluster="local")))


def start(paths: Any, job: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """One rank under the task supervisor, in a process group of its own (the signal reaches it all)."""
    from megalaunch.runtime.rank.dist_env import free_port

    e = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MEGALAUNCH_RUN_DIR": str(paths.root),
         "MEGALAUNCH_JOB_ID": job, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(free_port()), "WANDB_MODE": "offline", **env}
    argv = [sys.executable, "-m", "megalaunch.runtime.task", "--signal", "SIGUSR2", "--",
            sys.executable, "-m", "megalaunch.runtime.train", str(paths.root)]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=e, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def in_flight(text: str) -> list[int]:
    """Iterations handed to the writer and not yet reported saved, from the rank's log."""
    saved = {int(m.group(1)) for m in SAVED.finditer(text)}
    return [int(m.group(1)) for m in HANDED.finditer(text) if int(m.group(1)) not in saved]


def stop_during_write(proc: subprocess.Popen[bytes], log: Path, saves: int, after_s: float,
                      timeout_s: float) -> dict[str, Any]:
    """Once `saves` periodic saves were handed over, SIGUSR2 `after_s` after the newest hand-off, if it
    is still writing then (else the next one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text(errors="replace")
        handed = HANDED.findall(text)
        writing = in_flight(text)
        if len(handed) >= saves and writing and writing[-1] == int(handed[-1][0]):
            time.sleep(after_s)
            if writing[-1] in in_flight(log.read_text(errors="replace")):
                os.killpg(proc.pid, signal.SIGUSR2)
                return {"signal_at": time.time(), "writing_at_signal": writing[-1], "handed": len(handed)}
        time.sleep(0.2)
    raise SystemExit(f"no periodic save in flight to stop during (log: {log})")


def figures(paths: Any, job: str, stop: dict[str, Any]) -> dict[str, Any]:
    from megalaunch.rundir.files import read_json, read_jsonl

    timeline = read_json(paths.timeline(job)) or {}
    events = read_jsonl(paths.ledger)
    outcome = read_json(paths.outcome) or {}
    stop_at = outcome.get("iteration")
    first: dict[int, float] = {}
    for iteration, begin, end in timeline.get("saves", []):
        first.setdefault(int(iteration), float(end) - float(begin))
    blocking = [round(s, 2) for i, s in sorted(first.items()) if stop_at is None or i < stop_at]
    phases = timeline.get("phases", {})
    replaced = [e for e in events if e["event"] == "stop_save_replaced"]
    return {
        "outcome": outcome.get("status"), "stop_iteration": stop_at, **stop,
        "periodic_blocking_s": blocking, "blocking_max_s": max(blocking, default=None),
        "blocking_median_s": round(statistics.median(blocking), 2) if blocking else None,
        "deferred": [e["iteration"] for e in events if e["event"] == "save_deferred"],
        "taken": [(e["due"], e["iteration"], e["waited"]) for e in events if e["event"] == "deferred_save_taken"],
        "writes_s": [round(c - b, 2) for _i, b, c in timeline.get("writes", [])],
        "left_with": replaced[0]["checkpoint"] if replaced else None,
        "checkpoint": paths.read_tracker(),
        "signal_to_exit_s": (round(phases["exit"] - phases["signal_received"], 2)
                             if "exit" in phases and "signal_received" in phases else None),
    }


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    import shutil

    root = args.root / mode
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    recipe = "tiny" if args.smoke else args.recipe
    sets = [*(SMOKE_SETS if args.smoke else GPU_SETS), f"checkpoint.save_interval={args.save_interval}", *args.sets]
    paths = make_run(root, recipe, sets)
    env = {**(SMOKE_ENV if args.smoke else {}), "MEGALAUNCH_SAVE_PACING": "1" if mode == "on" else "0"}
    log = args.out / f"trainer-{mode}.log"
    t0 = time.time()
    proc = start(paths, "1", env, log)
    try:
        stop = stop_during_write(proc, log, args.saves, args.stop_after_s, args.timeout_s)
        proc.wait(timeout=args.timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = {"mode": mode, "exit_code": proc.returncode, "wall_s": round(time.time() - t0, 1),
              **figures(paths, "1", stop)}
    print(f"{mode}: " + json.dumps(result), flush=True)
    if not args.keep:
        shutil.rmtree(paths.checkpoints, ignore_errors=True)  # 17 GB each: the next mode needs the disk
    return result


ROWS = ("outcome", "periodic_blocking_s", "blocking_max_s", "blocking_median_s", "deferred", "taken", "writes_s",
        "writing_at_signal", "stop_iteration", "left_with", "checkpoint", "signal_to_exit_s", "wall_s")


def table(results: list[dict[str, Any]]) -> str:
    width = max(len(r) for r in ROWS) + 2
    lines = [f"{'':<{width}}" + "".join(f"{'pacing ' + r['mode']:<44}" for r in results)]
    for row in ROWS:
        lines.append(f"{row:<{width}}" + "".join(f"{json.dumps(r.get(row)):<44}" for r in results))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="logs and the JSON go here")
    ap.add_argument("--root", type=Path, default=Path("/tmp/megalaunch-pacing-bench"), help="the run directories")
    ap.add_argument("--recipe", default="train/llama3-1b")
    ap.add_argument("--modes", default="off,on", help="off: every save waits (MEGALAUNCH_SAVE_PACING=0); on: paced")
    ap.add_argument("--save-interval", type=int, default=10, help="iterations between periodic saves")
    ap.add_argument("--saves", type=int, default=8, help="periodic saves handed over before the stop")
    ap.add_argument("--stop-after-s", type=float, default=2.0, help="the signal this long after the newest hand-off")
    ap.add_argument("--timeout-s", type=float, default=280.0, help="per mode, for the stop and again for the exit")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (else deleted after each mode)")
    ap.add_argument("--smoke", action="store_true", help="the tiny recipe on the CPU (checks the script)")
    ap.add_argument("--json", type=Path, help="default: OUT/save_pacing.json")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    if args.smoke:  # the writer is slowed by 2 s there (SMOKE_ENV)
        args.save_interval, args.saves, args.stop_after_s = 3, min(args.saves, 4), min(args.stop_after_s, 0.3)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_mode(args, mode.strip()) for mode in args.modes.split(",") if mode.strip()]
    print(table(results), flush=True)
    (args.json or args.out / "save_pacing.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
