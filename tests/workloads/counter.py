"""A stand-in trainer for chain tests. It uses the real runtime module (signal flag, trigger decision,
progress, outcome, atomic writes); its "checkpoint" is a step counter saved atomically under
checkpoints/iter_NNNNNNN/ with Megatron's tracker file, so the chain logic sees what it sees with
Megatron. Each step sleeps COUNTER_STEP_S seconds to stand in for compute.

It keeps the segment's timeline (runtime.observation.timeline.Timeline: the phases, every iteration, every save)
and appends state/metrics.jsonl every log interval as the real trainer does, so goodput and the
report can be tested without Megatron.

Env: MEGALAUNCH_RUN_DIR (set by the launcher); COUNTER_STEP_S (default 0.1); COUNTER_SAVE_S (a save's
blocking time, default 0); MEGALAUNCH_TEST_SAVE_DELAY_S=S[:KIND,...] (the real runtime's test hook:
that much longer for saves of those kinds, periodic or stop); COUNTER_FAIL=start makes it crash before training (crash-loop tests);
COUNTER_CRASH_ONCE=N crashes once (the first segment to reach iteration N, no outcome written);
COUNTER_FAIL_ON_NODE=NODE: every rank on that node dies at start (SIGBUS, no outcome: a bad node);
COUNTER_HANG_AT_START=1: the first segment to see it stops making progress before its first iteration
(the hang watcher's test; stacks on SIGURG through the real runtime.health.watchdog registration)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from megalaunch.rundir.files import append_jsonl, atomic_write_json, atomic_write_text
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import current_job_id, write_outcome, write_progress
from megalaunch.rundir.triggers import Decision, TriggerBox, decide
from megalaunch.runtime.observation.timeline import Timeline
from megalaunch.runtime.rank.dist_env import rank_env
from megalaunch.runtime.rank.fault_hooks import SAVE_DELAY_ENV, parse_save_delay
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.stop.signals import SignalFlag, resolve_signal


def log(msg: str) -> None:
    print(f"[counter rank {rank_env().rank}] {msg}", flush=True)


def save(paths: RunPaths, iteration: int, total: int, timeline: Timeline | None = None, kind: str = "stop") -> None:
    begin = time.time()
    log(f"saving checkpoint at iteration {iteration} ({kind})")
    delay, kinds = parse_save_delay(os.environ.get(SAVE_DELAY_ENV))
    time.sleep(float(os.environ.get("COUNTER_SAVE_S", "0")) + (delay if kinds is None or kind in kinds else 0.0))
    d = paths.checkpoints / f"iter_{iteration:07d}"
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "state.json", {"iteration": iteration, "total": total})
    atomic_write_text(paths.tracker, f"{iteration}\n")
    if timeline is not None:
        timeline.save(iteration, begin, time.time())
    log(f"saved checkpoint at iteration {iteration}")


def load(paths: RunPaths) -> tuple[int, int]:
    it = paths.read_tracker()
    if not it:
        return 0, 0
    state = json.loads((paths.checkpoints / f"iter_{it:07d}" / "state.json").read_text())
    assert state["iteration"] == it, "checkpoint does not match the tracker"
    return it, state["total"]


def main() -> int:
    settings_paths = RunPaths.from_env()
    settings = RuntimeSettings.load(settings_paths)
    flag = SignalFlag(resolve_signal(settings.stop_signal))
    paths = settings_paths
    job = current_job_id()
    env = rank_env()
    tl = Timeline(paths, job, write=env.rank == 0)
    tl.mark("runtime_start", world=env.world_size)
    bad = os.environ.get("COUNTER_FAIL_ON_NODE")
    if bad and os.environ.get("SLURMD_NODENAME") == bad:
        log(f"this node ({bad}) is bad on purpose (COUNTER_FAIL_ON_NODE): dying at start")
        os.kill(os.getpid(), signal.SIGBUS)
    if os.environ.get("COUNTER_FAIL") in ("config_error", "storage_full"):  # what no restart fixes
        status = os.environ["COUNTER_FAIL"]
        write_outcome(paths, status, reason=f"COUNTER_FAIL={status}: failing at start on purpose")
        log(f"failing at start on purpose: {status}")
        return 1
    if os.environ.get("COUNTER_FAIL") == "start":
        write_outcome(paths, "failed", reason="COUNTER_FAIL=start: crashing before training")
        log("failing at start on purpose")
        return 1
    if os.environ.get("COUNTER_HANG_AT_START") and not (paths.state / "counter-hung").exists():
        from megalaunch.runtime.health.watchdog import Watchdog

        (paths.state / "counter-hung").touch()
        Watchdog(paths.debug, rank=env.rank, job_id=job, timeout_s=0, on_hang=lambda r: None).start(
            stacks_file=paths.step_stacks(job or "nojob", env.rank))
        tl.mark("setup_done")
        log("hanging before the first iteration on purpose (COUNTER_HANG_AT_START)")
        while True:
            time.sleep(3600)
    step_s = float(os.environ.get("COUNTER_STEP_S", "0.1"))
    crash_at = int(os.environ.get("COUNTER_CRASH_ONCE") or 0)
    crashed_marker = paths.state / "counter-crashed"
    for phase in ("setup_done", "model_build_start", "model_build_end", "load_start"):
        tl.mark(phase)
    it, total = load(paths)
    tl.mark("load_end", start_iteration=it)
    tl.mark("data_start")
    tl.mark("data_end")
    log(f"job {job} resumes at iteration {it}")

    def finish(status: str, reason: str | None = None) -> int:
        write_outcome(paths, status, iteration=it, reason=reason)
        tl.mark("exit", outcome=status)
        return 0

    while True:
        if it >= settings.train_iters:
            if paths.read_tracker() != it:
                save(paths, it, total, tl)
            log(f"finished at iteration {it}")
            return finish("finished")
        look = it % settings.trigger_interval == 0
        decision = decide(TriggerBox(paths) if look else None, flag.received)
        if decision != Decision.CONTINUE:
            tl.mark("decision", decision=decision.name.lower(), decision_iteration=it)
        if decision == Decision.ABORT:
            TriggerBox(paths).consume_for(decision, it, job)
            log(f"aborted at iteration {it}")
            return finish("aborted", "abort trigger")
        if decision in (Decision.SAVE, Decision.SIGNAL, Decision.EXIT):
            if paths.read_tracker() != it:  # a stop during the save at `it`: no iteration since, no second save
                save(paths, it, total, tl)
            TriggerBox(paths).consume_for(decision, it, job)
            if decision == Decision.SIGNAL:
                log(f"stop signal: saved and exiting at iteration {it}")
                return finish("saved", "signal")
            if decision == Decision.EXIT:
                log(f"exit trigger: saved and exiting at iteration {it}")
                return finish("exited", "exit trigger")
            log(f"save trigger: saved at iteration {it}, continuing")
        time.sleep(step_s)
        it += 1
        total += it
        tl.iteration(it, flush=it % settings.log_interval == 0)
        if crash_at and it >= crash_at and not crashed_marker.exists():
            crashed_marker.touch()
            log(f"crashing at iteration {it} on purpose (COUNTER_CRASH_ONCE)")
            os._exit(1)
        if it % settings.save_interval == 0:
            save(paths, it, total, tl, kind="periodic")
        if it % settings.log_interval == 0:
            write_progress(paths, iteration=it, consumed_samples=it, loss=1.0 / it, tokens_per_s=1.0 / step_s)
            append_jsonl(paths.metrics, {"job_id": job, "iteration": it, "time": time.time(), "loss": 1.0 / it,
                                         "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0 / step_s,
                                         "tflops_per_gpu": None, "consumed_samples": it})


if __name__ == "__main__":
    sys.exit(main())
