"""What `megalaunch status` shows: read from the run directory, plus one batched query of the backend."""

from __future__ import annotations

import time
from typing import Any

from megalaunch.config.loader import load_run_recipe
from megalaunch.launcher.accounting.storage import checkpoint_usage, format_usage
from megalaunch.launcher.backends.registry import backend_for
from megalaunch.launcher.chain.backend import Live, unfinished
from megalaunch.launcher.prepare.signal_lead import stop_lines
from megalaunch.rundir.ledger import Ledger, Segment, segment_numbers
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.resume_request import read_resume_request
from megalaunch.rundir.state import read_outcome, read_progress, shown_iteration
from megalaunch.rundir.triggers import TriggerBox

LIVE_STATES = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING")


def _row_state(s: Segment, live: Live | None, cancelled: dict[str, str], error: str | None) -> tuple[str, str | None]:
    if live is not None:
        return live.state, live.reason
    if s.ended is not None:
        return s.ended.get("outcome", "?").upper(), s.ended.get("reason") or s.ended.get("slurm_state")
    if s.skipped:
        return "SKIPPED", "started after the chain had stopped"
    if s.job_id in cancelled:
        return "CANCELLED", cancelled[s.job_id]
    if error is not None:
        return "UNKNOWN", f"the backend did not answer: {error}"
    if s.started is not None:
        return "GONE", "ended without `job end` (killed?); the next segment accounts for it"
    return "GONE", "no longer queued"


def _cancelled(events: list[dict[str, Any]]) -> dict[str, str]:
    """Job id -> who cancelled it: the chain when it stopped, or a user's `megalaunch cancel`."""
    out: dict[str, str] = {}
    for e in events:
        if e["event"] == "chain_stopped":
            for jid in e.get("cancelled") or []:
                out.setdefault(str(jid), f"by the chain: {e.get('reason')}")
        elif e["event"] == "cancelled":
            for jid in e.get("job_ids") or []:
                out.setdefault(str(jid), f"by {e.get('user', '?')} (megalaunch cancel)")
    return out


def run_status(paths: RunPaths) -> dict[str, Any]:
    recipe = load_run_recipe(paths)
    ledger = Ledger(paths)
    events = ledger.events()
    segments = ledger.segments(events)
    live, slurm_error = backend_for(recipe.cluster.backend).live(segments)
    cancelled = _cancelled(events)
    rows = []
    numbers = segment_numbers(segments)  # the numbers `logs --segment` and `report` use
    for s in segments:
        state, reason = _row_state(s, live.get(s.job_id), cancelled, slurm_error)
        rows.append({"segment": numbers[s.job_id], "job_id": s.job_id, "state": state, "reason": reason,
                     "start_iteration": s.start_iteration,
                     "end_iteration": (s.ended or {}).get("checkpoint_iteration")})
    progress = read_progress(paths) or {}
    checkpoint = paths.read_tracker()
    stopped = ledger.stopped()
    guard = ledger.last("guard")
    active = [r for r in rows if r["state"] in LIVE_STATES]
    if active:
        chain_state = "running" if any(r["state"] == "RUNNING" for r in active) else "queued"
    elif any(r["state"] == "UNKNOWN" for r in rows):
        chain_state = "unknown"
    elif stopped:
        chain_state = "stopped"
    else:
        chain_state = "idle"
    from megalaunch.rundir.files import read_jsonl

    metrics = read_jsonl(paths.metrics)  # once, for the goodput, the pace and tokens/s
    efficiency = _efficiency(paths, recipe, shown_iteration(progress, checkpoint), metrics)
    rate = tokens_per_s(metrics, running=chain_state == "running")
    return {
        **efficiency,
        "run_dir": str(paths.root), "name": recipe.name, "chain_name": paths.root.name,
        "backend": recipe.cluster.backend, "chain_state": chain_state,
        "stop_reason": stopped.get("reason") if stopped else None,
        "stop_fix": stopped.get("fix") if stopped else None,
        "iteration": shown_iteration(progress, checkpoint), "target": recipe.training.train_iters,
        "last_checkpoint": checkpoint,
        "tokens_per_s": rate if rate is not None else progress.get("tokens_per_s"),
        "tokens_per_s_over": "recent" if chain_state == "running" else "run",
        "loss": progress.get("loss"), "progress_age_s": (time.time() - progress["time"]) if progress.get("time") else None,
        "pending_triggers": TriggerBox(paths).pending(),
        "consumed_triggers": len(TriggerBox(paths).consumed()),
        "refused_triggers": [{k: e.get(k) for k in ("name", "kind", "planted_by", "why", "time")}
                             for e in events if e.get("event") == "trigger_refused"],
        "last_guard": guard, "last_outcome": read_outcome(paths), "segments": rows, "slurm_error": slurm_error,
        "nodes": _node_decisions(events), "restarts": restart_lines(events),
        "health": _health_lines(events),
        "stragglers": _straggler_lines(events),
        "stop_signal": stop_lines(events),
        "resume": resume_summary(paths, events),
        "storage": checkpoint_usage(paths, recipe, events),
        "next": _next_command(paths, chain_state, recipe.training.train_iters),
    }


