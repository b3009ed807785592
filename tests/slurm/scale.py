"""The many-node ``megalaunch-scale`` cluster (``sudo .ci/slurm-up scale``) and nodes that die.

Standard library and megalaunch's host lists only; import it as ``from scale import ...`` (tests/slurm is on ``sys.path``, like
cluster.py). Every node of the scale cluster is a ``slurmd -N snodeK`` on this host, so "a node" is a
set of processes: :func:`kill_node` SIGKILLs all of them at once, as a machine that loses power would
vanish (no step-complete message, no goodbye to slurmctld), and :func:`revive_node` starts the node's
slurmd again, after which it comes back per ``ReturnToService=2``.

Tests use it with ``pytest.mark.private_cluster("scale")`` (tests/slurm/conftest.py points SLURM_CONF at
:data:`SCALE_CONF` and boots the cluster when it is not up).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megalaunch.rundir.hostlist import expand_hostlist  # standard library only, like this module

SCALE_CONF = Path("/etc/slurm-scale/slurm.conf")


def conf_values(conf: Path = SCALE_CONF) -> dict[str, str]:
    """``Key=value`` lines of a slurm.conf (the last one wins, as for Slurm); NodeName lines not included."""
    values: dict[str, str] = {}
    for line in conf.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line and not line.startswith(("NodeName=", "PartitionName=")):
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def scale_nodes(conf: Path = SCALE_CONF) -> list[str]:
    """The cluster's node names, in order (from the NodeName lines of *conf*)."""
    names: list[str] = []
    for line in conf.read_text().splitlines():
        m = re.match(r"\s*NodeName=(\S+)", line)
        if m and m.group(1) != "DEFAULT":
            names += expand_hostlist(m.group(1))
    return names


def node_path(conf: Path, key: str, name: str) -> Path:
    """A per-node path of the configuration (SlurmdPidFile, SlurmdLogFile, SlurmdSpoolDir), ``%n`` = *name*."""
    return Path(conf_values(conf)[key].replace("%n", name))


def _sinfo_style(state: str) -> str:
    """scontrol's ``DOWN+NOT_RESPONDING`` as sinfo's %T writes it: ``down*``; ``IDLE+DRAIN``: ``drained``,
    ``MIXED+DRAIN``: ``draining``, ``ALLOCATED+COMPLETING``: ``completing``; other flags dropped."""
    base, *flags = state.split("+")
    base = base.lower()
    if "DRAIN" in flags and base != "down":
        base = "drained" if base == "idle" else "draining"
    elif "COMPLETING" in flags and base != "down":
        base = "completing"
    return base + ("*" if "NOT_RESPONDING" in flags else "")


def node_states(names: Iterable[str] = ()) -> dict[str, str]:
    """Node -> state (sinfo-style: ``idle``, ``allocated``, ``mixed``, ``down*``, ``drained``...) as slurmctld
    holds it, for *names* (all nodes when empty), from ``scontrol show node``. Not from sinfo's %T, which
    folds CPU counts in: it showed ``mixed*`` for a node slurmctld had set DOWN while the job it was
    removed from still counted its CPUs. Talks to the cluster SLURM_CONF names (the private_cluster
    fixture sets it)."""
    names = list(names)
    res = subprocess.run(["scontrol", "-o", "show", "node", *([",".join(names)] if names else [])],
                         capture_output=True, text=True, timeout=15, check=False)
    found = re.findall(r"NodeName=(\S+) .*?\bState=(\S+)", res.stdout)
    return {node: _sinfo_style(state) for node, state in found}


def node_state(name: str) -> str:
    """The node's state (see :func:`node_states`); "" if slurmctld does not answer or know it."""
    return node_states([name]).get(name, "")


def wait_node_state(name: str, accept: Callable[[str], bool], timeout: float, interval: float = 0.2,
                    what: str = "") -> tuple[str, float]:
    """Poll :func:`node_state` until *accept* takes it; return (state, time.time() when seen)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        last = node_state(name)
        if accept(last):
            return last, time.time()
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {name} {what or 'state'} "
                                 f"(last state {last!r})")
        time.sleep(interval)


# ---------------------------------------------------------------------------------- processes

def _stat(pid: int) -> tuple[str, int, str] | None:
    """(comm, ppid, state) of a process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    return comm, int(rest[1]), rest[0]


def _processes() -> dict[int, tuple[str, int, str]]:
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            procs[int(entry)] = st
    return procs


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _fd_targets(pid: int) -> set[str]:
    targets = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                targets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return targets


def _unix_sockets_under(directory: Path) -> set[str]:
    """``socket:[INODE]`` of the unix sockets bound under *directory* (/proc/net/unix)."""
    found = set()
    prefix = str(directory).rstrip("/") + "/"
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith(prefix):
                found.add(f"socket:[{fields[6]}]")
    return found


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[2] not in ("Z", "X")


