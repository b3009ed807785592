"""A node of the step died: end the step now, not when Slurm declares the node DOWN.

When a node dies, its ranks vanish; their peers' collectives fail at once and the peers exit, and Slurm
(`srun --kill-on-bad-exit`) ends the rest of the step on every node it can reach. srun itself returns
only once slurmctld declares the dead node DOWN: `SlurmdTimeout` plus its pings (15 s on the scale
cluster, 300 s and more with Slurm's defaults, docs/scale.md), while the allocation idles.

So `job watch` (runtime/hangwatch.py) also keeps account of how the step's ranks ended: each rank's exit
record (runtime/task.py: RUN/state/tasks/<job>/rank-R.json) and srun's lines about tasks it saw end
(`srun: error: snode3: tasks 4-7: Killed`). When every rank of every node but some has ended, at least one
of them abnormally, and the others' nodes have not accounted for a single rank for GRACE_S, those nodes
are lost: it says so in the segment log (a line `job step-end` reads as it reads srun's `Node failure on
X`, launcher/accounting/evidence.py), and kills the step. A node whose ranks still run there (slow to
exit, not dead) would have ended them when Slurm killed the step's tasks: Slurm reaches a live node
within a second or two, and GRACE_S is several times that. Standard library only."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from megalaunch.rundir.files import append_jsonl, read_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.health.node_beat import NodeSilence
from megalaunch.runtime.health.slurm_step import SRUN_ABORT_WAIT_S, SlurmStep, kill_step, log, wait_gone

GRACE_S = 5.0
# What the watcher writes when it ends the step; NODE_FAILURE_LINE reads it as it reads srun's own
# `Node failure on X` (launcher/accounting/evidence.py: the node is the cause, its peers' ends consequences).
LOST_LINE = "megalaunch hangwatch: node lost: {node} (no rank of it ended {grace:g} s after the others: ending the step)"
# a node that stopped beating (runtime/health/node_beat.py): frozen, powered off, cut off
SILENT_LINE = ("megalaunch hangwatch: node lost: {node} ({why}: frozen, or cut off from the network or the file "
               "system; ending the step)")
NODE_FAILURE_LINE = re.compile(r"^(?:srun: error: Node failure on|megalaunch hangwatch: node lost:) (?P<node>[^\s]+)",
                               re.M)
# srun: error: node2: task 1: Killed / tasks 0-3: Exited with exit code 1 / task 0: Segmentation fault
SRUN_TASK_LINE = re.compile(r"^srun: error: (?P<node>[^:\s]+): tasks? (?P<tasks>[0-9,\-]+): (?P<what>.+)$", re.M)
# `job step-end` prints this before an in-job restart (launcher/chain/restart.py): a step's srun lines follow
# the last one (the steps before it were judged at their own end)
RESTART_MARKER = "megalaunch: in-job restart:"


@dataclass
class NodeLoss:
    """The decision, fed with the ranks known to have ended (no I/O: tests drive it with a fake clock)."""

    nodes: list[str]  # the step's nodes, in order
    tasks_per_node: int
    grace_s: float = GRACE_S
    since: float | None = None  # when the present picture (some nodes silent, the rest ended) was first seen
    _silent: tuple[str, ...] = field(default=(), repr=False)

    def lost(self, now: float, ended: dict[str, set[int]], failed: bool) -> list[str]:
        """The nodes lost by now: `ended` maps a node to its ranks known to have ended; `failed`: one of
        those ended abnormally."""
        silent = tuple(n for n in self.nodes if not ended.get(n))
        complete = all(len(ended.get(n, ())) >= self.tasks_per_node for n in self.nodes if n not in silent)
        if not (failed and silent and complete and len(silent) < len(self.nodes)):
            self.since, self._silent = None, ()
            return []
        if silent != self._silent or self.since is None:
            self.since, self._silent = now, silent
        return list(silent) if now - self.since >= self.grace_s else []


class EndedRanks:
    """The ranks of one step known to have ended, from their records and srun's lines; read incrementally."""

    def __init__(self, tasks_dir: Path, segment_log: Path) -> None:
        self.tasks_dir, self.segment_log = tasks_dir, segment_log
        self.ended: dict[str, set[int]] = {}
        self.failed = False
        self._seen: set[str] = set()
        self._offset = 0
        self._tail = ""

    def update(self) -> None:
        self._records()
        self._srun_lines()

    def _add(self, node: str, ranks: Iterable[int], bad: bool) -> None:
        self.ended.setdefault(node, set()).update(ranks)
        self.failed = self.failed or bad

    def _records(self) -> None:
        try:
            names = [e.name for e in os.scandir(self.tasks_dir) if e.name.startswith("rank-") and e.name.endswith(".json")]
        except OSError:
            return
        for name in names:
            if name in self._seen:
                continue
            record = read_json(self.tasks_dir / name)
            if not isinstance(record, dict) or "rank" not in record:
                continue  # being written: the next look
            self._seen.add(name)
            self._add(str(record.get("node") or "?"), [int(record["rank"])],
                      bool(record.get("signal") or record.get("exit_code")))

    def _srun_lines(self) -> None:
        try:
            with open(self.segment_log, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        self._offset += len(chunk)
        text = self._tail + chunk.decode(errors="replace")
        text, _, self._tail = text.rpartition("\n")  # a line still being written: the next look
        # this step's lines follow the last restart marker (`job step-end` writes it before the step starts:
        # never while this step runs)
        text = text[text.rfind(RESTART_MARKER) + 1:] if RESTART_MARKER in text else text
        for m in SRUN_TASK_LINE.finditer(text):
            what = m.group("what").strip().lower()
            self._add(m.group("node"), expand_tasks(m.group("tasks")), what != "exited with exit code 0")


def expand_tasks(tasks: str) -> list[int]:
    """srun's task list (`4-7`, `1,3`) as task ids."""
    out: list[int] = []
    for part in tasks.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class StepNodes:
    """What `job watch` asks each tick: the step's nodes lost by now (NodeLoss over EndedRanks)."""

    def __init__(self, nodes: list[str], tasks_per_node: int, tasks_dir: Path, segment_log: Path,
                 grace_s: float = GRACE_S) -> None:
        self.decision = NodeLoss(nodes, tasks_per_node, grace_s)
        self.ranks = EndedRanks(tasks_dir, segment_log)

    @classmethod
    def from_env(cls, tasks_dir: Path, segment_log: Path, env: dict[str, str] | None = None) -> StepNodes | None:
        """The step the job script is about to start (MEGALAUNCH_STEP_NODES, WORLD_SIZE); None for a step of
        one node (nothing to tell apart) or without them."""
        env = dict(os.environ) if env is None else env
        nodes = [n for n in (env.get("MEGALAUNCH_STEP_NODES") or "").split(",") if n]
        world = env.get("WORLD_SIZE") or ""
        if len(nodes) < 2 or not world.isdigit() or int(world) % len(nodes):
            return None
        return cls(nodes, int(world) // len(nodes), tasks_dir, segment_log)

    def check(self, now: float) -> list[str]:
        self.ranks.update()
        return self.decision.lost(now, self.ranks.ended, self.ranks.failed)


def ended_lines(lost: list[str], grace_s: float) -> dict[str, str]:
    """The segment-log lines for nodes whose ranks alone did not end (StepNodes)."""
    return {node: LOST_LINE.format(node=node, grace=grace_s) for node in lost}


def silent_lines(lost: list[str], decision: NodeSilence, now: float) -> dict[str, str]:
    """The segment-log lines for nodes that stopped beating (node_beat.StepSilence)."""
    return {node: SILENT_LINE.format(node=node, why=decision.why(now, node)) for node in lost}


def end_lost_step(paths: RunPaths, job_id: str, lines: dict[str, str], step_id: str | None, step: SlurmStep,
                  sleep: Callable[[float], None]) -> str:
    """Say which nodes were lost (the lines `job step-end` reads, NODE_FAILURE_LINE), record it, and end the
    step. `lines`: node -> its line."""
    for line in lines.values():
        log(line.removeprefix("megalaunch hangwatch: "))
    with contextlib.suppress(OSError):
        append_jsonl(paths.ledger, {"event": "step_nodes_lost", "time": time.time(), "job_id": job_id,
                                    "step": os.environ.get("MEGALAUNCH_STEP"), "nodes": list(lines),
                                    "why": [line.split(" (", 1)[-1].rstrip(")") for line in lines.values()]})
    # Cancelled, not signalled: Slurm ends the step's tasks wherever it reaches them (the survivors blocked in
    # a collective with a frozen peer too). srun itself then still waits KillWait + 2 s for the lost node's
    # tasks ("Job step aborted: Waiting up to 32 seconds" with Slurm's default KillWait): nothing of this
    # step is left for it to tell, so it is ended after a moment.
    step_ids = [f"{job_id}.{step_id}"] if step_id else step.step_ids()
    sruns = step.srun_pids()
    if step_ids and all(step.cancel(s) for s in step_ids):
        how = f"cancelled step {', '.join(step_ids)} (scancel)"
        if not wait_gone(sruns, SRUN_ABORT_WAIT_S, sleep):
            for pid in sruns:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            how += f", then ended srun, which waits for the lost node's tasks ({SRUN_ABORT_WAIT_S:g} s after)"
    else:
        how = kill_step(step, step_ids, sleep)
    log(f"{how}; `job step-end` decides what follows")
    return how