def _node_decisions(events: list[dict[str, Any]]) -> list[str]:
    """The run's bad-node decisions (launcher/accounting/nodes.py), oldest first: suspects with their evidence,
    and what each successor excluded or kept and why."""
    out = []
    for e in events:
        if e.get("event") == "node_suspected":
            evidence = "; ".join(e.get("evidence") or [])
            out.append(f"suspect {e.get('node')} after job {e.get('job_id')}: {e.get('reason')}"
                       + (f" [{evidence}]" if evidence else "")
                       + (f", until {time.strftime('%Y-%m-%d %H:%M', time.localtime(e['expires']))}"
                          if e.get("expires") else ""))
        elif e.get("event") == "exclusion":
            parts = ([f"excludes {', '.join(e['excluded'])}"] if e.get("excluded") else []) + [
                f"keeps {n} ({why})" for n, why in sorted((e.get("kept") or {}).items())]
            out.append(f"job {e.get('job_id')} " + "; ".join(parts))
    return out


def restart_lines(events: list[dict[str, Any]]) -> list[str]:
    """In-job restarts (launcher/chain/restart.py) and the ones refused, oldest first."""
    out = []
    for e in events:
        if e.get("event") == "restart":
            off = f"; kept off {', '.join(e['exclude'])}" if e.get("exclude") else ""
            out.append(f"job {e.get('job_id')} started step {e.get('step')} after {e.get('after')} "
                       f"({e.get('reason')}), from checkpoint {e.get('checkpoint_iteration')}{off}")
        elif e.get("event") == "restart_refused":
            out.append(f"job {e.get('job_id')} did not restart step {e.get('step')} ({e.get('after')}): "
                       f"{e.get('reason')}")
    return out


def _health_lines(events: list[dict[str, Any]]) -> list[str]:
    """The latest segment's health check (runtime/health/health.py): its figures and cost."""
    checks = [e for e in events if e.get("event") == "health_check"]
    if not checks:
        return []
    e = checks[-1]
    figs = [f"{r.get('node')} r{r.get('rank')} " + (f"{r['tflops']:.3g}" if isinstance(r.get("tflops"), (int, float))
                                                       else "failed") for r in e.get("ranks") or []]
    ar = e.get("allreduce_gbps")
    return [f"job {e.get('job_id')}: " + ("healthy" if e.get("healthy") else
                                          f"UNHEALTHY {', '.join(e.get('unhealthy_nodes') or [])}")
            + f", matmul TFLOP/s {', '.join(figs[:8])}" + (" ..." if len(figs) > 8 else "")
            + (f" (reference {e['reference_tflops']:.3g})" if isinstance(e.get("reference_tflops"), (int, float)) else "")
            + (f", all-reduce {ar:.3g} GB/s" if isinstance(ar, (int, float)) else "")
            + (f", {e['seconds']:.1f} s" if isinstance(e.get("seconds"), (int, float)) else "")]


def _straggler_lines(events: list[dict[str, Any]]) -> list[str]:
    """Each segment's latest step-time spread (runtime/health/stragglers.py), when above the threshold."""
    from megalaunch.runtime.health.stragglers import describe

    latest: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("event") == "stragglers":
            latest[str(e.get("job_id"))] = e
    out = []
    for job, e in latest.items():
        try:
            if e.get("straggling"):
                out.append(f"job {job}: {describe(e)}")
        except (KeyError, TypeError, ValueError):  # a record of another version: skip it
            continue
    return out


def _next_command(paths: RunPaths, chain_state: str, target: int) -> str | None:
    """What to run once training is done: convert its last checkpoint for Hugging Face."""
    import shlex

    tracker = paths.read_tracker()
    if chain_state != "stopped" or not isinstance(tracker, int) or tracker < target:
        return None
    return (f"megalaunch convert mcore-to-hf {shlex.quote(str(paths.root))} "
            f"--out {shlex.quote(str(paths.root / 'hf'))}")


