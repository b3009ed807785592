"""In-job restarts and spare nodes (docs/training.md, "In-job restarts"): what `megalaunch job step-nodes`
and `job step-end` decide between the steps of one segment.

The job script runs its training step in a loop. Before each step, `step-nodes` names the nodes it runs
on: `cluster.nodes` of the allocation's, healthy ones first (not failed earlier in this job, not
suspect in the team's node-health ledger), so a spare (`cluster.spare_nodes`) takes the place of a node
that failed. After each step, `step-end` reads the step's outcome as `job end` would and decides
whether a new step starts in the same allocation (exit RESTART_EXIT_CODE) or the segment ends (exit 0,
`job end` follows). It restarts only a failure a restart can fix (a rank killed or crashed, a collective
error, a hang, a node failing its health check); never a configuration error, a full disk, a cancel, a
user's exit or abort, a stop for the time limit. It also refuses when the segment has used
`chain.restarts_per_segment`, when the crash-loop guard would stop the chain, and when the time left
cannot cover a start-up, `chain.min_train_time_s` and the stop signal's lead.

Why a new step rather than Megatron's in-process restart (megatron/training/inprocess_restart.py over
nvidia-resiliency-ext): the failures that matter most here kill a process (SIGKILL from the OOM killer or
the node, a segfault, a lost node), and a killed process cannot restart itself in place; in-process
restart keeps the surviving processes and needs a hot spare process per failed rank plus NCCL
communicator abort support, and re-runs Megatron's set-up (model, optimizer, checkpoint load) anyway. A
new step costs the same rebuild plus the interpreter start and imports, which the bytecode cache and
the checkpoint read-ahead shorten (runtime/bytecode.py, runtime/checkpoint/readahead.py); it works on CPU and GPU,
with or without NVRx, and moves ranks to another node. Measured: docs/results.md.

A step's evidence (outcome.json, the task records, the heartbeat and the timeline) is moved aside under
its step number before the next step starts, so each step is judged on its own and `job end` sees the
last one only; the segment log's srun lines are read after the last RESTART_MARKER."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from megalaunch.errors import MegalaunchError
from megalaunch.launcher.accounting.evidence import NODE_LOST, RESTART_MARKER, abnormal_ends
from megalaunch.launcher.accounting.nodes import NodeHealth
from megalaunch.launcher.chain.chain import Chain, log
from megalaunch.launcher.chain.segment_end import remove_failed_saves, what_ended, write_goodput
from megalaunch.rundir.files import read_json
from megalaunch.rundir.hostlist import compress_hostlist, expand_hostlist, node_names
from megalaunch.rundir.paths import RunPaths, step_file
from megalaunch.rundir.state import read_outcome
from megalaunch.rundir.triggers import TriggerBox
from megalaunch.runtime.checkpoint.resume import resume_point

RESTART_EXIT_CODE = 101  # `job step-end`: start a new step in this allocation
RESTARTABLE = {"failed", "hung", "unhealthy_node"}
STARTUP_GUESS_S = 120.0  # a start-up's length when no step of this run has reached its first iteration yet
STARTUP_SLACK = 1.25  # on a start-up measured before: the next one may be a little slower


@dataclass(frozen=True)
class StepEnd:
    restart: bool
    status: str
    reason: str


# ----------------------------------------------------------------------------------- step nodes
def step_nodes(chain: Chain, job_id: str, step: int, env: dict[str, str] | None = None) -> list[str]:
    """The nodes this step runs on: `cluster.nodes` of the allocation's, healthy first; recorded."""
    env = dict(os.environ) if env is None else env
    allocated = expand_hostlist(env.get("SLURM_JOB_NODELIST", ""))
    if not allocated:  # the job script falls back to the allocation's first nodes (scontrol)
        raise MegalaunchError("no SLURM_JOB_NODELIST in the environment", fix="`job step-nodes` runs inside a job")
    full = max(1, chain.settings.nodes)
    failed = failed_in_job(chain, job_id)
    suspect = _suspects(chain)
    usable = ([n for n in allocated if n not in failed and n not in suspect]
              + [n for n in allocated if n in suspect and n not in failed])
    need = step_size(chain, len(usable)) or full
    chosen = (usable + [n for n in allocated if n in failed])[:need]
    left_out = {n: ("failed in this segment" if n in failed else "suspect" if n in suspect else "spare")
                for n in allocated if n not in chosen}
    shrunk = {"shrunk_from": full} if len(chosen) < full else {}
    chain.ledger.append("step_started", job_id=job_id, step=step, nodes=compress_hostlist(chosen),
                        node_count=len(chosen), left_out=left_out, checkpoint_iteration=resume_point(chain.paths),
                        **shrunk)
    if step or left_out or shrunk:
        log(f"step {step} of segment {job_id} on {compress_hostlist(chosen)}"
            + (f": {len(chosen)} of {full} nodes (cluster.min_nodes), a smaller data-parallel size" if shrunk else "")
            + (f"; not used: {', '.join(f'{n} ({why})' for n, why in left_out.items())}" if left_out else ""))
    return chosen


