"""Which rank, on which node, ended a segment first, and how: from the task supervisor's exit records
(RUN/state/tasks/<job>/rank-*.json, runtime/task.py) and Slurm's task-exit lines in the segment's log
(`srun: error: node2: task 1: Killed`), for when a supervisor could not write its record (it was
killed together with its rank)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.health.node_loss import (
    NODE_FAILURE_LINE,
    RESTART_MARKER,
    SRUN_TASK_LINE,
    expand_tasks,
)

# srun's lines about tasks, the restart marker, and a node srun or the step's watcher reported lost (its ranks
# left no record): one reading for the job (runtime/health/node_loss.py) and for the segment's judgement here
NODE_LOST = -1  # TaskEnd.rank of a whole node that died (its ranks' supervisors died with them)


@dataclass(frozen=True)
class TaskEnd:
    rank: int
    node: str
    how: str  # "killed by SIGKILL", "exited with status 1", or Slurm's words
    time: float | None = None  # None: from the log, order only

    def describe(self) -> str:
        return f"{self.node} {self.how}" if self.rank == NODE_LOST else f"rank {self.rank} on {self.node} {self.how}"


def task_records(paths: RunPaths, job_id: str) -> list[dict[str, object]]:
    d = paths.tasks(job_id)
    if not d.is_dir():
        return []
    return [r for f in sorted(d.glob("rank-*.json")) if isinstance(r := read_json(f), dict)]


def rank_errors(paths: RunPaths, job_id: str) -> list[dict[str, object]]:
    """The trainers' own accounts of their failures (RUN/state/tasks/<job>/error-rank-*.json),
    earliest first."""
    d = paths.tasks(job_id)
    if not d.is_dir():
        return []
    records = [r for f in d.glob("error-rank-*.json") if isinstance(r := read_json(f), dict)]
    return sorted(records, key=lambda r: float(str(r.get("time") or 0)))


def config_error(paths: RunPaths, job_id: str) -> dict[str, object] | None:
    """The first configuration error any rank of the segment recorded, if one did."""
    return next((r for r in rank_errors(paths, job_id) if r.get("config")), None)


def abnormal_ends(paths: RunPaths, job_id: str, log: Path | None = None) -> list[TaskEnd]:
    """Ranks that were killed or exited non-zero, the first to end first: supervisor records by
    time, then ranks known only from Slurm's lines, in log order."""
    ends: list[TaskEnd] = []
    for r in task_records(paths, job_id):
        if r.get("signal"):
            how = f"was killed by {r['signal']}"
        elif r.get("exit_code"):
            how = f"exited with status {r['exit_code']}"
        else:
            continue
        ends.append(TaskEnd(rank=int(str(r["rank"])), node=str(r.get("node") or "?"), how=how,
                            time=float(str(r.get("ended") or 0))))
    ends.sort(key=lambda e: e.time or 0.0)
    _peer_first(ends, {int(str(r["rank"])) for r in rank_errors(paths, job_id)
                       if PEER_LOST.search(str(r.get("reason") or ""))})
    known = {e.rank for e in ends}
    text = _step_text(log)
    for rank, node, what in _srun_lines(text):
        if rank not in known and what.lower() != "exited with exit code 0":
            known.add(rank)
            ends.append(TaskEnd(rank=rank, node=node, how=_slurm_words(what)))
    # a node that died: the cause; the ranks that failed on a collective with it are consequences
    lost: dict[str, str] = {}
    for m in NODE_FAILURE_LINE.finditer(text):
        end = text.find("\n", m.start())
        line = text[m.start():end if end >= 0 else None]
        lost.setdefault(m.group("node"), "was lost (Slurm: node failure)" if m.group(0).startswith("srun") else
                        "was lost (silent while the other nodes beat: frozen or cut off; the step's watcher ended it)"
                        if "(silent for" in line or "(never beat" in line else
                        "was lost (none of its ranks ended after its peers failed; the step's watcher ended it)")
    return [TaskEnd(rank=NODE_LOST, node=n, how=how) for n, how in lost.items()] + ends


# A collective that failed because its peer vanished: the rank that ends with this error a moment
# after a peer was killed is a consequence, though its supervisor may record its end first.
PEER_LOST = re.compile(r"connection (?:reset|closed) by peer|broken pipe|NCCL communicator was aborted|"
                       r"remote process exited|peer (?:closed|reset|disconnected)|Socket Timeout", re.I)
CASCADE_S = 5.0


def _peer_first(ends: list[TaskEnd], lost_a_peer: set[int]) -> None:
    """Put first the earliest end, within CASCADE_S of the first, of a rank that did not just lose a peer."""
    if not ends or ends[0].rank not in lost_a_peer:
        return
    t0 = ends[0].time or 0.0
    cause = next((e for e in ends if e.rank not in lost_a_peer and (e.time or 0.0) - t0 <= CASCADE_S), None)
    if cause is not None:
        ends.remove(cause)
        ends.insert(0, cause)


def current_step(text: str) -> str:
    """A segment log's text from the last in-job restart on: the step being judged (the earlier ones were
    judged at their own end)."""
    at = text.rfind(RESTART_MARKER)
    return text if at < 0 else text[at:]


def lost_nodes(log: Path) -> list[str]:
    """Every node reported lost anywhere in a segment's log (srun's `Node failure on X`, or the step's watcher), in order."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return list(dict.fromkeys(m.group("node") for m in NODE_FAILURE_LINE.finditer(text)))


def _step_text(log: Path | None) -> str:
    if log is None:
        return ""
    try:
        return current_step(log.read_text(errors="replace"))
    except OSError:
        return ""


def _srun_lines(text: str) -> list[tuple[int, str, str]]:
    out = []
    for m in SRUN_TASK_LINE.finditer(text):
        for rank in expand_tasks(m.group("tasks")):
            out.append((rank, m.group("node"), m.group("what").strip()))
    return out


def _slurm_words(what: str) -> str:
    w = what.rstrip(".")
    if w == "Killed":
        return "was killed (SIGKILL, per Slurm)"
    if w.lower().startswith("exited with exit code "):
        return f"exited with status {w.rsplit(' ', 1)[-1]} (per Slurm)"
    return f"ended: {w} (per Slurm)"


def failure_reason(first: TaskEnd | None, outcome_reason: str | None, exit_code: int | None) -> str:
    """One line: the first rank to end abnormally, then what rank 0's outcome said."""
    if first is None:
        return outcome_reason or f"no outcome written (exit status {exit_code})"
    if outcome_reason is None:
        return f"{first.describe()} first; no outcome written"
    if first.rank == 0:
        return f"{outcome_reason} (rank 0 on {first.node})"
    return f"{first.describe()} first; rank 0 then: {outcome_reason}"
