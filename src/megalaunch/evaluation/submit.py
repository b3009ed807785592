"""Where an eval stage runs: a Slurm job (RUN/evals/<iteration>/eval.sbatch, through the launcher's
one Slurm client, a ledger event), or this machine (local backend: in this process, or the queue
worker the local chain starts after a segment). And what `eval status` shows, with Slurm's word on
jobs that ended without saying so themselves (time limit, node failure, cancelled).

Why not submitit: the stage is a megalaunch command, not an arbitrary Python function, so pickling a
callable buys nothing; submitit would be a second Slurm client (its own sbatch/sacct calls and
requeue handling), write its own script outside our quoted, golden-tested templates, and tie the job
to the exact interpreter that pickled it. The conversion stage's pattern (template + SlurmClient)
already gives a script file in the run directory and one place that talks to Slurm."""

from __future__ import annotations

import fcntl
import time
from typing import Any

from megalaunch.config.schema import Recipe
from megalaunch.rundir.evals import ACTIVE, EvalPaths, eval_records, queued
from megalaunch.rundir.files import append_jsonl, atomic_write_text
from megalaunch.rundir.paths import RunPaths


def task_args(tasks: list[str] | None) -> list[str]:
    return ["--tasks", ",".join(tasks)] if tasks else []


def render_script(recipe: Recipe, paths: RunPaths, iteration: int, tasks: list[str] | None = None) -> str:
    from megalaunch import __version__
    from megalaunch.launcher.prepare.render import render
    from megalaunch.launcher.prepare.sbatch import JobHeader, environment_context, sbatch_options

    cl, ev = recipe.cluster, recipe.eval
    ep = EvalPaths(paths, iteration)
    gpus = ev.gpus if ev.gpus is not None else (1 if cl.gpus_per_node > 0 else 0)
    job = JobHeader(name=f"eval-{paths.root.name}", log=str(ep.logs / "%x-%j.out"), log_from="run.root",
                    time=ev.time, cpus_per_task=ev.cpus_per_task or cl.cpus_per_task, gpus_per_node=gpus, mem=cl.mem,
                    options=sbatch_options(ev.partition or cl.partition, cl.account, cl.qos, cl.reservation,
                                           cl.constraint, cl.sbatch_extra))
    return render("eval.sbatch.j2", version=__version__, created=time.strftime("%Y-%m-%d %H:%M:%S"),
                  iteration=iteration, run_dir=str(paths.root), eval_dir=str(ep.root), job=job,
                  task_args=task_args(tasks), **environment_context(cl, [str(paths.root)]))


def submit_slurm(recipe: Recipe, paths: RunPaths, iteration: int, tasks: list[str] | None = None,
                 slurm: Any = None) -> str:
    from megalaunch.launcher.backends.slurm import SlurmClient

    ep = EvalPaths(paths, iteration)
    ep.logs.mkdir(parents=True, exist_ok=True)
    atomic_write_text(ep.job_script, render_script(recipe, paths, iteration, tasks))
    client = slurm or SlurmClient()
    job_id: str = client.sbatch(ep.job_script, cwd=ep.root)
    ep.write_state("submitted", job_id=job_id, reason=None)
    append_jsonl(paths.ledger, {"event": "eval_submitted", "time": time.time(), "eval_job": job_id,
                                "iteration": iteration, "script": str(ep.job_script)})
    return job_id


def live_records(paths: RunPaths, recipe: Recipe | None = None, slurm: Any = None) -> list[dict[str, Any]]:
    """eval_records, where a submitted or running Slurm job that Slurm no longer runs (and that wrote
    no verdict) becomes failed with Slurm's state; a local worker that died, likewise."""
    records = eval_records(paths)
    slurm_ids = [str(r["job_id"]) for r in records if r["state"] in ("submitted", "running") and r.get("job_id")
                 and str(r["job_id"]).split("_")[0].isdigit()]
    live: dict[str, Any] = {}
    if slurm_ids:
        from megalaunch.errors import SlurmError
        from megalaunch.launcher.backends.slurm import SlurmClient

        try:
            client = slurm or SlurmClient()
            live = {j: client.job_state(j) for j in slurm_ids}
        except SlurmError:
            return records  # Slurm not answering: unknown, not failed
    for r in records:
        jid = str(r.get("job_id") or "")
        if r["state"] not in ("submitted", "running"):
            continue
        if jid in live:
            info = live[jid]
            if info is None or not info.active:
                again = EvalPaths(paths, r["iteration"]).read_state() or {}
                if again.get("state") in ("submitted", "running"):
                    r["state"] = "failed"
                    r["reason"] = f"job {jid} ended ({info.state if info else 'gone from Slurm'}) without results; " \
                                  f"see {EvalPaths(paths, r['iteration']).logs}"
        elif jid.startswith("local-"):
            from megalaunch.launcher.backends.local import pid_alive

            pid = int(jid.split("-", 1)[1])
            if not pid_alive(pid) and (EvalPaths(paths, r["iteration"]).read_state() or {}).get("state") == "running":
                r["state"], r["reason"] = "failed", f"process {pid} ended without results"
    return records


def _worker_lock(paths: RunPaths) -> Any:
    paths.evals.mkdir(parents=True, exist_ok=True)
    return open(paths.evals / ".worker.lock", "a")


def run_here(paths: RunPaths, iteration: int, tasks: list[str] | None, log: Any = print) -> dict[str, Any]:
    """`megalaunch eval RUN` on a local run: in this process, after the background worker (one eval
    of a run at a time on this machine)."""
    from megalaunch.evaluation.stage import run_stage

    with _worker_lock(paths) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return run_stage(paths, iteration, tasks=tasks, log=log)


def run_queued_locally(paths: RunPaths, log: Any = print) -> list[int]:
    """The local backend's queue worker: one at a time per run (a lock), every queued eval, oldest
    first, until none is left. A failed eval is recorded and the next one runs."""
    from megalaunch.evaluation.stage import run_stage

    done: list[int] = []
    with _worker_lock(paths) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        while todo := queued(paths):
            try:
                run_stage(paths, todo[0], log=log)
            except Exception as e:
                log(f"eval {todo[0]} failed: {e}")
            done.append(todo[0])
    return done


def active(paths: RunPaths, iteration: int, recipe: Recipe | None = None) -> dict[str, Any] | None:
    """The record of this iteration's eval if it is under way (queued, submitted, running and alive)."""
    for r in live_records(paths, recipe):
        if r["iteration"] == iteration and r["state"] in ACTIVE:
            return r
    return None
