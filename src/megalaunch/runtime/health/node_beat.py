"""Every node's sign of life, apart from training progress: a node that stops beating while the others go on
is lost (issue 50). Standard library only.

Why: a machine that loses power or its network closes no socket. Its peers block in their collective (NCCL,
gloo, the stand-in's TCP group) and never exit, so nothing ends the step until Slurm declares the node DOWN
(`SlurmdTimeout` + pings: 16 s on the scale cluster, 477 s with Slurm's defaults, measured) or a hang limit
fires (minutes). Rank 0's heartbeat (heartbeat.py) cannot tell: it stops for a frozen peer and for a slow
step alike, and it names no node.

So on every node of a multi-node step one writer beats RUN/state/node_beats/<job>/<node>.json every
BEAT_S from a thread of its own: the task supervisor of the node's first task (runtime/task.py: a small
process that waits for its trainer, so a blocked collective, a slow step or a long save never stops it).
The batch host of a job with a keeper also beats for the job's whole life from a loop of the job script
(templates/train.sbatch.j2), and the keeper beats its own node. A node whose every process is stopped
(frozen, or its network or file system gone) stops beating; a writer whose work ended beats a last time
saying so (`"ended": true`), and such a node is never judged (its peers may still write their last save).

Who judges: the hang watcher on the batch host, every node of the step; the keeper (launcher/backends/
keeper.py), on the allocation's last node, the batch host (the watcher itself is on it). A node is silent
when its beat has not changed for SILENCE_S (the judge's own monotonic clock: the file's content, not its
time, so clocks may differ between nodes) while another node's beat changed within FRESH_S. Nothing is
judged when no node beats (between steps; a file system stall that stops every node; the judge itself just
resumed from a stall: it compares what it reads now) or when more than half of the nodes are silent at once
(a partial file-system stall is not half the cluster dying). A slow node is not a silent one: its
supervisor's thread beats whatever its trainer does. A node that never beat while the others have beaten
for NEVER_S did not start its tasks.

Cost: one small file written every BEAT_S per node (no fsync: liveness, not data); the watcher reads them every
second up to 64 nodes (32 nodes: 16 writes and 32 reads a second), less often beyond (StepSilence.every); the
keeper reads two files a second."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

BEAT_S = 2.0
SILENCE_S = 15.0  # MEGALAUNCH_NODE_SILENCE_S overrides (cluster.env): 7 missed beats
FRESH_S = 2 * BEAT_S + 1.0
NEVER_S = 45.0
SILENCE_ENV = "MEGALAUNCH_NODE_SILENCE_S"
ENDED = b'"ended": true'  # a writer's last beat (NodeBeat.stop, the job script's loop)


def silence_s(env: Mapping[str, str] | None = None) -> float:
    """The silence after which a node is lost: SILENCE_S, or MEGALAUNCH_NODE_SILENCE_S (at least 3 beats)."""
    raw = (os.environ if env is None else env).get(SILENCE_ENV, "")
    try:
        return max(3 * BEAT_S, float(raw)) if raw else SILENCE_S
    except ValueError:
        return SILENCE_S


def beat_dir(run_dir: str | os.PathLike[str], job_id: str) -> Path:
    return Path(run_dir) / "state" / "node_beats" / job_id


def step_nodes(env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    return [n for n in (env.get("MEGALAUNCH_STEP_NODES") or "").split(",") if n]


def this_node(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


class NodeBeat:
    """Beats one node's file every `interval` seconds from a daemon thread, until stopped or the process ends."""

    def __init__(self, directory: Path, node: str, by: str, interval: float = BEAT_S) -> None:
        self.path = directory / f"{node}.json"
        self.node, self.by, self.interval = node, by, interval
        self._stop = threading.Event()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="megalaunch-node-beat", daemon=True)

    def start(self) -> NodeBeat:
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more beats, and a last one that says so: a node whose work ended is not a silent one (its peers may
        still be writing their last checkpoint)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.beat(ended=True)

    def beat(self, ended: bool = False) -> None:
        """One beat: a new file renamed over the old one (a reader sees the old or the new, never half)."""
        self._seq += 1
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        text = json.dumps({"node": self.node, "by": self.by, "pid": os.getpid(), "seq": self._seq,
                           "time": round(time.time(), 3), "step": os.environ.get("MEGALAUNCH_STEP", ""),
                           **({"ended": True} if ended else {})}) + "\n"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a sign of life must never take the node's work down; the judge waits SILENCE_S

    def _run(self) -> None:
        while True:
            self.beat()
            if self._stop.wait(self.interval):
                return


def start_for_task(env: Mapping[str, str] | None = None) -> NodeBeat | None:
    """In a task supervisor: beat when this is the node's first task of a step of two nodes or more."""
    env = os.environ if env is None else env
    run_dir, job_id = env.get("MEGALAUNCH_RUN_DIR"), env.get("MEGALAUNCH_JOB_ID")
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if not run_dir or not job_id or local != "0" or len(step_nodes(env)) < 2:
        return None
    return NodeBeat(beat_dir(run_dir, job_id), this_node(env), "task supervisor").start()


