"""What `megalaunch status` shows: read from the run directory, plus one batched query of the backend;
for one run (`run_status`) or for all of a user's runs, one line each (`all_runs_status`). The ledger's
history lines are status_history.py's, the pace launcher/accounting/pace.py's, the text status_format.py's.

Both read each run's ledger once. A listing of many runs reads of each only what its line shows: the
segments and stops of its ledger (`LISTED_EVENTS`), its backend and target from runtime.json (the recipe's
slice the job reads), its progress and tracker; the recipe itself only for `status RUN`."""

from __future__ import annotations

import os
import time
from typing import Any

from megalaunch.launcher.backends.registry import backend_for
from megalaunch.launcher.chain.backend import Live, unfinished
from megalaunch.rundir.files import read_json
from megalaunch.rundir.ledger import Ledger, Segment, segment_numbers
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import read_outcome, read_progress, shown_iteration

LIVE_STATES = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING")
# What a listing's line needs of a run's ledger: its unfinished segments, and whether and why its chain stopped.
LISTED_EVENTS = frozenset({"submitted", "started", "ended", "skipped", "chain_stopped", "chain_resumed"})
# What `status RUN` never reads of a ledger (a long run holds megabytes of them): the trainer's records of its
# set-up and acts, and the steps' node lists (the restarts' records say what status shows)
NOT_SHOWN = frozenset({"attention", "kernels", "decision", "checkpoint_deleted", "step_started", "readahead"})
# Written once per segment (or per resumed trainer): the segment table and the goodput read them, nothing else
PER_SEGMENT = frozenset({"submitted", "started", "ended", "resumed"})
STRAGGLER_RECORDS = 1000  # the newest `stragglers` records read: enough for the latest segments' last ones


def _row_state(s: Segment, live: Live | None, cancelled: dict[str, str], error: str | None) -> tuple[str, str | None]:
    if live is not None:
        return live.state, live.reason
    if s.ended is not None:
        why, lost = s.ended.get("reason") or s.ended.get("slurm_state"), s.ended.get("lost_nodes")
        return s.ended.get("outcome", "?").upper(), f"{why}, lost {', '.join(lost)}" if lost else why
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


def _chain_state(rows: list[dict[str, Any]], stopped: dict[str, Any] | None) -> str:
    active = [r for r in rows if r["state"] in LIVE_STATES]
    if active:
        return "running" if any(r["state"] == "RUNNING" for r in active) else "queued"
    if any(r["state"] == "UNKNOWN" for r in rows):
        return "unknown"
    return "stopped" if stopped else "idle"


def run_status(paths: RunPaths) -> dict[str, Any]:
    from megalaunch.config.loader import load_run_recipe
    from megalaunch.launcher.accounting.pace import efficiency, tokens_per_s
    from megalaunch.rundir import appended
    from megalaunch.rundir.appended import read_appended
    from megalaunch.rundir.files import parse_jsonl
    from megalaunch.rundir.triggers import TriggerBox

    appended.CACHE_JSON = True  # this process only shows: state/goodput.json through the user's cache
    recipe = load_run_recipe(paths)
    ledger = Ledger(paths)
    events = _shown_events(ledger)  # once: every line below is derived from these
    segments = ledger.segments(events)
    # The lines below the table read no per-segment record: they go through the rest (a chain of 5,000
    # segments has 20,000 of those and ~1,000 others), in the ledger's order.
    rest = [e for e in events if e["event"] not in PER_SEGMENT]
    live, slurm_error = backend_for(recipe.cluster.backend).live(segments)
    cancelled = _cancelled(rest)
    numbers = segment_numbers(segments)  # the numbers `logs --segment` and `report` use
    rows = []
    for s in segments:
        state, reason = _row_state(s, live.get(s.job_id), cancelled, slurm_error)
        rows.append({"segment": numbers[s.job_id], "job_id": s.job_id, "state": state, "reason": reason,
                     "start_iteration": s.start_iteration,
                     "end_iteration": (s.ended or {}).get("checkpoint_iteration")})
    progress = read_progress(paths) or {}
    checkpoint = paths.read_tracker()
    stopped = ledger.stopped(rest)
    chain_state = _chain_state(rows, stopped)
    vanished = _vanished(paths, recipe.cluster.backend, segments, rows, rest) if chain_state == "idle" else None
    if vanished is not None:  # the chain died with its newest job: say which, and why as far as anything tells
        chain_state = "failed"
    metrics = read_appended(paths.metrics, "metrics", parse_jsonl)  # once, for the goodput, the pace and tokens/s
    rate = tokens_per_s(metrics, running=chain_state == "running")
    figures = efficiency(paths, recipe, shown_iteration(progress, checkpoint), metrics, events, numbers, rate, chain_state == "running")
    box = TriggerBox(paths)
    return {
        **figures,
        "run_dir": str(paths.root), "name": recipe.name, "chain_name": paths.root.name,
        "backend": recipe.cluster.backend, "chain_state": chain_state,
        "stop_reason": stopped.get("reason") if stopped else None,
        "stop_fix": stopped.get("fix") if stopped else None,
        "iteration": shown_iteration(progress, checkpoint), "target": recipe.training.train_iters,
        "last_checkpoint": checkpoint,
        "tokens_per_s": rate if rate is not None else progress.get("tokens_per_s"),
        "tokens_per_s_over": "recent" if chain_state == "running" else "run",
        "loss": progress.get("loss"), "flow": progress.get("flow"), "reference": _last(rest, "reference_scored") or _last(rest, "reference"),
        "progress_age_s": (time.time() - progress["time"]) if progress.get("time") else None,
        "pending_triggers": box.pending(), "consumed_triggers": len(box.consumed()),
        "last_outcome": read_outcome(paths), "segments": rows, "slurm_error": slurm_error, "vanished": vanished,
        "hang_limits": read_json(paths.hang_limit(segments[-1].job_id)) if segments else None,
        **_history(paths, recipe, rest),
        "next": _next_command(paths, chain_state, recipe.training.train_iters, _last(rest, "exported")),
    }