def format_run_status(st: dict[str, Any]) -> str:
    lines = [f"run {st['chain_name']}  ({st['backend']})  {st['run_dir']}",
             f"  chain: {st['chain_state']}" + (f" - {st['stop_reason']}" if st["stop_reason"] else "")]
    if st.get("stop_fix"):
        lines.append(f"  fix: {st['stop_fix']}")
    it = st["iteration"]
    lines.append(f"  iteration: {it if it is not None else '-'} / {st['target']}   last checkpoint: "
                 f"{st['last_checkpoint'] if st['last_checkpoint'] is not None else '-'}"
                 + (f"   tokens/s: {st['tokens_per_s']:.0f}" + (" (run average)" if st.get("tokens_per_s_over") == "run"
                                                             else "") if st["tokens_per_s"] else "")
                 + (f"   loss: {st['loss']:.4g}" if isinstance(st["loss"], (int, float)) else ""))
    if st.get("goodput") is not None:
        mfu = f"   MFU: {st['mfu']:.1%}" if st.get("mfu") is not None else ""
        eta = f"   ETA: {_duration(st['eta_s'])} of training" if st.get("eta_s") else ""
        lines.append(f"  goodput so far: {st['goodput']:.1%} of {st['wall_h']:.2f} h allocated "
                     f"({st['startup_share']:.0%} start-up, {st['save_share']:.0%} saving, "
                     f"{st['lost_share']:.0%} lost work){mfu}{eta}   details: megalaunch report RUN")
    lines.append(f"  triggers pending: {', '.join(st['pending_triggers']) or 'none'}   consumed: {st['consumed_triggers']}")
    for r in st.get("refused_triggers") or []:
        lines.append(f"  refused trigger '{r['name']}' planted by {r['planted_by']}: {r['why']} (ignored)")
    g = st["last_guard"]
    if g:
        lines.append(f"  last guard decision: {g['decision']} ({g['failures']}/{g['budget']} segments without "
                     "a new checkpoint)")
    if st["slurm_error"]:
        lines.append(f"  slurm: {st['slurm_error']}")
    for line in st.get("nodes") or []:
        lines.append(f"  nodes: {line}")
    for line in st.get("restarts") or []:
        lines.append(f"  in-job restart: {line}")
    for line in st.get("health") or []:
        lines.append(f"  health check: {line}")
    for line in st.get("stragglers") or []:
        lines.append(f"  stragglers: {line}")
    for line in st.get("stop_signal") or []:
        lines.append(f"  stop signal: {line}")
    lines += format_usage(st.get("storage"))
    lines += format_resume(st.get("resume"))
    lines.append("  segments:")
    for r in st["segments"]:
        span = ""
        if r["start_iteration"] is not None or r["end_iteration"] is not None:
            span = f"  iter {r['start_iteration'] if r['start_iteration'] is not None else 0} -> {r['end_iteration'] if r['end_iteration'] is not None else '...'}"
        lines.append(f"    {r['segment']:>3}  {r['job_id']:<12} {r['state']:<10}{span}"
                     + (f"  ({r['reason']})" if r["reason"] else ""))
    if st.get("next"):
        lines.append(f"  next: {st['next']}")
    return "\n".join(lines)