def read_beats(directory: Path, nodes: list[str] | None = None) -> dict[str, bytes | None]:
    """Each node's beat file as bytes (None: not there); `nodes` None: every node that has a file."""
    if nodes is None:
        with contextlib.suppress(OSError):
            nodes = [e.name[:-5] for e in os.scandir(directory) if e.name.endswith(".json") and not e.name.startswith(".")]
    out: dict[str, bytes | None] = {}
    for node in nodes or []:
        try:
            out[node] = (directory / f"{node}.json").read_bytes()
        except OSError:
            out[node] = None
    return out


@dataclass
class NodeSilence:
    """The decision, fed with what was read: no I/O (tests drive it with a fake clock)."""

    silence_s: float = SILENCE_S
    fresh_s: float = FRESH_S
    never_s: float = NEVER_S
    started: float | None = None
    _seen: dict[str, bytes | None] = field(default_factory=dict)
    _changed: dict[str, float] = field(default_factory=dict)  # nodes that beat since the judge started
    _first_beat: float | None = None

    def observe(self, now: float, beats: Mapping[str, bytes | None]) -> None:
        """What the files hold now. The first look is the baseline: a file there before the judge started (an
        earlier step's) is not a beat of this one."""
        if self.started is None:
            self.started, self._seen = now, dict(beats)
            return
        for node, content in beats.items():
            if content is not None and content != self._seen.get(node):
                self._changed[node] = now
                self._first_beat = self._first_beat if self._first_beat is not None else now
            self._seen[node] = content

    def silent(self, now: float, nodes: list[str]) -> list[str]:
        """Which of `nodes` are lost by now (see the module docstring)."""
        fresh = [n for n, t in self._changed.items() if now - t < self.fresh_s]
        if not fresh:
            return []
        out = [node for node in nodes if self._lost(now, node)]
        if len(out) * 2 > len(nodes) and len(nodes) > 2:
            return []  # most of the step at once: the file system or the judge, not the nodes
        return out

    def _lost(self, now: float, node: str) -> bool:
        if node in self._changed and ENDED in (self._seen.get(node) or b""):
            return False  # its writer ended its work in this step and said so (an earlier step's word does not count)
        last = self._changed.get(node)
        if last is not None:
            return now - last >= self.silence_s
        return self._first_beat is not None and now - self._first_beat >= self.never_s

    def why(self, now: float, node: str) -> str:
        last = self._changed.get(node)
        if last is None:
            return f"never beat in {now - (self._first_beat or now):.0f} s while the other nodes did"
        return f"silent for {now - last:.0f} s while the other nodes beat"


class StepSilence:
    """What the hang watcher asks each tick: the step's nodes that went silent (NodeSilence over their files)."""

    def __init__(self, directory: Path, nodes: list[str], silence: float | None = None) -> None:
        self.directory, self.nodes = directory, nodes
        # at most ~64 reads a second on the shared file system: a step of 640 nodes is read every 10 s (its
        # verdict comes that much later); "fresh" stretches with it, or nobody would look fresh between reads
        self.every = max(1.0, len(nodes) / 64)
        self.decision = NodeSilence(silence_s=silence if silence is not None else silence_s(),
                                    fresh_s=max(FRESH_S, self.every + BEAT_S + 1.0))
        self._read_at: float | None = None

    @classmethod
    def from_env(cls, run_dir: Path, job_id: str, env: Mapping[str, str] | None = None) -> StepSilence | None:
        nodes = step_nodes(env)
        return cls(beat_dir(run_dir, job_id), nodes, silence_s(env)) if len(nodes) >= 2 else None

    def check(self, now: float) -> list[str]:
        if self._read_at is None or now - self._read_at >= self.every:
            self._read_at = now
            self.decision.observe(now, read_beats(self.directory, self.nodes))
        return self.decision.silent(now, self.nodes)


class HostSilence:
    """What the keeper asks each tick: did the batch host stop beating while other nodes beat? (The hang watcher
    that judges the other nodes runs on the batch host: it cannot judge its own node.)"""

    def __init__(self, directory: Path, host: str, reference: str, silence: float | None = None) -> None:
        """`reference`: the node the host is judged against (the keeper's own, which beats while the keeper runs):
        two files read a tick, whatever the step's size."""
        self.directory, self.host, self.nodes = directory, host, [host, reference]
        self.decision = NodeSilence(silence_s=silence if silence is not None else silence_s())

    def check(self, now: float) -> str | None:
        """Why the host is lost, or None."""
        self.decision.observe(now, read_beats(self.directory, self.nodes))
        return self.decision.why(now, self.host) if self.decision.silent(now, [self.host]) else None