def _vanished(paths: RunPaths, backend: str, segments: list[Segment], rows: list[dict[str, Any]],
              rest: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest segment when it ended before `job begin` recorded it (no `started`, no `ended`, not queued or
    running, not cancelled, not stopped at its begin): the job script died at its start (a missing command,
    a script error, a node gone); its row becomes FAILED with Slurm's state (while Slurm remembers the job)
    and the last lines of its log, which is where the shell's error went."""
    if not segments:
        return None
    s, row = segments[-1], rows[-1]
    stopped_at_begin = {str(e.get("job_id")) for e in rest if e["event"] == "chain_stopped"}
    if s.started is not None or s.ended is not None or s.skipped or row["state"] != "GONE" or s.job_id in stopped_at_begin:
        return None
    try:
        slurm_state = backend_for(backend).state(s.job_id)
    except Exception:  # Slurm did not answer: the state is unknown, the rest still tells
        slurm_state = None
    log = paths.segment_log(s.job_id)
    tail = _log_tail(log)
    row["state"] = "FAILED"
    row["reason"] = (f"ended before megalaunch started (no `job begin` record); Slurm: {slurm_state or 'state unknown'}"
                     + (f"; log: {tail[-1]}" if tail else f"; no log at {log}"))
    return {"segment": row["segment"], "job_id": s.job_id, "slurm_state": slurm_state, "log": str(log),
            "log_tail": tail}


def _log_tail(log: Any, lines: int = 3, max_bytes: int = 4096) -> list[str]:
    """The last `lines` non-empty lines of a segment's log, read from its last `max_bytes` only, each cut to
    200 characters (a log is the job's, of any size)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line.rstrip()[:200] for line in text.splitlines() if line.strip()][-lines:]


def _history(paths: RunPaths, recipe: Any, rest: list[dict[str, Any]]) -> dict[str, Any]:
    """The lines under the segment table, from the ledger's events other than the per-segment ones."""
    from megalaunch.launcher.accounting.storage import checkpoint_usage
    from megalaunch.launcher.prepare.signal_lead import stop_lines
    from megalaunch.launcher.status_history import (
        health_lines,
        node_decisions,
        restart_lines,
        resume_summary,
        straggler_lines,
    )

    return {
        "refused_triggers": [{k: e.get(k) for k in ("name", "kind", "planted_by", "why", "time")}
                             for e in rest if e.get("event") == "trigger_refused"],
        "last_guard": _last(rest, "guard"), "nodes": node_decisions(rest), "restarts": restart_lines(rest),
        "health": health_lines(rest), "stragglers": straggler_lines(rest), "stop_signal": stop_lines(rest),
        "resume": resume_summary(paths, rest), "storage": checkpoint_usage(paths, recipe, rest),
        "exported": _last(rest, "exported"),  # chain.export_hf's last stage (launcher/chain/last_stage.py)
        "moe": _moe(paths),
    }


def _moe(paths: RunPaths) -> dict[str, Any] | None:
    """An MoE run's expert load: the latest record's headline and the routers collapsing now (the end of
    state/moe_load.jsonl, runtime/observation/moe_balance.py); None for a dense run (no file)."""
    from megalaunch.runtime.observation.moe_balance import collapsing, summary, tail

    records = tail(paths.moe_load)
    return {"latest": summary(records[-1]), "collapsing": collapsing(records)} if records else None


def _shown_events(ledger: Ledger) -> list[dict[str, Any]]:
    """The events `status RUN` shows: not NOT_SHOWN; of the health checks (the bulk of a long run's ledger:
    every rank's figures per segment) the latest only, of the stragglers the latest segments'; parsed once
    per user up to what was appended since (rundir/appended.py)."""
    return ledger.events(skip=NOT_SHOWN, newest={"health_check": 1, "stragglers": STRAGGLER_RECORDS},
                         cache_key="status")


def _last(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in reversed(events) if e["event"] == kind), None)


