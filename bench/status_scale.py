"""`megalaunch status` at scale (issue 33): over many runs, and over one run with thousands of segments.

    python bench/status_scale.py [--runs 1000] [--segments 5000] [--iters-per-segment 200]
                                 [--log-interval 50] [--repeat 5] [--keep]

Builds, in a temporary directory, `--runs` runs of the `tiny` recipe with `cluster.backend=slurm`, all
registered in a private XDG_STATE_HOME registry: one prepared with megalaunch's own prepare/write
functions, the others copies of it under new names (a few seconds, not minutes). Each ordinary run gets a
ledger of 2 to 6 segments as the chain and the trainer write them, its timelines, metrics, progress and
outcome; most have stopped (their last queued successor cancelled), some are running, some were stopped
by the crash-loop guard. One more run (a 32-node job, counted in `--runs`) has `--segments` segments:
per segment `started`, `submitted` (its successor), `step_started` (a compressed host list), the trainer's
`attention`, `kernels`, `resumed`, `health_check` (256 ranks on 32 nodes), `stragglers`,
`checkpoint_deleted`, `decision` and `ended`; a timeline per segment; metrics every `--log-interval`
iterations of `--iters-per-segment` per segment (defaults: 1,000,000 iterations, 20,000 metrics lines);
every 500th segment restarted in the job, every 700th killed (accounted for by the next), every 900th
failed (a suspect node, an exclusion, a guard decision), one exit trigger and a `resume` halfway, a
signal lead raised and a periodic save skipped in the signal window now and then. Its last segment is
running, its successor queued.

Slurm is counted, not needed: a directory first on PATH holds `squeue`, `sacct`, `scontrol`, `sinfo`,
`sbatch` and `scancel` shims that log their argv, then run the real command where there is one (the
synthetic job ids, 910000000 and up, are unknown to it) or print nothing and exit 0.

Each command runs as a fresh process, as a user types it; the table gives the median, min and max wall
time of `--repeat` runs, their median CPU time (user + system, the command's and its children's: on a
shared machine steadier than the wall time) and the Slurm commands each run made (every call of one of the
six, whatever its arguments). Target: each median <= 1.0 s and exactly ONE Slurm command per status
(every case here has unfinished segments to ask about; a status with nothing unfinished would make
none). Exits 1 when over target. Defaults: a ledger of ~17 MB (60,000 events, a health check per
segment) for the big run, ~45 events for each other run."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_S = 1.0
SLURM_COMMANDS = ("squeue", "sacct", "scontrol", "sinfo", "sbatch", "scancel")
GPU = "NVIDIA H100 80GB HBM3"
BIG_NODES, GPUS_PER_NODE = 32, 8


class RunWriter:
    """A run's state as a Slurm chain leaves it: ledger events, timelines, metrics, checkpoints."""

    def __init__(self, paths: Any, first_job: int, *, nodes: int, world: int, iters: int, log_interval: int,
                 rng: random.Random) -> None:
        self.paths, self.job, self.nodes, self.world = paths, first_job, nodes, world
        self.iters, self.log_interval, self.t, self.rng = iters, log_interval, 0.0, rng  # shifted by `write`
        self.events: list[dict[str, Any]] = []
        self.metrics: list[dict[str, Any]] = []
        self.timelines: dict[str, dict[str, Any]] = {}
        self.ckpt: int | None = None
        self.iteration = 0
        self.host = "login1"
        self.node_list = f"snode[1-{nodes}]" if nodes > 1 else "snode1"

    # ---------------------------------------------------------------------------------- the ledger
    def chain(self, event: str, **fields: Any) -> None:  # launcher side: Ledger.append adds user and host
        self.events.append({"event": event, "time": self.t, "user": "alice", "host": self.host, **fields})

    def trainer(self, event: str, job: int, **fields: Any) -> None:  # the job's RankContext.ledger
        self.events.append({"event": event, "time": self.t, "job_id": str(job), **fields})

    def submit_first(self, by: str = "megalaunch submit") -> None:
        self.chain("submitted", job_id=str(self.job), by=by)
        self.t += self.rng.uniform(30, 600)

    def segment(self, fate: str = "saved", *, running: bool = False) -> None:
        """One segment of job `self.job` from `job begin` on; its successor is `self.job + 1`."""
        job, succ, rng = self.job, self.job + 1, self.rng
        self.chain("started", job_id=str(job), checkpoint_iteration=self.ckpt, nodes=self.node_list, restart_count=None)
        self.t += 1.5
        self.chain("submitted", job_id=str(succ), by=f"segment {job}", dependency="singleton")
        self.chain("step_started", job_id=str(job), step=0, nodes=self.node_list, node_count=self.nodes,
                   left_out={}, checkpoint_iteration=self.ckpt)
        steps = 2 if fate == "restarted" else 1
        for step in range(steps):
            last = step == steps - 1
            tl = self._train(job, step, ("saved" if fate == "restarted" else fate) if last else "failed",
                             running=running and last)
            if last:
                self.timelines[f"{job}.json"] = tl
            else:
                self.timelines[f"{job}.step{step}.json"] = tl
                self._restart(job, step)
        if running:
            return
        if fate == "killed":  # no `job end`: the next segment's `job begin` accounts for it
            self.job, self.t = succ, self.t + rng.uniform(60, 900)
            return
        self.t += rng.uniform(5, 20)
        self._ended(job, "saved" if fate == "restarted" else fate)
        self.job, self.t = succ, self.t + rng.uniform(60, 900)

    def _train(self, job: int, step: int, fate: str, *, running: bool) -> dict[str, Any]:
        """The trainer's events, timeline and metrics lines of one training step."""
        rng, start_it = self.rng, self.ckpt or 0
        ph: dict[str, float] = {}
        for name, dt in (("process_start", 4), ("runtime_start", 0.3), ("setup_done", 25), ("health_check_start", 0.5),
                         ("health_check_end", 20), ("model_build_start", 30), ("model_build_end", 40),
                         ("load_start", 1), ("load_end", 60 if self.ckpt else 0.1), ("data_start", 0.1),
                         ("data_end", 15)):
            self.t += dt * rng.uniform(0.8, 1.2)
            ph[name] = self.t
        self.trainer("attention", job, requested="auto", chosen="sdpa", why="transformer-engine not installed")
        self.trainer("kernels", job, requested="auto", chosen="liger", why="measured faster", liger_ops=["rope", "swiglu"],
                     fallbacks={"rmsnorm": "Megatron's is faster here"}, wgrad_fusion="on: apex-free fp32 accumulation")
        if self.ckpt is not None:
            self.trainer("resumed", job, iteration=self.ckpt, consumed_samples=self.ckpt * 512)
        health = self._health(job)
        self.trainer("health_check", job, **health)
        step_s = rng.uniform(45.0, 55.0)  # a large model: a segment of 200 iterations is under 3 hours
        iters = self.iters if fate in ("saved", "finished", "exited") else self.iters // 2
        if running:
            iters = self.iters // 3
        saves: list[list[float]] = []
        for k in range(1, iters + 1):
            it = start_it + k
            if k % self.log_interval == 0:
                t = self.t + k * step_s
                self.metrics.append({"job_id": str(job), "iteration": it, "time": t, "loss": 2.0 + 1e3 / (it + 500),
                                     "lr": 2e-4, "grad_norm": rng.uniform(0.2, 0.4),
                                     "tokens_per_s": None if k == self.log_interval else rng.uniform(3.9e5, 4.1e5),
                                     "tflops_per_gpu": rng.uniform(480, 520), "consumed_samples": it * 512})
            if k == iters // 2 and fate not in ("failed", "killed"):
                saves.append([it, self.t + k * step_s, self.t + k * step_s + 12.0])
        self.t += iters * step_s + 12.0 * len(saves)
        self.iteration = start_it + iters
        ph["first_iteration_end"] = ph["data_end"] + step_s
        ph["last_iteration_end"] = self.t
        if saves:
            self.trainer("stragglers", job, at="save", iteration=int(saves[0][0]), **self._stragglers())
            if self.ckpt is not None and self.ckpt > 0:
                self.trainer("checkpoint_deleted", job, iteration=self.ckpt - self.iters)
            self.ckpt = int(saves[0][0])
        if fate in ("saved", "finished", "exited") and not running:
            self.t += rng.uniform(5, 60)
            ph["signal_received"] = self.t
            self.trainer("decision", job, decision="exit" if fate == "exited" else "signal", iteration=self.iteration,
                         triggers=["exit"] if fate == "exited" else [], signal=fate == "saved")
            ph["decision"] = self.t
            saves.append([self.iteration, self.t, self.t + 14.0])
            self.t += 14.0
            self.ckpt = self.iteration
            self.trainer("stragglers", job, at="end", iteration=self.iteration, **self._stragglers())
            self.t += 2.0
            ph["exit"] = self.t
        return {"job_id": str(job), "host": "snode1", "phases": ph, "saves": saves, "writes": [list(s) for s in saves],
                "iterations": {"first": start_it + 1, "last": self.iteration}, "start_iteration": start_it,
                "gpu": GPU, "world": self.world, "health_check": health}

    def _health(self, job: int) -> dict[str, Any]:
        rng = self.rng
        tf = [round(rng.uniform(640, 700), 1) for _ in range(self.world)]
        ranks: list[dict[str, Any]] = [{"rank": r, "node": f"snode{r // GPUS_PER_NODE + 1}", "device": f"{GPU} bf16 8192",
                  "tflops": tf[r], "allreduce_gbps": round(rng.uniform(350, 380), 1),
                  "seconds": round(rng.uniform(14, 18), 2), "error": None} for r in range(self.world)]
        by_speed = sorted(ranks, key=lambda f: float(f["tflops"]))
        kept = ranks if len(ranks) <= 16 else [*by_speed[:4], by_speed[-1]]  # runtime/health/health.py `telling`
        return {"healthy": True, "unhealthy_nodes": [], "median_tflops": statistics.median(tf), "reference_tflops": 680.0,
                "baseline_tflops": 676.0, "allreduce_gbps": 365.0, "seconds": 17.9, "rank_count": len(ranks),
                "nodes": self.node_list, "min_tflops": min(tf), "max_tflops": max(tf), "ranks": kept}

    def _stragglers(self) -> dict[str, Any]:
        return {"ranks": self.world, "steps": self.iters, "median_step_s": 1.1,
                "slowest": {"rank": 37, "node": "snode5", "mean_s": 1.12}, "fastest": {"rank": 3, "node": "snode1", "mean_s": 1.09},
                "spread": 0.018, "straggling": False, "threshold": 0.1}

    def _restart(self, job: int, step: int) -> None:
        """launcher/chain/restart.py after a failed step: suspect, restart, the next step's nodes."""
        self.t += 30.0
        self.chain("node_suspected", job_id=str(job), node="snode7", reason="rank 50 killed (NCCL timeout)",
                   evidence=["task 50: Killed"], expires=self.t + 43200)
        self.chain("restart", job_id=str(job), step=step + 1, after="failed", reason="rank 50 on snode7: NCCL timeout",
                   exit_code=1, first_failure={"rank": 50, "node": "snode7", "reason": "NCCL timeout"},
                   checkpoint_iteration=self.ckpt, new_checkpoint=False, exclude=["snode7"], kept={})
        self.chain("step_started", job_id=str(job), step=step + 1, nodes=f"snode[1-6,8-{self.nodes + 1}]",
                   node_count=self.nodes, left_out={"snode7": "failed in this segment"}, checkpoint_iteration=self.ckpt)
        self.t += 5.0

    def _ended(self, job: int, fate: str) -> None:
        if fate == "failed":
            self.chain("ended", job_id=str(job), outcome="failed", reason="rank 9 on snode2 exited with 1", exit_code=1,
                       checkpoint_iteration=self.ckpt, new_checkpoint=False,
                       first_failure={"rank": 9, "node": "snode2", "reason": "exit code 1"})
            self.chain("node_suspected", job_id=str(job), node="snode2", reason="rank 9 exited with 1",
                       evidence=["task 9: Exited with exit code 1"], expires=self.t + 43200)
            self.chain("guard", job_id=str(job), decision="continue", failures=1, budget=3)
            self.chain("exclusion", job_id=str(job + 1), excluded=["snode2"], kept={})
            return
        reason = {"saved": f"SIGUSR2 at iteration {self.iteration}", "finished": None,
                  "exited": f"exit trigger at iteration {self.iteration}"}[fate]
        self.chain("ended", job_id=str(job), outcome=fate, reason=reason, exit_code=0,
                   checkpoint_iteration=self.ckpt, new_checkpoint=True, first_failure=None)

    def account_for_killed(self, killed: int, by: int) -> None:
        """`job begin` of `by` records the end of `killed`, which never reached its `job end`."""
        self.chain("ended", job_id=str(killed), outcome="killed", slurm_state="NODE_FAIL", exit_code=None,
                   checkpoint_iteration=self.ckpt, new_checkpoint=False, accounted_by=str(by))

    def stop(self, reason: str, *, cancel_successor: bool = True) -> None:
        self.chain("chain_stopped", job_id=str(self.job - 1), reason=reason,
                   cancelled=[str(self.job)] if cancel_successor else [])

    # ------------------------------------------------------------------------------------ the files
    def write(self, *, running: bool, outcome: str, last_at: float) -> None:
        """The files, every time moved so that the newest is `last_at`."""
        off = last_at - self.t
        for e in self.events:
            e["time"] += off
            if "expires" in e:
                e["expires"] += off
        for m in self.metrics:
            m["time"] += off
        for tl in self.timelines.values():
            tl["phases"] = {k: v + off for k, v in tl["phases"].items()}
            for rows in (tl["saves"], tl["writes"]):
                for row in rows:
                    row[1] += off
                    row[2] += off
        p = self.paths
        # as rundir/files.append_jsonl writes them: keys in the writer's order, a ledger line's `event` first
        p.ledger.write_text("".join(json.dumps({"event": e["event"], **e}) + "\n" for e in self.events))
        p.metrics.write_text("".join(json.dumps(m) + "\n" for m in self.metrics))
        tl_dir = p.state / "timeline"
        tl_dir.mkdir(exist_ok=True)
        for name, data in self.timelines.items():
            (tl_dir / name).write_text(json.dumps(data))
        last = self.metrics[-1] if self.metrics else {}
        p.progress.write_text(json.dumps({"iteration": self.iteration, "consumed_samples": self.iteration * 512,
                                          "loss": last.get("loss"), "tokens_per_s": last.get("tokens_per_s"),
                                          "tflops_per_gpu": last.get("tflops_per_gpu"), "time": last_at,
                                          "job_id": str(self.job if running else self.job - 1)}))
        p.outcome.write_text(json.dumps({"status": outcome, "iteration": self.ckpt, "reason": None, "kind": None,
                                         "job_id": str(self.job - 1), "time": last_at}))
        if self.ckpt is not None:
            (p.checkpoints / "latest_checkpointed_iteration.txt").write_text(f"{self.ckpt}\n")
            for it in (self.ckpt - self.iters // 2, self.ckpt):
                shard = p.checkpoints / f"iter_{max(it, 0):07d}" / "mp_rank_00"
                shard.mkdir(parents=True, exist_ok=True)
                (shard / "model_optim_rng.pt").write_bytes(b"\0" * 4096)


def prepare(root: Path, name: str, sets: list[str]) -> Path:
    """One run directory, written by megalaunch's own prepare/write functions (tests/megatron/harness.py)."""
    from megalaunch.config.loader import load_recipe
    from megalaunch.launcher.prepare.prepare import prepare_run
    from megalaunch.launcher.prepare.write import write_run

    loaded = load_recipe("tiny", ["cluster.backend=slurm", *sets], name=name)
    return Path(write_run(prepare_run(loaded, root=root)).root)


def build_big(root: Path, args: argparse.Namespace, now: float) -> Path:
    from megalaunch.rundir.paths import RunPaths

    iters = args.iters_per_segment
    run = prepare(root, "big", [f"training.train_iters={iters * (args.segments + 10)}",
                                f"training.log_interval={args.log_interval}", f"cluster.nodes={BIG_NODES}",
                                f"cluster.gpus_per_node={GPUS_PER_NODE}", "cluster.gpu=H100",
                                "training.global_batch_size=512"])
    paths = RunPaths(run)
    w = RunWriter(paths, 910_000_000, nodes=BIG_NODES, world=BIG_NODES * GPUS_PER_NODE, iters=iters,
                  log_interval=args.log_interval, rng=random.Random(1))
    w.submit_first()
    killed: int | None = None
    for n in range(1, args.segments + 1):
        if killed is not None:
            w.account_for_killed(killed, w.job)
            killed = None
        if n == args.segments:
            w.segment(running=True)
            break
        fate = ("killed" if n % 700 == 0 else "restarted" if n % 500 == 0 else "failed" if n % 900 == 0
                else "exited" if n == args.segments // 2 else "saved")
        if n % 50 == 0:
            w.chain("lead_raised", job_id=str(w.job), **{"from": 51, "to": 70, "slowest_save_s": 31.0,
                                                        "slowest_save_job": str(w.job - 1), "capped": False})
        if n % 75 == 0:
            w.trainer("save_skipped", w.job, iteration=(w.ckpt or 0) + iters - 10, kind="periodic",
                      reason="inside the signal window", to_limit_s=40.0)
        job = w.job
        w.segment(fate)
        if fate == "killed":
            killed = job
        if fate == "exited":  # the chain stops, its queued successor is cancelled; later a person resumes it
            w.stop("exit trigger by alice (\"eval\"): saved and stopped")
            w.t += 3 * 86400
            w.job += 1  # the cancelled successor's id is used up
            w.chain("chain_resumed")
            w.submit_first("megalaunch resume")
    w.write(running=True, outcome="saved", last_at=now - 60)  # its newest record a minute old: it is running
    from megalaunch.launcher.accounting.goodput import write_chain_goodput

    write_chain_goodput(paths)  # what the last `job end` wrote (state/goodput.json, with its segments' cut)
    return run


def build_small(template: Path, root: Path, i: int, now: float, args: argparse.Namespace) -> Path:
    from megalaunch.rundir.paths import RunPaths

    run = root / f"tiny{i:05d}-{i * 2654435761 % 2**32:08x}"
    shutil.copytree(template, run, symlinks=True)
    rng = random.Random(i)
    w = RunWriter(RunPaths(run), 920_000_000 + 20 * i, nodes=1, world=1, iters=args.iters_per_segment,
                  log_interval=args.log_interval, rng=rng)
    w.submit_first()
    kind = rng.choices(("finished", "running", "guard"), (6, 3, 1))[0]
    segments = rng.randint(2, 6)
    for n in range(1, segments + 1):
        last = n == segments
        if kind == "running" and last:
            w.segment(running=True)
        elif kind == "guard" and n > segments - 3:
            w.segment("failed")
        else:
            w.segment("finished" if last else "saved")
    if kind == "finished":
        w.stop(f"training reached its target (iteration {w.iteration})")
    elif kind == "guard":
        w.chain("guard", job_id=str(w.job - 1), decision="stop", failures=3, budget=3)
        w.stop("3 consecutive segments without a new checkpoint (budget 3)")
    w.write(running=kind == "running", outcome={"finished": "finished", "running": "saved", "guard": "failed"}[kind],
            last_at=now - (rng.uniform(10, 600) if kind == "running" else rng.uniform(600, 10 * 86400)))
    return run


def shims(directory: Path, log: Path) -> None:
    """Slurm commands that log their argv, then run the real one if there is one."""
    directory.mkdir()
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != directory)
    for name in SLURM_COMMANDS:
        real = shutil.which(name, path=path)
        run = f'exec {real} "$@"' if real else "exit 0"
        f = directory / name
        f.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> {log}\n{run}\n')
        f.chmod(0o755)


def build(tmp: Path, args: argparse.Namespace) -> tuple[Path, float]:
    from megalaunch.rundir.registry import register

    t0 = time.perf_counter()
    now = time.time()
    root = tmp / "runs"
    template = prepare(tmp / "template", "tiny", [f"training.train_iters={args.iters_per_segment * 10}",
                                                  f"training.log_interval={args.log_interval}"])
    big = build_big(root, args, now)
    register(big)
    for i in range(1, args.runs):
        register(build_small(template, root, i, now, args))
    return big, time.perf_counter() - t0


def time_command(argv: list[str], env: dict[str, str], log: Path, repeat: int) -> tuple[list[float], list[float], list[int], str]:
    """Wall and CPU seconds (user + system, the child's) and Slurm commands of each run."""
    import resource

    walls, cpus, queries, out = [], [], [], ""
    for _ in range(repeat):
        log.write_text("")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        queries.append(len(log.read_text().splitlines()))
        out = proc.stdout
    return walls, cpus, queries, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000, help="runs listed by `status` (the big one included)")
    ap.add_argument("--segments", type=int, default=5000, help="segments of the big run")
    ap.add_argument("--iters-per-segment", type=int, default=200)
    ap.add_argument("--log-interval", type=int, default=50, help="a metrics line every this many iterations")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    ap.add_argument("--baseline", metavar="SRC", help="also time each command with this megalaunch source tree "
                    "(e.g. a `git worktree` of an older commit: its src/), right after this one, on the same data")
    args = ap.parse_args()
    exe = shutil.which("megalaunch") or str(Path(sys.executable).with_name("megalaunch"))
    tmp = Path(tempfile.mkdtemp(prefix="ml-status-scale-"))
    os.environ["XDG_STATE_HOME"] = str(tmp / "state")  # the private registry (also for the commands below)
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")  # the user's parse cache (rundir/appended.py), empty at first
    os.environ.pop("MEGALAUNCH_RUN_ROOTS", None)
    try:
        big, built_s = build(tmp, args)
        log = tmp / "slurm-calls.log"
        shims(tmp / "bin", log)
        env = dict(os.environ, PATH=f"{tmp / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        ledger_mb = (big / "state" / "ledger.jsonl").stat().st_size / 1e6
        metrics = len((big / "state" / "metrics.jsonl").read_text().splitlines())
        print(f"built in {built_s:.1f} s: {args.runs} runs; the big one {args.segments} segments, ledger "
              f"{ledger_mb:.1f} MB, {metrics} metrics lines  ({tmp})")
        commands = {"megalaunch status (all runs)": [exe, "status"],
                    f"megalaunch status RUN ({args.segments} seg.)": [exe, "status", str(big)],
                    "megalaunch status --json RUN": [exe, "status", "--json", str(big)]}
        print(f"{'command':<48} {'median':>7} {'min':>7} {'max':>7} {'first':>7} {'cpu':>6}  {'slurm calls':>11}   "
              f"(wall s, n={args.repeat}; first: the first run, whose parse cache was empty; cpu: median "
              f"user+sys s; target <= {TARGET_S} s and 1 call)")
        ok = True
        variants = [("", env)]
        if args.baseline:
            variants.append((" [baseline]", dict(env, PYTHONPATH=str(Path(args.baseline).absolute()))))
        for (label, argv), (suffix, run_env) in ((c, v) for c in commands.items() for v in variants):
            label += suffix
            times, cpus, queries, out = time_command(argv, run_env, log, args.repeat)
            if argv[1:] == ["status"] and len(out.splitlines()) < args.runs:
                print(f"{label}: listed {len(out.splitlines())} lines for {args.runs} runs")
                ok = False
            med = statistics.median(times)
            calls = ",".join(str(q) for q in sorted(set(queries)))
            good = med <= TARGET_S and set(queries) == {1}
            ok = ok and (good or bool(suffix))
            print(f"{label:<48} {med:7.3f} {min(times):7.3f} {max(times):7.3f} {times[0]:7.3f} {statistics.median(cpus):6.2f}  "
                  f"{calls:>11}   {'' if good else 'OVER'}")
        print("OK" if ok else "OVER TARGET")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
