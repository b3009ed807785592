"""Bad nodes: which node a failed segment points at, the team's node-health ledger, and which nodes a
successor excludes (issue 12, docs/training.md "Bad nodes").

The ledger is one append-only JSON-lines file, `suspects.jsonl`, in a directory shared by the team
(`cluster.node_health_dir`, one per cluster; default RUN_ROOT/.node-health). Every decision about a
node is an event in it: `suspect` (a failure attributed to the node, with its evidence and an
expiry), `cleared` (by `megalaunch nodes clear`). A node is suspect while its latest `suspect` event
has not expired and no later `cleared` event exists. Appends of one short line are atomic with
O_APPEND on local and NFS/Lustre file systems, so concurrent jobs of the team need no lock.

Attribution is conservative: a segment that failed (not a configuration error, not a stop) names the
node of the rank that ended first (the task supervisors' exit records, or Slurm's `srun: error:
NODE: task N:` lines); hardware and driver signatures in the segment's log (Xid, ECC, illegal memory
access, NCCL errors, out of memory, segmentation faults) that name a node add to its evidence.
Exclusion never makes a job unschedulable: only nodes that `sinfo` still knows, and never so many that
fewer than the job's nodes remain."""

from __future__ import annotations

import getpass
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.launcher.accounting.evidence import NODE_LOST, TaskEnd, current_step
from megalaunch.rundir.files import append_team_jsonl, read_team_jsonl

LEDGER_FILE = "suspects.jsonl"
# A node name as Slurm and DNS allow it: what the team ledger names (members write it) reaches `--exclude`.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# Log signatures of a sick node, most specific first: (label, pattern).
SIGNATURES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("xid", re.compile(r"\bXid\b|NVRM: Xid", re.I)),
    ("ecc", re.compile(r"\b(uncorrectable )?ECC error|double.bit ECC|ECC errors? detected", re.I)),
    ("illegal memory access", re.compile(r"illegal memory access", re.I)),
    ("nccl", re.compile(r"NCCL (error|WARN .*(timeout|unhandled)|.*Watchdog caught collective operation timeout)",
                        re.I)),
    ("out of memory", re.compile(r"CUDA out of memory|OutOfMemoryError|oom-kill", re.I)),
    ("segfault", re.compile(r"Segmentation fault|SIGSEGV", re.I)),
)


@dataclass(frozen=True)
class Suspect:
    node: str
    reason: str
    evidence: list[str]
    run: str
    job_id: str
    time: float
    expires: float
    user: str = ""

    def describe(self, now: float | None = None) -> str:
        left = self.expires - (now if now is not None else time.time())
        return (f"{self.node}: {self.reason} (run {self.run}, job {self.job_id}; expires in "
                f"{_duration(max(left, 0.0))})")


@dataclass
class Attribution:
    """What a failed segment says about its nodes."""

    suspects: dict[str, list[str]] = field(default_factory=dict)  # node -> evidence lines
    reason: str = ""


class NodeHealth:
    """The team's node-health ledger in `directory` (created group-writable on first write)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.file = self.directory / LEDGER_FILE

    # --- writing ------------------------------------------------------------------------------
    def _append(self, record: dict[str, Any]) -> None:
        append_team_jsonl(self.file, record)

    def suspect(self, node: str, *, reason: str, evidence: list[str], run: str, job_id: str, ttl_s: float,
                now: float | None = None) -> Suspect:
        now = time.time() if now is None else now
        s = Suspect(node=node, reason=reason, evidence=evidence[:20], run=run, job_id=job_id, time=now,
                    expires=now + ttl_s, user=getpass.getuser())
        self._append({"event": "suspect", **s.__dict__})
        return s

    def clear(self, node: str, *, now: float | None = None, reason: str | None = None) -> None:
        self._append({"event": "cleared", "node": node, "user": getpass.getuser(),
                      "time": time.time() if now is None else now, **({"reason": reason} if reason else {})})

    # --- reading ------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        return [rec for rec in read_team_jsonl(self.file) if isinstance(rec.get("node"), str)
                and NODE_NAME.fullmatch(rec["node"])]

    def active(self, now: float | None = None) -> dict[str, Suspect]:
        """Suspect nodes now: latest suspect event unexpired and not cleared since."""
        now = time.time() if now is None else now
        latest: dict[str, Suspect] = {}
        for rec in self.events():
            if rec.get("event") == "cleared":
                latest.pop(rec["node"], None)
            elif rec.get("event") == "suspect":
                try:
                    latest[rec["node"]] = Suspect(**{k: rec[k] for k in Suspect.__dataclass_fields__ if k in rec})
                except TypeError:
                    continue
        return {n: s for n, s in latest.items() if s.expires > now}


# --- attribution ---------------------------------------------------------------------------------

def attribute(ends: list[TaskEnd], log: Path | None, nodes: list[str]) -> Attribution:
    """The node(s) a failed segment points at. `ends`: abnormal task ends, earliest first
    (evidence.abnormal_ends); `nodes`: the segment's nodes (for log lines that name one)."""
    att = Attribution()
    if ends:
        first = ends[0]
        att.suspects[first.node] = [e.how if e.rank == NODE_LOST else f"rank {e.rank} {e.how}"
                                    for e in ends if e.node == first.node]
        att.reason = f"first to fail: {first.describe()}"
    known = set(nodes) | {e.node for e in ends}
    for node, label, line in _signatures(log, known):
        if node in att.suspects or label in ("xid", "ecc", "illegal memory access"):
            att.suspects.setdefault(node, []).append(f"{label}: {line[:200]}")
            if not att.reason:
                att.reason = f"{label} on {node}"
    return att