def step_size(chain: Chain, usable: int) -> int | None:
    """How many of `usable` nodes a step runs on: `cluster.nodes`, else, with `cluster.min_nodes`, the largest
    smaller count the layout allows (RuntimeSettings.node_counts); None: too few."""
    counts = chain.settings.node_counts or [max(1, chain.settings.nodes)]
    return next((n for n in counts if n <= usable), None)


def failed_in_job(chain: Chain, job_id: str) -> set[str]:
    """Nodes an earlier step of this segment failed on (the restarts' `exclude`)."""
    return {str(n) for e in chain.ledger.events()
            if e["event"] == "restart" and str(e.get("job_id")) == job_id for n in e.get("exclude") or []}


def _suspects(chain: Chain) -> set[str]:
    d = chain.settings.node_health_dir
    if not d:
        return set()
    try:
        return set(NodeHealth(d).active())
    except OSError:
        return set()


def _step_started(chain: Chain, job_id: str) -> dict[str, Any] | None:
    return next((e for e in reversed(chain.ledger.events())
                 if e["event"] == "step_started" and str(e.get("job_id")) == job_id), None)


# ------------------------------------------------------------------------------------ step end
def step_end(chain: Chain, job_id: str, step: int, exit_code: int | None) -> StepEnd:
    """After a step: restart it in this allocation, or let the segment end (`job end` decides the chain)."""
    paths = chain.paths
    outcome = read_outcome(paths, job_id)
    ends = abnormal_ends(paths, job_id, paths.segment_log(job_id))
    status, reason, _fix, _figures = what_ended(paths, chain.ledger, job_id, outcome, ends, exit_code)
    if status not in RESTARTABLE:
        return StepEnd(False, status, "not a failure a restart fixes")
    started = _step_started(chain, job_id) or {}
    nodes = node_names(started.get("nodes"))
    culprits = _culprits(status, outcome or {}, ends, nodes)
    must_go = culprits if status == "unhealthy_node" else {e.node for e in ends if e.rank == NODE_LOST} & set(nodes)
    now_ckpt = resume_point(paths)
    progressed = now_ckpt is not None and now_ckpt > (started.get("checkpoint_iteration") or -1)
    refused = why_not(chain, job_id, status, must_go, progressed)
    if refused:
        chain.ledger.append("restart_refused", job_id=job_id, step=step, after=status, reason=refused)
        log(f"no in-job restart after step {step} ({status}): {refused}")
        return StepEnd(False, status, refused)
    if status == "failed":
        chain.suspects.after_failure(job_id, ends, nodes)
    elif status == "unhealthy_node":
        chain.suspects.after_health_check(job_id, outcome or {})
    # the successor queued at `job begin` stays off them too, now: the segment may train for hours yet
    chain.suspects.exclude_from(chain.pending_successors(job_id))
    remove_failed_saves(paths, job_id, log)
    archive_step(paths, job_id, step)
    exclude, kept = keep_off(chain, job_id, culprits | must_go, must_go)
    allocated = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))
    left = len([n for n in allocated if n not in failed_in_job(chain, job_id) | set(exclude)]) or len(nodes)
    size = step_size(chain, left) or s_nodes(chain)
    shrink = {"shrink_to": size} if size < s_nodes(chain) else {}
    chain.ledger.append("restart", job_id=job_id, step=step + 1, after=status, reason=str(reason or status),
                        exit_code=exit_code, first_failure=ends[0].__dict__ if ends else None,
                        checkpoint_iteration=now_ckpt, new_checkpoint=progressed, exclude=exclude, kept=kept,
                        **shrink)
    print(f"{RESTART_MARKER} step {step + 1} of segment {job_id} after {status}: {reason or status}",
          flush=True)
    log(f"in-job restart {step + 1}: {status} ({reason}); resuming from checkpoint iteration {now_ckpt}"
        + (f"; kept off {', '.join(exclude)}" if exclude else "")
        + "".join(f"; {n} used again ({why})" for n, why in sorted(kept.items()))
        + (f"; goes on with {size} of {s_nodes(chain)} nodes (no spare left, cluster.min_nodes)" if shrink else ""))
    write_goodput(paths, log)
    chain.notifier.restarted(job_id, step + 1, status, str(reason or status))
    return StepEnd(True, status, str(reason or status))


def s_nodes(chain: Chain) -> int:
    return max(1, chain.settings.nodes)


