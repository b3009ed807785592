"""A stand-in trainer for chain tests. It uses the real runtime module (signal flag, trigger decision,
progress, outcome, atomic writes); its "checkpoint" is a step counter saved atomically under
checkpoints/iter_NNNNNNN/ with Megatron's tracker file, so the chain logic sees what it sees with
Megatron. Each step sleeps COUNTER_STEP_S seconds to stand in for compute.

Env: MEGALAUNCH_RUN_DIR (set by the launcher); COUNTER_STEP_S (default 0.1);
COUNTER_FAIL=start makes it crash before training (crash-loop tests)."""

from __future__ import annotations

import json
import os
import sys
import time

from megalaunch.rundir.files import atomic_write_json, atomic_write_text
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import current_job_id, write_outcome, write_progress
from megalaunch.rundir.triggers import Decision, TriggerBox, decide
from megalaunch.runtime.dist_env import rank_env
from megalaunch.runtime.settings import RuntimeSettings
from megalaunch.runtime.signals import SignalFlag, resolve_signal


def log(msg: str) -> None:
    print(f"[counter rank {rank_env().rank}] {msg}", flush=True)


def save(paths: RunPaths, iteration: int, total: int) -> None:
    d = paths.checkpoints / f"iter_{iteration:07d}"
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "state.json", {"iteration": iteration, "total": total})
    atomic_write_text(paths.tracker, f"{iteration}\n")
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
    if os.environ.get("COUNTER_FAIL") == "start":
        write_outcome(paths, "failed", reason="COUNTER_FAIL=start: crashing before training")
        log("failing at start on purpose")
        return 1
    step_s = float(os.environ.get("COUNTER_STEP_S", "0.1"))
    it, total = load(paths)
    log(f"job {job} resumes at iteration {it}")
    while True:
        if it >= settings.train_iters:
            if paths.read_tracker() != it:
                save(paths, it, total)
            write_outcome(paths, "finished", iteration=it)
            log(f"finished at iteration {it}")
            return 0
        look = it % settings.trigger_interval == 0
        decision = decide(TriggerBox(paths) if look else None, flag.received)
        if decision == Decision.ABORT:
            TriggerBox(paths).consume_for(decision, it, job)
            write_outcome(paths, "aborted", iteration=it, reason="abort trigger")
            log(f"aborted at iteration {it}")
            return 0
        if decision in (Decision.SAVE, Decision.SIGNAL, Decision.EXIT):
            save(paths, it, total)
            TriggerBox(paths).consume_for(decision, it, job)
            if decision == Decision.SIGNAL:
                write_outcome(paths, "saved", iteration=it, reason="signal")
                log(f"stop signal: saved and exiting at iteration {it}")
                return 0
            if decision == Decision.EXIT:
                write_outcome(paths, "exited", iteration=it, reason="exit trigger")
                log(f"exit trigger: saved and exiting at iteration {it}")
                return 0
            log(f"save trigger: saved at iteration {it}, continuing")
        time.sleep(step_s)
        it += 1
        total += it
        if it % settings.save_interval == 0:
            save(paths, it, total)
        if it % settings.log_interval == 0:
            write_progress(paths, iteration=it, consumed_samples=it, loss=1.0 / it, tokens_per_s=1.0 / step_s)


if __name__ == "__main__":
    sys.exit(main())