def resume_summary(paths: RunPaths, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest `resume --from` (or `--resume-from`) the job acted on: its `resume_from` ledger record
    (iteration, the checkpoints moved aside) or `resume_refused` record; and a request still pending."""
    last = next((e for e in reversed(events) if e["event"] in ("resume_from", "resume_refused")), None)
    try:
        pending = read_resume_request(paths)
    except ValueError as e:
        pending = {"iteration": None, "error": str(e)}
    return None if last is None and pending is None else {"last": last, "pending": pending}


def format_resume(summary: dict[str, Any] | None) -> list[str]:
    """`megalaunch status` lines for `resume_summary`."""
    if not summary:
        return []
    lines = []
    last, pending = summary["last"], summary["pending"]
    if last is not None and last["event"] == "resume_from":
        who = f" (asked by {last['requested_by']})" if last.get("requested_by") else ""
        moved = ", ".join(map(str, last.get("abandoned") or []))
        lines.append(f"  resumed from iteration {last['iteration']}{who} by job {last['job_id']}"
                     + (f"; moved aside: {moved} (checkpoints/iter_NNNNNNN.abandoned-{last['job_id']})"
                        if moved else ""))
    elif last is not None:
        lines.append(f"  resume from iteration {last.get('iteration')} refused by job {last['job_id']}: "
                     f"{last.get('reason')}")
    if pending is not None:
        lines.append(f"  resume request pending: iteration {pending.get('iteration')}"
                     + (f" (by {pending['user']})" if pending.get("user") else "")
                     + (f" - {pending['error']}" if pending.get("error") else "; the next segment starts there"))
    return lines


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 86400:
        return f"{seconds // 86400} d {seconds % 86400 // 3600} h"
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{seconds // 60} min {seconds % 60} s"


def tokens_per_s(metrics: list[dict[str, Any]], *, running: bool) -> float | None:
    """Training tokens/s from state/metrics.jsonl: while the chain runs, over the newest segment's last
    (up to) 20 log intervals; otherwise the average over every logged interval of the run. Each line's
    rate leaves its interval's saves out; intervals are weighted by their samples (tokens over time,
    not a mean of rates). None before two log intervals of one segment."""
    previous: dict[Any, int] = {}
    intervals: list[tuple[Any, int, float]] = []  # (job, samples, tokens/s)
    for r in metrics:
        job, samples, rate = r.get("job_id"), r.get("consumed_samples"), r.get("tokens_per_s")
        before = previous.get(job)
        if isinstance(samples, int):
            previous[job] = samples
        if (isinstance(before, int) and isinstance(samples, int) and samples > before
                and isinstance(rate, (int, float)) and rate > 0):
            intervals.append((job, samples - before, float(rate)))
    if running and intervals:
        intervals = [i for i in intervals if i[0] == intervals[-1][0]][-20:]
    if not intervals:
        return None
    return sum(n for _, n, _ in intervals) / sum(n / rate for _, n, rate in intervals)


def _efficiency(paths: RunPaths, recipe: Any, it: int | None, metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Goodput so far, MFU of the latest segment, and the training time left at the recent pace."""
    from megalaunch.launcher.accounting.goodput import STARTUP, chain_goodput, mfu

    try:
        chain = chain_goodput(paths, time.time(), metrics)
    except (OSError, ValueError, KeyError, TypeError):  # a half-written file: status must still answer
        return {"goodput": None}
    wall = chain["wall"]
    if not chain["segments"] or wall <= 0:
        return {"goodput": None}
    totals = chain["totals"]
    latest = chain["segments"][-1]
    rate = _iterations_per_s(metrics)
    left = None
    if rate and it is not None:
        left = max(0, recipe.training.train_iters - int(it)) / rate
    return {"goodput": chain["goodput"], "wall_h": wall / 3600.0,
            "startup_share": sum(totals[k] for k in STARTUP) / wall, "save_share": totals["checkpoint_save"] / wall,
            "lost_share": totals["lost_work"] / wall,
            "mfu": mfu(latest["tflops_per_gpu"], latest["gpu"], recipe.cluster.gpu_peak_tflops), "eta_s": left}


def _iterations_per_s(metrics: list[dict[str, Any]]) -> float | None:
    """Iterations per second of training over the last (up to) 20 log intervals of one segment."""
    rows = metrics[-20:]
    if rows:
        rows = [r for r in rows if r.get("job_id") == rows[-1].get("job_id")]
    if len(rows) < 2:
        return None
    di, dt = rows[-1]["iteration"] - rows[0]["iteration"], rows[-1]["time"] - rows[0]["time"]
    return di / dt if di > 0 and dt > 0 else None


def all_runs_status(runs: list[RunPaths]) -> list[dict[str, Any]]:
    """One line per run, from one query per backend for the unfinished segments of all of them."""
    loaded = []
    for paths in runs:
        try:
            loaded.append((paths, load_run_recipe(paths), Ledger(paths)))
        except Exception:
            continue  # unreadable or half-written: not listed
    segments = {paths.root: ledger.segments() for paths, _, ledger in loaded}
    by_backend: dict[str, list[Segment]] = {}
    for paths, recipe, _ in loaded:
        by_backend.setdefault(recipe.cluster.backend, []).extend(segments[paths.root])
    live: dict[str, Live] = {}
    errors: dict[str, str | None] = {}
    for name, group in by_backend.items():
        found, errors[name] = backend_for(name).live(group)
        live.update(found)
    out = []
    for paths, recipe, ledger in loaded:
        error = errors[recipe.cluster.backend]
        waiting = unfinished(segments[paths.root])
        jobs = [s.job_id for s in waiting if s.job_id in live]
        stopped = ledger.stopped()
        if any(live[j].state == "RUNNING" for j in jobs):
            state = "running"
        elif jobs:
            state = "queued"
        elif error is not None and waiting and not stopped:
            state = "unknown"
        else:
            state = "stopped" if stopped else "idle"
        progress = read_progress(paths) or {}
        out.append({"chain_name": paths.root.name, "run_dir": str(paths.root), "state": state,
                    "jobs": jobs, "iteration": shown_iteration(progress, paths.read_tracker()),
                    "target": recipe.training.train_iters, "stop_reason": stopped.get("reason") if stopped else None,
                    "owner": _owner(paths), "slurm_error": error})
    return out


def _owner(paths: RunPaths) -> str:
    import pwd

    try:
        return pwd.getpwuid(paths.root.stat().st_uid).pw_name
    except (KeyError, OSError):
        return "?"
