"""A soak at 32 nodes (issue 50): a chain on the scale cluster under a random schedule of faults for N minutes
of training, each fault's recovery timed, consumed samples checked at every resume, goodput by cause.

    sudo .ci/slurm-up scale                       # the 36-node cluster (booted here when it does not answer)
    .venv/bin/python bench/soak.py --minutes 32   # root: it kills and freezes the cluster's nodes

Faults (a shuffled cycle of all six, one every --gap seconds, each once training has resumed from the last):
- node_killed: a node (not the batch host, not the keeper's) SIGKILLed whole (tests/slurm/scale.kill_node);
- node_frozen: a node SIGSTOPped whole, as a machine that loses power or its network (scale.freeze_node);
- rank_killed: one trainer process SIGKILLed on a live node;
- rank_frozen: one trainer process SIGSTOPped on a live node (its supervisor and node go on);
- batch_host_killed: the allocation's first node (job script, srun, hang watcher) SIGKILLed whole;
- slow_node: one node's trainer stopped 0.3 s of every second for 45 s: a straggler, which must NOT restart.
After each, the node is revived or thawed and taken off the suspect list, so the pool does not run dry.
The training step is the stand-in trainer (runtime/standin.py; 32 real CPU trainers do not fit 2 cores).
--default-timeouts runs with Slurm's default node timeouts (SlurmdTimeout=300, MessageTimeout=10) instead
of the cluster's short ones. Prints a table per fault and the chain's goodput by cause (docs/scale.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "slurm"), str(REPO / "src")]
os.environ.setdefault("SLURM_CONF", "/etc/slurm-scale/slurm.conf")

from scale import (  # noqa: E402
    freeze_node,
    kill_node,
    node_processes,
    revive_node,
    slurm_default_timeouts,
    thaw_node,
    wait_node_state,
)

from megalaunch.launcher.accounting.goodput import chain_goodput  # noqa: E402
from megalaunch.rundir.hostlist import expand_hostlist  # noqa: E402
from megalaunch.rundir.paths import RunPaths  # noqa: E402

KINDS = ("node_killed", "node_frozen", "rank_killed", "rank_frozen", "batch_host_killed", "slow_node")
MEGALAUNCH = str(Path(sys.executable).with_name("megalaunch"))
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)")
RECOVERY_LIMIT_S = 420.0


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([MEGALAUNCH, *args], capture_output=True, text=True, timeout=timeout, env=env)


def ledger(run: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(x) for x in (run / "state" / "ledger.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def wait(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := predicate():
            return got
        time.sleep(interval)
        if int(time.monotonic()) % 10 == 0:
            resume_drained()
    raise TimeoutError(f"{what}: not within {timeout:g} s")


def progress(run: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(json.loads((run / "state" / "progress.json").read_text()).get("iteration") or 0)
    return 0


def trained_after(run: Path, t: float) -> tuple[str, float] | None:
    """(job, when) of the first iteration of a step that started after `t` (every segment's timeline)."""
    found = []
    for path in (run / "state" / "timeline").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            value = (json.loads(path.read_text()).get("phases") or {}).get("first_iteration_end")
            if isinstance(value, (int, float)) and value > t:
                found.append((path.stem, float(value)))
    return min(found, key=lambda x: x[1]) if found else None


def current_step(run: Path) -> dict[str, Any]:
    return [e for e in ledger(run) if e["event"] == "step_started"][-1]


def allocation(job: str) -> list[str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=15).stdout
    m = re.search(r"\bNodeList=(\S+)", out)
    return expand_hostlist(m.group(1)) if m else []


def trainer_pids(node: str) -> list[int]:
    """The node's trainer processes (the children the task supervisors start)."""
    _, _, tasks = node_processes(node)
    out = []
    for pid in tasks:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv[1:3] == [b"-m", b"megalaunch.runtime.train"]:  # not its supervisor (runtime.task ... -- ...)
                out.append(pid)
    return sorted(out)


def recipe(tmp: Path, args: argparse.Namespace) -> Path:
    import yaml

    from megalaunch.runtime.rank.dist_env import free_port

    health = tmp / "node-health"
    health.mkdir(mode=0o2777, exist_ok=True)
    data = {
        "include": ["tiny"], "name": "soak", "run": {"root": str(tmp / "runs")},
        "cluster": {"backend": "slurm", "nodes": args.nodes, "spare_nodes": args.spares,
                    "min_nodes": args.nodes // 2, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1,
                    "time": f"00:{args.segment_minutes:02d}:00", "python": sys.executable, "megalaunch": MEGALAUNCH,
                    "master_port": free_port(), "node_health_dir": str(health),
                    "env": {"MEGALAUNCH_TEST_STAND_IN": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": "0.5",
                            "PYTHONDONTWRITEBYTECODE": "", "OMP_NUM_THREADS": "1"}},
        "training": {"train_iters": 1000000, "log_interval": 10, "micro_batch_size": 1,
                     "global_batch_size": args.nodes},
        "checkpoint": {"save_interval": 20, "save_time_estimate_s": 1, "keep_last": 3},
        "chain": {"step_time_estimate_s": 1, "signal_margin_s": 29, "min_train_time_s": 20, "trigger_interval": 1,
                  "restarts_per_segment": 6, "hang_timeout_s": "auto", "startup_timeout_s": "auto",
                  "max_segments_without_progress": 5},
    }
    path = tmp / "soak.yaml"
    path.write_text(yaml.safe_dump(data))
    path.chmod(0o644)
    return path


def slow(node: str, seconds: float, stop: threading.Event) -> None:
    """A straggler: the node's trainers stopped 0.3 s of every second."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop.is_set():
        pids = trainer_pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        time.sleep(0.3)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.7)


def resume_drained() -> list[str]:
    """Slurm's "Kill task failed" drains of this one-host cluster (docs/scale.md: an artefact of 36 slurmd's on
    one host) resumed, as the tests do: a drained node would starve the successor."""
    out = subprocess.run(["sinfo", "-h", "-R", "-o", "%E|%N"], capture_output=True, text=True, timeout=30).stdout
    nodes = [n for line in out.splitlines() if line.startswith("Kill task failed|")
             for n in expand_hostlist(line.split("|", 1)[1])]
    if nodes:
        subprocess.run(["scontrol", "update", f"nodename={','.join(nodes)}", "state=resume"], timeout=30, check=False)
    return nodes


def inject(kind: str, run: Path, rng: random.Random) -> dict[str, Any]:
    """Do one fault to the running step; what was done, to whom, when, and how to undo it."""
    step = current_step(run)
    job = str(step["job_id"])
    alloc = allocation(job)
    nodes = expand_hostlist(step["nodes"])
    others = [n for n in nodes if n not in (alloc[0], alloc[-1])]  # not the batch host, not the keeper's
    target = alloc[0] if kind == "batch_host_killed" else rng.choice(others)
    fault: dict[str, Any] = {"kind": kind, "target": target, "job": job, "iteration": progress(run)}
    if kind in ("node_killed", "batch_host_killed"):
        fault["time"] = kill_node(target).time
        fault["undo"] = lambda: revive_node(target)
    elif kind == "node_frozen":
        frozen = freeze_node(target)
        fault["time"], fault["undo"] = frozen.time, lambda: thaw_node(frozen)
    elif kind in ("rank_killed", "rank_frozen"):
        pid = wait(lambda: trainer_pids(target), 30, f"a trainer on {target}")[0]
        fault["time"] = time.time()
        os.kill(pid, signal.SIGKILL if kind == "rank_killed" else signal.SIGSTOP)
        fault["undo"] = lambda: None  # a stopped process dies with its step (SIGKILL reaches it)
    else:
        stop = threading.Event()
        thread = threading.Thread(target=slow, args=(target, 45.0, stop), daemon=True)
        fault["time"] = time.time()
        thread.start()
        fault["undo"] = lambda: (stop.set(), thread.join())
    return fault


def recover(run: Path, fault: dict[str, Any]) -> dict[str, Any]:
    """Wait until training went on after the fault; the figures."""
    t0 = fault["time"]
    if fault["kind"] == "slow_node":
        before = progress(run)
        time.sleep(50)
        fault["undo"]()
        bad = [e for e in ledger(run) if e["time"] > t0 and e["event"] in ("step_nodes_lost", "restart", "hang_killed")]
        return {"recovered_s": None, "restarted": bool(bad), "progressed": progress(run) - before,
                "detected": bad[0]["event"] if bad else "none (a straggler, no restart)", "cause": ""}
    try:
        job, first = wait(lambda: trained_after(run, t0), RECOVERY_LIMIT_S, f"training after {fault['kind']}")
    except TimeoutError:
        return {"recovered_s": None, "restarted": None, "detected": f"NOT RECOVERED in {RECOVERY_LIMIT_S:g} s",
                "cause": "", "redone": None}
    events = [e for e in ledger(run) if e["time"] > t0]
    detect = next((e for e in events if e["event"] in ("step_nodes_lost", "hang_killed", "restart", "ended")), {})
    cause = next((e.get("reason") or e.get("after") or "" for e in events if e["event"] in ("restart", "ended")), "")
    resumed = next((int(e.get("checkpoint_iteration") or 0) for e in events
                    if e["event"] in ("restart", "started") and e.get("checkpoint_iteration") is not None), None)
    return {"recovered_s": first - t0, "job_after": job, "detected": detect.get("event", "?"),
            "detected_s": detect["time"] - t0 if detect else None, "cause": str(cause)[:110],
            "redone": fault["iteration"] - resumed if resumed is not None else None}


def consumed_exact(run: Path, gbs: int) -> tuple[int, list[str]]:
    """Every logged iteration's consumed samples == iteration x the global batch, in every segment's log."""
    lines, bad = 0, []
    for log in sorted((run / "logs").glob("*.out")):
        for m in ITERATION.finditer(log.read_text(errors="replace")):
            lines += 1
            if int(m.group(2)) != int(m.group(1)) * gbs:
                bad.append(f"{log.name}: iteration {m.group(1)} consumed {m.group(2)}")
    return lines, bad


def soak(args: argparse.Namespace, tmp: Path) -> int:
    rng = random.Random(args.seed)
    proc = cli("submit", str(recipe(tmp, args)))
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return 1
    run = next(p for p in (tmp / "runs").iterdir() if not p.name.startswith("."))
    wait(lambda: [e for e in ledger(run) if e["event"] == "step_started"], 300, "the first step")
    wait(lambda: progress(run) > 5, 300, "the first iterations")
    began, faults, kinds = time.time(), [], []
    try:
        while time.time() - began < args.minutes * 60:
            time.sleep(rng.uniform(*args.gap))
            wait(lambda: RunPaths(run).read_tracker() and progress(run) > (faults[-1]["iteration"] if faults else 0),
                 RECOVERY_LIMIT_S, "a checkpoint and progress before the next fault")
            kinds = kinds or rng.sample(KINDS, len(KINDS))
            fault = inject(kinds.pop(), run, rng)
            fault.update(recover(run, fault))
            if fault["kind"] != "slow_node" and fault["recovered_s"] is None:
                fault["undo"]()
                faults.append(fault)
                print(f"[{(fault['time'] - began) / 60:5.1f} min] {fault['kind']} {fault['target']}: NOT RECOVERED; "
                      "the soak stops here", flush=True)
                break
            if fault["kind"] != "slow_node":
                fault["undo"]()
                if fault["kind"].startswith(("node", "batch")):
                    wait_node_state(fault["target"], lambda s: not s.startswith(("down", "drain")) and not s.endswith("*"),
                                    400, what=f"{fault['target']} back")
                cli("nodes", "clear", fault["target"], "--where", str(tmp / "node-health"))
            print(f"[{(fault['time'] - began) / 60:5.1f} min] {fault['kind']:17s} {fault['target']:8s} "
                  f"-> {fault.get('detected')} after {fault.get('detected_s') or 0:.1f} s, trained again after "
                  f"{fault['recovered_s'] or 0:.1f} s; {fault.get('cause')}", flush=True)
            fault["drains_resumed"] = resume_drained()
            faults.append(fault)
    finally:
        cli("cancel", str(run))
    return report(run, args, faults, time.time() - began)


def report(run: Path, args: argparse.Namespace, faults: list[dict[str, Any]], wall: float) -> int:
    lines, bad = consumed_exact(run, args.nodes)
    resumes = sum(1 for e in ledger(run) if e["event"] in ("restart", "started") and e.get("checkpoint_iteration"))
    print(f"\n{len(faults)} faults in {wall / 60:.1f} min; {lines} iteration lines, consumed samples exact: "
          f"{'yes' if not bad else 'NO: ' + '; '.join(bad[:5])} ({resumes} resumes)")
    print("\n| # | at (min) | fault | target | detected by | after (s) | trained again (s) | iterations redone | cause recorded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, f in enumerate(faults, 1):
        rec = (f"{f['recovered_s']:.1f}" if f["recovered_s"] is not None
               else "no restart" if f["kind"] == "slow_node" else "NOT RECOVERED")
        det = f"{f['detected_s']:.1f}" if f.get("detected_s") is not None else "-"
        print(f"| {i} | {(f['time'] - faults[0]['time']) / 60:.1f} | {f['kind']} | {f['target']} | {f['detected']} | "
              f"{det} | {rec} | {f.get('redone', '-')} | {f['cause'].replace('|', '/')} |")
    g = chain_goodput(RunPaths(run), time.time())
    print(f"\ngoodput {g['goodput']:.1%} of {g['wall'] / 60:.1f} min; by cause (s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in g["totals"].items() if v))
    Path(args.out).write_text(json.dumps([{k: v for k, v in f.items() if k != "undo"} for f in faults], indent=1))
    failed = [f for f in faults if (f["kind"] == "slow_node" and f["restarted"])
              or (f["kind"] != "slow_node" and f["recovered_s"] is None)]
    return 1 if bad or failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=32.0, help="training time under faults")
    p.add_argument("--nodes", type=int, default=32)
    p.add_argument("--spares", type=int, default=2)
    p.add_argument("--segment-minutes", type=int, default=8, help="each job's time limit (SIGUSR2 stops too)")
    p.add_argument("--gap", type=float, nargs=2, default=(60.0, 120.0), help="seconds between faults (uniform)")
    p.add_argument("--seed", type=int, default=50)
    p.add_argument("--default-timeouts", action="store_true", help="Slurm's default SlurmdTimeout/MessageTimeout")
    p.add_argument("--out", default="soak.json", help="the figures as JSON")
    args = p.parse_args()
    if subprocess.run(["sinfo"], capture_output=True, timeout=30).returncode != 0:
        subprocess.run([str(REPO / ".ci" / "slurm-up"), "scale"], check=True)
    tmp = Path(tempfile.mkdtemp(prefix="megalaunch-soak-"))
    tmp.chmod(0o755)
    print(f"soak: {args.nodes} nodes + {args.spares} spares, {args.minutes:g} min, work dir {tmp}", flush=True)
    with slurm_default_timeouts() if args.default_timeouts else contextlib.nullcontext():
        return soak(args, tmp)


if __name__ == "__main__":
    sys.exit(main())