def why_not(chain: Chain, job_id: str, status: str, must_go: set[str], progressed: bool) -> str | None:
    """Why this restartable failure is not restarted in this allocation, or None: restart."""
    s = chain.settings
    if s.restarts_per_segment <= 0:
        return "in-job restarts are off (chain.restarts_per_segment: 0)"
    if chain.paths.cancel_requested.exists():
        return "a cancel was requested"
    pending = [v for v in TriggerBox(chain.paths).pending() if v in ("exit", "abort")]
    if pending:
        return f"an {pending[0]} trigger is pending"
    used = sum(1 for e in chain.ledger.events() if e["event"] == "restart" and str(e.get("job_id")) == job_id)
    if used >= s.restarts_per_segment:
        return f"this segment used its {used} restart(s) (chain.restarts_per_segment: {s.restarts_per_segment})"
    failures = chain.ledger.consecutive_without_progress() + (0 if progressed else 1)
    if failures >= s.max_segments_without_progress:
        return (f"{failures} consecutive failures without a new checkpoint: the crash-loop guard "
                f"(chain.max_segments_without_progress: {s.max_segments_without_progress}) decides")
    allocated = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))
    usable = [n for n in allocated if n not in must_go | failed_in_job(chain, job_id)]
    if must_go and allocated and step_size(chain, len(usable)) is None:
        what = ("the unhealthy one" if status == "unhealthy_node" else f"{', '.join(sorted(must_go))} (lost)")
        shrink = (f"; {len(usable)} usable, below cluster.min_nodes" if s.node_counts
                  else "; cluster.min_nodes would go on with fewer")
        return (f"no healthy node left in the allocation to replace {what} (cluster.spare_nodes){shrink}: the "
                "successor asks for a replacement")
    from megalaunch.runtime.stop.stop_window import find_deadline

    deadline = find_deadline()
    if deadline is not None:
        need = startup_estimate(chain.paths) + s.min_train_time_s + (s.signal_lead_s or 0) + s.signal_delay_s
        left = deadline - time.time()
        if left < need:
            return (f"{left:.0f} s left in the allocation, a restart needs {need:.0f} s (start-up, "
                    f"chain.min_train_time_s and the stop signal's lead)")
    return None


def keep_off(chain: Chain, job_id: str, culprits: set[str],
             must_go: frozenset[str] | set[str] = frozenset()) -> tuple[list[str], dict[str, str]]:
    """Which of a failed step's culprit nodes the next steps of this segment keep off (`exclude`), and
    which they must use again (`kept`, with why). A lost or unhealthy node (`must_go`) is always kept off
    (why_not refused the restart when too few would be left); a node where a rank failed only while a
    spare is left: a smaller step is not worth a failure that may not be the node's."""
    allocated = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))
    if not allocated:
        return sorted(culprits), {}
    already = failed_in_job(chain, job_id)
    gone = [n for n in allocated if n in must_go and n not in already]
    room = len([n for n in allocated if n not in already and n not in gone]) - s_nodes(chain)
    ordered = [n for n in allocated if n in culprits and n not in must_go and n not in already]
    exclude = sorted(gone + ordered[:max(0, room)])
    kept = {n: "no spare node left in the allocation (cluster.spare_nodes)" for n in ordered if n not in exclude}
    return exclude, kept


def _culprits(status: str, outcome: dict[str, Any], ends: list[Any], nodes: list[str]) -> set[str]:
    """The node(s) a restart keeps off: the health check's unhealthy ones, or the first failure's."""
    if status == "unhealthy_node":
        check = outcome.get("health_check") if isinstance(outcome.get("health_check"), dict) else {}
        return {str(n) for n in (check or {}).get("unhealthy_nodes") or []}
    if status == "failed" and ends and ends[0].node in nodes:
        return {ends[0].node}
    return set()


def startup_estimate(paths: RunPaths) -> float:
    """Seconds from a step's start to its first iteration, from the newest timeline that has both."""
    best: tuple[float, float] | None = None
    timelines = paths.state / "timeline"
    for f in timelines.glob("*.json") if timelines.is_dir() else []:
        data = read_json(f)
        ph = data.get("phases") if isinstance(data, dict) else None
        if not isinstance(ph, dict) or not all(isinstance(ph.get(k), (int, float))
                                               for k in ("process_start", "first_iteration_end")):
            continue
        took = float(ph["first_iteration_end"]) - float(ph["process_start"])
        if best is None or float(ph["first_iteration_end"]) > best[0]:
            best = (float(ph["first_iteration_end"]), took)
    return STARTUP_GUESS_S if best is None else best[1] * STARTUP_SLACK + 5.0


# ------------------------------------------------------------------------------------- archive
def archive_step(paths: RunPaths, job_id: str, step: int) -> None:
    """Move the failed step's outcome, task records, heartbeat and timeline aside (`.stepN`)."""
    outcome = read_json(paths.outcome)
    if isinstance(outcome, dict) and str(outcome.get("job_id")) == job_id:
        os.replace(paths.outcome, paths.state / f"outcome.{job_id}.step{step}.json")
    for p in (paths.tasks(job_id), paths.heartbeat(job_id), paths.timeline(job_id)):
        if p.exists():
            os.replace(p, step_file(p, step))
