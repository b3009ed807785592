"""What `megalaunch status` shows: read from the run directory, plus one batched Slurm query."""

from __future__ import annotations

import time
from typing import Any

from megalaunch.errors import SlurmError
from megalaunch.launcher.chain import load_run_recipe
from megalaunch.launcher.ledger import Ledger
from megalaunch.launcher.local import pid_alive
from megalaunch.launcher.slurm import JobInfo, SlurmClient
from megalaunch.runtime import triggers
from megalaunch.runtime.paths import RunPaths
from megalaunch.runtime.state import read_outcome, read_progress


def _live(ids: list[str], backend: str) -> tuple[dict[str, JobInfo], str | None]:
    if backend != "slurm" or not ids:
        return {}, None
    try:
        return SlurmClient(timeout_s=15).squeue(ids), None
    except SlurmError as e:
        return {}, str(e)


def run_status(paths: RunPaths) -> dict[str, Any]:
    recipe = load_run_recipe(paths)
    ledger = Ledger(paths)
    events = ledger.events()
    segments = ledger.segments(events)
    ids = [s.job_id for s in segments if s.ended is None]
    live, slurm_error = _live(ids, recipe.cluster.backend)
    rows = []
    for i, s in enumerate(segments, 1):
        info = live.get(s.job_id)
        reason: str | None
        if info is not None:
            state, reason = info.state, info.reason
        elif s.ended is not None:
            state, reason = s.ended.get("outcome", "?").upper(), s.ended.get("reason") or s.ended.get("slurm_state")
        elif s.skipped:
            state, reason = "SKIPPED", "chain stopped"
        elif recipe.cluster.backend == "local":
            alive = s.pid is not None and pid_alive(s.pid)
            state, reason = ("RUNNING" if alive and s.started else "PENDING" if alive else "GONE"), None
        else:
            state, reason = "GONE", None
        rows.append({"segment": i, "job_id": s.job_id, "state": state, "reason": reason,
                     "start_iteration": (s.started or {}).get("checkpoint_iteration"),
                     "end_iteration": (s.ended or {}).get("checkpoint_iteration")})
    progress = read_progress(paths) or {}
    stopped = ledger.stopped()
    guard = ledger.last("guard")
    active = [r for r in rows if r["state"] in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING")]
    if active:
        chain_state = "running" if any(r["state"] == "RUNNING" for r in active) else "queued"
    elif stopped:
        chain_state = "stopped"
    else:
        chain_state = "idle"
    return {
        "run_dir": str(paths.root), "name": recipe.name, "chain_name": paths.root.name,
        "backend": recipe.cluster.backend, "chain_state": chain_state,
        "stop_reason": stopped.get("reason") if stopped else None,
        "iteration": progress.get("iteration"), "target": recipe.training.train_iters,
        "last_checkpoint": paths.read_tracker(), "tokens_per_s": progress.get("tokens_per_s"),
        "loss": progress.get("loss"), "progress_age_s": (time.time() - progress["time"]) if progress.get("time") else None,
        "pending_triggers": triggers.pending_triggers(paths),
        "consumed_triggers": len(triggers.consumed_records(paths)),
        "last_guard": guard, "last_outcome": read_outcome(paths), "segments": rows, "slurm_error": slurm_error,
    }


def format_run_status(st: dict[str, Any]) -> str:
    lines = [f"run {st['chain_name']}  ({st['backend']})  {st['run_dir']}",
             f"  chain: {st['chain_state']}" + (f" - {st['stop_reason']}" if st["stop_reason"] else "")]
    it = st["iteration"]
    lines.append(f"  iteration: {it if it is not None else '-'} / {st['target']}   last checkpoint: "
                 f"{st['last_checkpoint'] if st['last_checkpoint'] is not None else '-'}"
                 + (f"   tokens/s: {st['tokens_per_s']:.0f}" if st["tokens_per_s"] else "")
                 + (f"   loss: {st['loss']:.4g}" if isinstance(st["loss"], (int, float)) else ""))
    lines.append(f"  triggers pending: {', '.join(st['pending_triggers']) or 'none'}   consumed: {st['consumed_triggers']}")
    g = st["last_guard"]
    if g:
        lines.append(f"  last guard decision: {g['decision']} ({g['failures']}/{g['budget']} segments without "
                     "a new checkpoint)")
    if st["slurm_error"]:
        lines.append(f"  slurm: {st['slurm_error']}")
    lines.append("  segments:")
    for r in st["segments"]:
        span = ""
        if r["start_iteration"] is not None or r["end_iteration"] is not None:
            span = f"  iter {r['start_iteration'] if r['start_iteration'] is not None else 0} -> {r['end_iteration'] if r['end_iteration'] is not None else '...'}"
        lines.append(f"    {r['segment']:>3}  {r['job_id']:<12} {r['state']:<10}{span}"
                     + (f"  ({r['reason']})" if r["reason"] else ""))
    return "\n".join(lines)


def all_runs_status(runs: list[RunPaths]) -> list[dict[str, Any]]:
    """One line per run, from one `squeue` of the user's jobs."""
    if not runs:
        return []
    try:
        queue = SlurmClient(timeout_s=15).squeue(me=True)
        slurm_error = None
    except SlurmError as e:
        queue, slurm_error = {}, str(e)
    by_name: dict[str, list[JobInfo]] = {}
    for info in queue.values():
        by_name.setdefault(info.name, []).append(info)
    out = []
    for paths in runs:
        try:
            recipe = load_run_recipe(paths)
        except Exception:
            continue
        jobs = by_name.get(paths.root.name, [])
        progress = read_progress(paths) or {}
        stopped = Ledger(paths).stopped()
        state = ("running" if any(j.state == "RUNNING" for j in jobs) else "queued" if jobs
                 else "stopped" if stopped else "idle")
        out.append({"chain_name": paths.root.name, "run_dir": str(paths.root), "state": state,
                    "jobs": [j.job_id for j in jobs], "iteration": progress.get("iteration"),
                    "target": recipe.training.train_iters, "stop_reason": stopped.get("reason") if stopped else None,
                    "slurm_error": slurm_error})
    return out
