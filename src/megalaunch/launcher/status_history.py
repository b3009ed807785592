"""What the ledger says happened to a run, as the lines `megalaunch status` shows: the bad-node decisions,
the in-job restarts, the latest health check, the stragglers, and `resume --from` (what the job did with
the latest request, and one still pending). Each reads the ledger's events (and the pending
resume request); none asks the backend."""

from __future__ import annotations

import time
from typing import Any

from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.resume_request import read_resume_request


def node_decisions(events: list[dict[str, Any]]) -> list[str]:
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
        elif e.get("event") == "node_cleared":
            out.append(f"cleared {e.get('node')} after job {e.get('job_id')}: {e.get('reason')}")
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
            off = (f"; kept off {', '.join(e['exclude'])}" if e.get("exclude") else "") + "".join(
                f"; {n} used again ({why})" for n, why in sorted((e.get("kept") or {}).items())) + (
                f"; went on with {e['shrink_to']} nodes (no spare left, cluster.min_nodes)" if e.get("shrink_to") else "")
            out.append(f"job {e.get('job_id')} started step {e.get('step')} after {e.get('after')} "
                       f"({e.get('reason')}), from checkpoint {e.get('checkpoint_iteration')}{off}")
        elif e.get("event") == "restart_refused":
            out.append(f"job {e.get('job_id')} did not restart step {e.get('step')} ({e.get('after')}): "
                       f"{e.get('reason')}")
    return out


def health_lines(events: list[dict[str, Any]]) -> list[str]:
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
            + (f" ({e['rank_count']} ranks on {e.get('nodes')}, {e.get('min_tflops')}-{e.get('max_tflops')})"
               if (e.get("rank_count") or 0) > len(figs) else "")
            + (f" (reference {e['reference_tflops']:.3g})" if isinstance(e.get("reference_tflops"), (int, float)) else "")
            + (f", all-reduce {ar:.3g} GB/s" if isinstance(ar, (int, float)) else "")
            + (f", {e['seconds']:.1f} s" if isinstance(e.get("seconds"), (int, float)) else "")]


def straggler_lines(events: list[dict[str, Any]], segments: int = 3) -> list[str]:
    """The latest step-time spread (runtime/health/stragglers.py) of each of the last `segments` segments that
    have one, when above the threshold (a run of thousands of segments: what a person can act on now)."""
    from megalaunch.runtime.health.stragglers import describe

    latest: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("event") == "stragglers":
            latest[str(e.get("job_id"))] = e
    out = []
    for job, e in list(latest.items())[-segments:]:
        try:
            if e.get("straggling"):
                out.append(f"job {job}: {describe(e)}")
        except (KeyError, TypeError, ValueError):  # a record of another version: skip it
            continue
    return out


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