def _descendants(roots: Iterable[int], procs: dict[int, tuple[str, int, str]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children.get(pid, [])
    return seen


@dataclass
class KilledNode:
    """What :func:`kill_node` killed."""

    name: str
    killed_at: float  #: time.time() of the SIGKILLs (all sent within a millisecond or so)
    slurmd: int | None  #: the node's slurmd (None: it was not running)
    stepds: list[int] = field(default_factory=list)  #: the slurmstepd's serving the node
    tasks: list[int] = field(default_factory=list)  #: every other process of the node's jobs (whole trees)

    @property
    def time(self) -> float:
        """The kill time, time.time() (= killed_at)."""
        return self.killed_at

    @property
    def pids(self) -> list[int]:
        return ([self.slurmd] if self.slurmd else []) + self.stepds + self.tasks


def node_processes(name: str, conf: Path = SCALE_CONF) -> tuple[int | None, set[int], set[int]]:
    """(slurmd, slurmstepd's, task processes) of node *name* right now; see :func:`kill_node`."""
    procs = _processes()
    slurmd = None
    with contextlib.suppress(OSError, ValueError):
        pid = int(node_path(conf, "SlurmdPidFile", name).read_text().split()[0])
        if pid in procs and procs[pid][0] == "slurmd" and _alive(pid):
            slurmd = pid
    log_file = str(node_path(conf, "SlurmdLogFile", name))
    step_sockets = _unix_sockets_under(node_path(conf, "SlurmdSpoolDir", name))
    stepds = {pid for pid, (comm, _, state) in procs.items()
              if comm == "slurmstepd" and state != "Z" and (
                  (targets := _fd_targets(pid)) and (log_file in targets or targets & step_sockets))}
    needle = f"SLURMD_NODENAME={name}".encode()
    me = {os.getpid(), *_ancestors(os.getpid(), procs)}
    task_roots = {pid for pid, (comm, _, state) in procs.items()
                  if state != "Z" and pid not in me and comm != "slurmstepd" and _environ_has(pid, needle)}
    # A task's slurmstepd is its ancestor (slurmstepd forks the task; nothing reparents it).
    for pid in task_roots:
        stepds |= {a for a in _ancestors(pid, procs) if procs[a][0] == "slurmstepd"}
    tasks = (_descendants(stepds | task_roots, procs) - stepds - me) - {slurmd}
    return slurmd, stepds, {p for p in tasks if procs[p][2] != "Z"}


def _ancestors(pid: int, procs: dict[int, tuple[str, int, str]]) -> list[int]:
    out = []
    while pid in procs and (ppid := procs[pid][1]) > 1:
        out.append(ppid)
        pid = ppid
    return out


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def kill_node(name: str, conf: Path = SCALE_CONF) -> KilledNode:
    """Make node *name* die as a machine that loses power: SIGKILL, at once, its slurmd, every slurmstepd
    serving it and every process of its jobs' tasks (whole process trees). Nothing of the node gets to
    tell slurmctld or srun anything; the controller finds out through its pings (SlurmdTimeout).

    Which slurmstepd serves which node: all nodes' slurmstepd's run on this host, reparented to PID 1
    (slurmd double-forks them), and their command line names only the step (``slurmstepd: [JOB.STEP]``).
    A slurmstepd is the node's when (any of, checked with a real 4-node job: each of the job's four
    ``[JOB.0]`` slurmstepd's matched exactly its own node by each rule)
      - it holds the node's SlurmdLogFile open (``slurmd-%n.log``: slurmstepd logs where its slurmd does),
      - it listens on a unix socket in the node's SlurmdSpoolDir (``spool/%n/%n_JOB.STEP``, the socket
        slurmd and ``scontrol listpids`` reach the step through; /proc/net/unix names its inode),
      - it is an ancestor of a task whose environment has ``SLURMD_NODENAME=name``.
    The tasks are the processes with ``SLURMD_NODENAME=name`` and all descendants of the node's
    slurmstepd's. Everything is SIGSTOPped first, then, once nothing new was forked, SIGKILLed: no
    slurmstepd sees its tasks die and reports it, none of the tasks outlives the others.
    """
    slurmd, stepds, tasks, frozen = _freeze(name, conf)
    killed_at = time.time()
    _signal_all(frozen, signal.SIGKILL)
    _signal_all(frozen, signal.SIGCONT)  # a stopped process dies at once anyway; harmless
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in frozen) and time.monotonic() < deadline:
        time.sleep(0.02)
    still = [p for p in frozen if _alive(p)]
    assert not still, f"kill_node({name}): still alive after SIGKILL: {still}"
    return KilledNode(name, killed_at, slurmd, sorted(stepds), sorted(tasks - stepds - {slurmd}))


def _freeze(name: str, conf: Path) -> tuple[int | None, set[int], set[int], set[int]]:
    """SIGSTOP every process of node *name* (see :func:`kill_node`); (slurmd, stepds, tasks, all stopped)."""
    slurmd, stepds, tasks = node_processes(name, conf)
    frozen: set[int] = set()
    for _ in range(5):  # freeze; a process forked meanwhile shows up in the next pass
        batch = ({slurmd} if slurmd else set()) | stepds | tasks
        _signal_all(batch - frozen, signal.SIGSTOP)
        frozen |= batch
        _, more_stepds, more_tasks = node_processes(name, conf)
        if more_stepds <= stepds and more_tasks <= tasks:
            break
        stepds |= more_stepds
        tasks |= more_tasks
    return slurmd, stepds, tasks, frozen


def freeze_node(name: str, conf: Path = SCALE_CONF) -> KilledNode:
    """Make node *name* freeze as a machine that loses power or its network: every process of it (slurmd, its
    slurmstepd's, its tasks) SIGSTOPped and left so. Unlike :func:`kill_node`, nothing closes: the node's
    sockets stay open, its peers' collectives block, slurmctld's pings go unanswered (no connection refused).
    :func:`thaw_node` ends it (SIGCONT)."""
    slurmd, stepds, tasks, _ = _freeze(name, conf)
    frozen_at = time.time()
    assert slurmd is not None, f"freeze_node({name}): its slurmd does not run"
    return KilledNode(name, frozen_at, slurmd, sorted(stepds), sorted(tasks - stepds - {slurmd}))


def thaw_node(node: KilledNode) -> None:
    """SIGCONT what :func:`freeze_node` stopped: the node answers slurmctld again; its old tasks find their
    peers gone and end."""
    _signal_all(node.pids, signal.SIGCONT)


@contextlib.contextmanager
def slurm_default_timeouts(conf: Path = SCALE_CONF) -> Iterator[None]:
    """Run the block with Slurm's default node timeouts (SlurmdTimeout=300, MessageTimeout=10), which most
    sites run, instead of the scale cluster's short ones (.ci/slurm-up render_timeouts); restored after
    (`scontrol reconfigure`). The scale cluster serves one test at a time (tests/slurm/conftest.py)."""
    original = conf.read_text()
    lines = [line for line in original.splitlines() if not line.startswith(("SlurmdTimeout=", "MessageTimeout="))]
    try:
        conf.write_text("\n".join([*lines, "SlurmdTimeout=300", "MessageTimeout=10"]) + "\n")
        subprocess.run(["scontrol", "reconfigure"], check=True, timeout=60, capture_output=True)
        yield
    finally:
        conf.write_text(original)
        subprocess.run(["scontrol", "reconfigure"], check=False, timeout=60, capture_output=True)


def settle(timeout: float = 240) -> list[str]:
    """Wait until every node of the cluster is idle with no job, resuming the nodes Slurm drains "Kill task
    failed" meanwhile (after a batch host's death slurmstepd gives up on a surviving node's task once
    UnkillableStepTimeout has passed: docs/scale.md), so that the next test finds the cluster as it expects.
    Returns the nodes resumed."""
    resumed: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        states = node_states()
        drained = [n for n, st in states.items() if st.startswith("drain")]
        if drained:
            subprocess.run(["scontrol", "update", f"nodename={','.join(drained)}", "state=resume"],
                           capture_output=True, timeout=15, check=False)
            resumed += drained
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=15).stdout
        if not queue.strip() and states and all(st == "idle" for st in states.values()):
            return resumed
        if time.monotonic() >= deadline:
            raise AssertionError(f"the cluster did not settle in {timeout:g} s: "
                                 f"{ {n: st for n, st in states.items() if st != 'idle'} }, queue {queue.split()}")
        time.sleep(1)


