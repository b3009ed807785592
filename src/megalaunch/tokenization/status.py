"""Per-dump status from the run directory (summaries, completion markers, progress files) and
one `squeue` for the last Slurm submission: done / running / pending / failed / not submitted."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from megalaunch.rundir.files import read_json
from megalaunch.rundir.tokenize import TokenizeRun
from megalaunch.tokenization.plan import load_plan

# A running task whose progress file is older than this is shown as stalled.
STALE_S = 120.0


@dataclass(frozen=True)
class DumpStatus:
    index: int
    state: str  # done | running | pending | failed | cancelled | not submitted | stopped
    tasks_done: int
    tasks: int
    documents: int
    tokens: int
    tokens_per_s: float | None  # running: over the last minute; done: the dump's average; stalled: None
    job: str = ""
    detail: str = ""
    started: float | None = None  # the first task's start (time.time())
    finished: float | None = None  # done: when its summary was written


def _array_tasks(job_id: str, slurm: Any) -> dict[int, str]:
    """Array task index -> Slurm state, for the active tasks of array `job_id` (one squeue)."""
    out: dict[int, str] = {}
    for jid, info in slurm.squeue([job_id]).items():
        if "_" not in jid:
            continue
        tail = jid.split("_", 1)[1]
        if tail.startswith("["):  # pending range: "[3-5,7%2]"
            for part in tail.strip("[]").split("%")[0].split(","):
                lo, _, hi = part.partition("-")
                for i in range(int(lo), int(hi or lo) + 1):
                    out[i] = info.state
        elif tail.isdigit():
            out[int(tail)] = info.state
    return out


def dump_statuses(run: TokenizeRun, slurm: Any | None = None) -> list[DumpStatus]:
    plan = load_plan(run)
    submissions = [e for e in run.events() if e.get("event") == "submitted"]
    last = submissions[-1] if submissions else None
    submitted = {d for e in submissions for d in e.get("dumps", [])}
    active: dict[int, str] = {}
    local_running = False
    if last and last.get("job_id"):  # a Slurm job array
        if slurm is None:
            from megalaunch.launcher.backends.slurm import SlurmClient

            slurm = SlurmClient()
        active = _array_tasks(str(last["job_id"]), slurm)
    elif last and last.get("pid"):  # dumps run on this machine
        from megalaunch.tokenization.submit import active_submission

        local_running = active_submission(run) is not None
    now = time.time()
    out = []
    for dump in plan.dumps:
        n_tasks = len(dump.tasks)
        done_tasks = sum(run.completion(dump.index, t).exists() for t in range(n_tasks))
        summary = read_json(run.summary(dump.index))
        job = f"{last['job_id']}_{dump.index}" if last and last.get("job_id") else ""
        progs = [p for t in range(n_tasks) if (p := read_json(run.progress(dump.index, t)))]
        started = min((p["started"] for p in progs), default=None)
        if summary:
            finished = summary.get("finished")
            average = (summary["tokens"] / (finished - started)
                       if started is not None and finished is not None and finished > started else None)
            out.append(DumpStatus(dump.index, "done", n_tasks, n_tasks, summary["documents"], summary["tokens"],
                                  average, job, started=started, finished=finished))
            continue
        documents = sum(p["documents"] for p in progs)
        tokens = sum(p["tokens"] for p in progs)
        newest = max((p["updated"] for p in progs), default=0.0)
        rate: float | None = sum(recent_rate(p) for p in progs if not p["done"])
        state, detail = _state(dump.index, active, local_running, last, submitted, slurm, job)
        if state == "running" and newest and now - newest > STALE_S:
            detail, rate = f"no progress for {now - newest:.0f} s", None
        out.append(DumpStatus(dump.index, state, done_tasks, n_tasks, documents, tokens, rate, job, detail,
                              started=started))
    return out


def recent_rate(progress: dict[str, Any]) -> float:
    """A running task's tokens/s over its recent samples (about the last minute), not since it started;
    a progress file without samples (an older writer): since it started."""
    recent = progress.get("recent") or []
    if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
        return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
    if progress["updated"] > progress["started"]:
        return progress["tokens"] / (progress["updated"] - progress["started"])
    return 0.0


def _state(index: int, active: dict[int, str], local_running: bool, last: dict[str, Any] | None,
           submitted: set[int], slurm: Any, job: str) -> tuple[str, str]:
    if index in active:
        return ("running" if active[index] in ("RUNNING", "COMPLETING") else "pending"), ""
    if local_running and last and index in last.get("dumps", []):
        return "running", ""
    if index not in submitted:
        return "not submitted", ""
    if last and last.get("job_id") and index in last.get("dumps", []):
        info = slurm.job_state(job)
        if info is not None and info.state in ("CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
            return ("cancelled" if info.state == "CANCELLED" else "failed"), info.state
        return "failed", "ended without completing all tasks"
    return "stopped", "not running; resubmit to resume"


def totals(statuses: list[DumpStatus]) -> dict[str, Any]:
    """Sums, and one rate: while dumps run, theirs over the last minute (`rate_over` "recent"; None when
    every running dump is stalled); once none runs, the average over the run so far: the finished
    dumps' tokens over the time from the first start to the last finish (`rate_over` "run")."""
    running = [s for s in statuses if s.state == "running"]
    rate: float | None
    if running:
        rates = [s.tokens_per_s for s in running if s.tokens_per_s is not None]
        rate, over = (sum(rates) if rates else None), "recent"
    else:
        spans = [(s.started, s.finished, s.tokens) for s in statuses
                 if s.state == "done" and s.started is not None and s.finished is not None]
        span = (max(f for _, f, _ in spans) - min(b for b, _, _ in spans)) if spans else 0.0
        rate, over = (sum(n for _, _, n in spans) / span if span > 0 else None), "run"
    return {"dumps": len(statuses), "done": sum(s.state == "done" for s in statuses),
            "tasks": sum(s.tasks for s in statuses), "tasks_done": sum(s.tasks_done for s in statuses),
            "documents": sum(s.documents for s in statuses), "tokens": sum(s.tokens for s in statuses),
            "tokens_per_s": rate, "rate_over": over}