def _next_command(paths: RunPaths, chain_state: str, target: int, exported: dict[str, Any] | None) -> str | None:
    """What to run once training is done: convert its last checkpoint for Hugging Face (unless the chain's
    last stage did, or the model is a mixture of experts, which conversion does not map yet: docs/conversion.md)."""
    import shlex

    tracker = paths.read_tracker()
    if chain_state != "stopped" or not isinstance(tracker, int) or tracker < target or (exported or {}).get("ok"):
        return None
    if paths.moe_load.exists():  # written by every MoE run's first log interval (runtime/observation/moe_load.py)
        return None
    return (f"megalaunch convert mcore-to-hf {shlex.quote(str(paths.root))} "
            f"--out {shlex.quote(str(paths.root / 'hf'))}")


def all_runs_status(runs: list[RunPaths]) -> list[dict[str, Any]]:
    """One line per run, from one query per backend for the unfinished segments of all of them. What a line
    shows of each run's files is kept in the user's cache while those files are unchanged (rundir/appended.py)."""
    from megalaunch.rundir.appended import by_stamp, stamp

    by_root = {str(p.root): p for p in runs}
    files = [os.path.relpath(f, runs[0].root) for f in (runs[0].run_yaml, runs[0].runtime_json, runs[0].ledger,
                                                         runs[0].progress, runs[0].tracker)] if runs else []
    listed = by_stamp("listing", {root: stamp(root, *(os.path.join(root, f) for f in files)) for root in by_root},
                      lambda root: _listed(by_root[root]))
    loaded = []
    for root, paths in by_root.items():
        if root not in listed:
            continue  # unreadable or half-written: not listed
        row = listed[root]
        ledger = Ledger(paths)
        loaded.append((paths, row, ledger.segments(row["events"]), ledger.stopped(row["events"])))
    by_backend: dict[str, list[Segment]] = {}
    for _, row, segments, _ in loaded:
        by_backend.setdefault(row["backend"], []).extend(segments)
    live: dict[str, Live] = {}
    errors: dict[str, str | None] = {}
    for name, group in by_backend.items():
        found, errors[name] = backend_for(name).live(group)
        live.update(found)
    owners: dict[int, str] = {}
    out = []
    for paths, row, segments, stopped in loaded:
        error = errors[row["backend"]]
        waiting = unfinished(segments)
        jobs = [s.job_id for s in waiting if s.job_id in live]
        if any(live[j].state == "RUNNING" for j in jobs):
            state = "running"
        elif jobs:
            state = "queued"
        elif error is not None and waiting and not stopped:
            state = "unknown"
        else:
            state = "stopped" if stopped else "idle"
        out.append({"chain_name": paths.root.name, "run_dir": str(paths.root), "state": state,
                    "jobs": jobs, "iteration": shown_iteration(row["progress"], row["tracker"]),
                    "target": row["target"], "stop_reason": stopped.get("reason") if stopped else None,
                    "owner": _owner(row["uid"], owners), "slurm_error": error})
    return out


def _listed(paths: RunPaths) -> dict[str, Any]:
    """What a listing's line shows of one run's files: its segments and stops (LISTED_EVENTS of its ledger;
    the rest of its lines is not parsed), its backend and target, progress, tracker and owner."""
    backend, target = _listed_settings(paths)
    events = Ledger(paths).events(LISTED_EVENTS.__contains__)
    return {"backend": backend, "target": target, "events": events, "progress": read_progress(paths) or {},
            "tracker": paths.read_tracker(), "uid": paths.root.stat().st_uid}


def _listed_settings(paths: RunPaths) -> tuple[str, int]:
    """The run's backend and `training.train_iters`: from runtime.json, which the job reads and every
    render writes with run.yaml (submit, `resume --set`); from the recipe where it lacks them."""
    if not paths.run_yaml.is_file():
        raise FileNotFoundError(paths.run_yaml)
    data = read_json(paths.runtime_json)
    if isinstance(data, dict) and isinstance(data.get("backend"), str) and type(data.get("train_iters")) is int:
        return data["backend"], data["train_iters"]
    from megalaunch.config.loader import load_run_recipe

    recipe = load_run_recipe(paths)
    return recipe.cluster.backend, recipe.training.train_iters


def _owner(uid: int, known: dict[int, str]) -> str:
    import pwd

    if uid not in known:
        try:
            known[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            known[uid] = "?"
    return known[uid]