def slurm_timeouts() -> dict[str, str]:
    """SlurmdTimeout and MessageTimeout as slurmctld runs them now (`scontrol show config`)."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=15).stdout
    return dict(re.findall(r"^(SlurmdTimeout|MessageTimeout)\s*=\s*(\S+)", out, re.M))


def revive_node(name: str, conf: Path = SCALE_CONF, timeout: float = 15) -> int:
    """Start node *name*'s slurmd again (the command line .ci/slurm-up uses); return its pid once it runs.
    The node registers and comes back per ReturnToService=2 (DOWN -> idle); wait for that with
    :func:`wait_node_state`."""
    pidfile = node_path(conf, "SlurmdPidFile", name)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()  # the dead slurmd's
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "SLURM_JOB", "SLURM_STEP"))}
    env["SLURM_CONF"] = str(conf)
    subprocess.run(["slurmd", "-f", str(conf), "-N", name], check=True, capture_output=True, timeout=timeout,
                   env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, IndexError):  # an empty pid file: not written yet
            pid = int(pidfile.read_text().split()[0])
            st = _stat(pid)
            if st is not None and st[0] == "slurmd" and _alive(pid):
                return pid
        time.sleep(0.05)
    raise AssertionError(f"slurmd -N {name} did not start within {timeout:g} s")