def _signatures(log: Path | None, nodes: set[str]) -> list[tuple[str, str, str]]:
    if log is None or not nodes:
        return []
    try:
        with open(log, errors="replace") as f:  # the end of a long log is where a failure is
            lines = current_step(f.read()).splitlines()[-20000:]
    except OSError:
        return []
    found = []
    for line in lines:
        named = [n for n in nodes if re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w-])", line)]
        if len(named) != 1:
            continue
        for label, pattern in SIGNATURES:
            if pattern.search(line):
                found.append((named[0], label, line.strip()))
                break
    return found


# --- exclusion -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExclusionPlan:
    exclude: list[str]
    kept: dict[str, str]  # suspect node -> why it is not excluded

    def describe(self) -> str:
        parts = []
        if self.exclude:
            parts.append("excludes " + ", ".join(self.exclude))
        parts += [f"keeps {n} ({why})" for n, why in sorted(self.kept.items())]
        return "; ".join(parts) or "no suspect nodes"


def plan_exclusion(suspects: dict[str, Suspect], known: list[str] | None, need: int) -> ExclusionPlan:
    """Which suspects a job of `need` nodes excludes, given the nodes `sinfo` knows (None: unknown,
    exclude nothing). The most recently suspected go first; never below `need` usable nodes."""
    if not suspects:
        return ExclusionPlan([], {})
    if known is None:
        return ExclusionPlan([], {n: "Slurm did not list its nodes" for n in suspects})
    kept: dict[str, str] = {}
    candidates = []
    for node in sorted(suspects, key=lambda n: -suspects[n].time):
        if node not in known:
            kept[node] = "Slurm no longer knows it"
        else:
            candidates.append(node)
    room = max(len(known) - need, 0)
    exclude = sorted(candidates[:room])
    for node in candidates[room:]:
        kept[node] = (f"excluding it would leave fewer than the job's {need} node(s) of the "
                      f"{len(known)} Slurm lists")
    return ExclusionPlan(exclude, kept)


def current_plan(settings: Any, known_nodes: Any, warn: Any = print) -> ExclusionPlan | None:
    """What a job queued now excludes, for a run's RuntimeSettings (None: exclusion off, no ledger,
    or nothing suspect). `known_nodes(partition)` is the backend's (None: cannot tell)."""
    if not settings.node_health_dir or not settings.exclude_suspects:
        return None
    health = NodeHealth(settings.node_health_dir)
    try:
        suspects = health.active()
    except OSError as e:  # an unreadable ledger must never stop a job from being queued
        warn(f"could not read the node-health ledger {health.file}: {e}")
        return None
    if not suspects:
        return None
    # the job asks for its spares too (cluster.spare_nodes): sbatch refuses an --exclude that leaves fewer
    return plan_exclusion(suspects, known_nodes(settings.partition), settings.nodes + settings.spare_nodes)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def health_evidence(rank: dict[str, object], check: dict[str, object]) -> str:
    """One rank's health-check figures against the reference, as the node-health ledger keeps them."""
    if rank.get("error"):
        return f"rank {rank.get('rank')} failed: {rank.get('error')}"
    ref = check.get("reference_tflops")
    tf = rank.get("tflops")
    ratio = f" ({tf / ref:.0%} of the reference {ref:.3g})" if isinstance(tf, (int, float)) and \
        isinstance(ref, (int, float)) and ref > 0 else ""
    return f"rank {rank.get('rank')} matmul {tf} TFLOP/s{ratio}"
