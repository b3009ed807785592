"""One task of a job step: `python -m megalaunch.runtime.task --signal SIGUSR2 -- COMMAND ...`

Both backends start every rank through this small supervisor (standard library only, ~30 ms):

- **The stop signal reaches only the trainer's decision.** The supervisor blocks it before it starts
  the command; a blocked signal is inherited through fork and exec, so neither the trainer's start-up
  nor any process it starts (checkpoint writers, resource trackers, data-loader workers) can be killed
  by it. The trainer receives it with `sigwait` (runtime/stop/signals.py).
- **No orphans.** The supervisor is a child subreaper: whatever the command leaves behind when it
  ends (a Manager, a resource tracker, a spawn worker of a rank killed with SIGKILL) is re-parented
  to it and killed, so nothing outlives the task or holds the step's output open (Slurm would
  otherwise wait 60 s before abandoning that I/O). If the supervisor itself dies, the kernel kills
  the command (parent-death signal).
- **A first sign of life.** Rank 0's supervisor beats the heartbeat when the step starts (the hang
  watcher, runtime/hangwatch.py, then knows the step runs and its id).
- **The node's sign of life.** The supervisor of a node's first task beats RUN/state/node_beats/ from a
  thread while its command runs (runtime/health/node_beat.py): a node that stops beating while the
  others beat is frozen or cut off, whatever its trainer is doing.
- **Evidence.** It writes RUN/state/tasks/<job>/rank-<R>.json: the node, the pid, when the command
  started and ended, its exit status or the signal that killed it. `job end` reads these to name the
  rank and node that died first. It then leaves the way the command left (the same exit status, or
  killed by the same signal), so Slurm's "task N: Killed" lines stay true.

SIGTERM and SIGINT reach the command directly (Slurm signals every process; the local backend the
task's process group); the supervisor only outlives them to clean up."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from pathlib import Path

from megalaunch.rundir.files import atomic_write_json
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.health.heartbeat import task_start_beat
from megalaunch.runtime.health.node_beat import start_for_task
from megalaunch.runtime.health.procs import proc_stats
from megalaunch.runtime.observation.rank_output import start as rank_output_start
from megalaunch.runtime.stop.signals import block, resolve_signal

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # c10's CPU allocator: madvise(MADV_HUGEPAGE) on large blocks

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE_S = 2.0  # left-overs may finish on their own first (the resource tracker cleans up)
KILL_TIMEOUT_S = 5.0


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False  # not Linux: no subreaper, no parent-death signal; the rest still works


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def descendants(pid: int, *, group: int | None = None) -> list[int]:
    """Every live process below `pid`, and every other one in process group `group`, from one walk of
    /proc. The group catches a process that left the tree in a race (re-parented to init while its
    parent died) but not the task's process group."""
    children: dict[int, list[int]] = {}
    members: list[int] = []
    for proc, _name, fields in proc_stats():
        if len(fields) > 2 and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(proc)
            if group is not None and int(fields[2]) == group and proc != pid:
                members.append(proc)
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out + [m for m in members if m not in out and not _another_task(m)]


def _another_task(pid: int) -> bool:
    """A process of another task of this Slurm step. slurmstepd puts every task of a step on a node in
    the first task's process group, so the group also holds the other ranks on the node: rank 0's
    clean-up must never kill rank 1 while it still writes its last save. Told by SLURM_PROCID in the
    process's environment (inherited by everything a task starts)."""
    mine = os.environ.get("SLURM_PROCID")
    if mine is None:
        return False
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    theirs = next((e[len(b"SLURM_PROCID="):] for e in env if e.startswith(b"SLURM_PROCID=")), None)
    return theirs is not None and theirs != mine.encode()


def _own_group() -> int | None:
    """This process's group when it leads it (srun and the local backend start each task so); never a
    group shared with a caller's shell."""
    return os.getpid() if os.getpgid(0) == os.getpid() else None


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def kill_leftovers(grace_s: float = LEFTOVER_GRACE_S, timeout_s: float = KILL_TIMEOUT_S) -> int:
    """Give left-over descendants `grace_s` to end on their own, then SIGKILL them; returns how many
    had to be killed."""
    me, group = os.getpid(), _own_group()
    deadline = time.monotonic() + grace_s
    while (left := descendants(me, group=group)) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while (left := descendants(me, group=group)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        _reap()
        time.sleep(0.02)
    _reap()
    return len(killed)


def _wait_for(child: int) -> int:
    """Wait for `child`, reaping adopted orphans meanwhile; returns its wait status."""
    while True:
        pid, status = os.wait()
        if pid == child:
            return status


def _record(started: float, child: int, status: int, leftovers: int) -> dict[str, object]:
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    env = os.environ
    return {
        "rank": int(env.get("RANK", env.get("SLURM_PROCID", "0"))),
        "local_rank": int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))),
        "node": env.get("SLURMD_NODENAME") or socket.gethostname(), "host": socket.gethostname(),
        "pid": child, "started": started, "ended": time.time(),
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": signal.Signals(sig).name if sig else None, "leftovers_killed": leftovers,
    }


def _write_record(record: dict[str, object]) -> None:
    run_dir, job_id = os.environ.get("MEGALAUNCH_RUN_DIR"), os.environ.get("MEGALAUNCH_JOB_ID")
    if not run_dir or not job_id:
        return
    path = RunPaths(Path(run_dir)).task_record(job_id, int(str(record["rank"])))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, record)
    except OSError as e:  # evidence is best effort; the task's own exit status still tells Slurm
        print(f"[megalaunch task] could not write {path}: {e}", file=sys.stderr, flush=True)


def _first_beat() -> None:
    """Rank 0's step started: the hang watcher's first sign of life from the step (runtime/health/heartbeat.py)."""
    run_dir, job_id = os.environ.get("MEGALAUNCH_RUN_DIR"), os.environ.get("MEGALAUNCH_JOB_ID")
    if run_dir and job_id and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        task_start_beat(RunPaths(Path(run_dir)), job_id)


def _leave_like(status: int) -> int:
    """Exit the way the command did: the same signal (Slurm then reports it), or the same code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        return 128 + sig  # not reached for fatal signals
    return os.WEXITSTATUS(status)


def run(command: list[str], stop_signal: signal.Signals, rank_output: str = "all") -> int:
    block(stop_signal)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # survive them long enough to clean up (a handler, unlike SIG_IGN, is not inherited by exec)
        signal.signal(sig, lambda signum, frame: None)
    started = time.time()
    _first_beat()
    # Huge pages for torch's large host tensors (read once, at torch's first allocation): a resumed
    # segment's checkpoint load stages every tensor in fresh host memory, and faulting it in 4 KB
    # pages made llama3-1b's 17.3 GB load 16.2 s on an H100, 9.8 s with 2 MB pages
    # (bench/load_profile.py; docs/results.md). THP_MEM_ALLOC_ENABLE=0 in cluster.env turns it off.
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")) or 1)
    try:  # preexec_fn is safe: no threads yet (the output reader starts after the fork)
        child, held = rank_output_start(command, hold=rank_output == "failing" and rank not in (0, world - 1),
                                        rank=rank, preexec_fn=_die_with_parent)
    except OSError as e:
        print(f"[megalaunch task] cannot start {command[0]!r}: {e}", file=sys.stderr, flush=True)
        return 127
    # this node's sign of life for the hang watcher, apart from training progress (runtime/health/node_beat.py):
    # a thread of this supervisor, which a blocked collective or a slow step never stops
    node_beat = start_for_task()
    status = _wait_for(child.pid)
    if node_beat is not None:
        node_beat.stop()
    child.returncode = 0  # reaped by os.wait above; keep Popen from waiting again
    leftovers = kill_leftovers()
    record = _record(started, child.pid, status, leftovers)
    if held is not None:
        held.finish(f"killed by {record['signal']}" if record["signal"]
                    else f"exited with {record['exit_code']}" if record["exit_code"] else None)
    _write_record(record)
    if record["signal"] or record["exit_code"] or leftovers:
        print(f"[megalaunch task] rank {record['rank']} on {record['node']}: command "
              + (f"killed by {record['signal']}" if record["signal"] else f"exited with {record['exit_code']}")
              + (f"; killed {leftovers} left-over process(es)" if leftovers else ""), file=sys.stderr, flush=True)
    return _leave_like(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalaunch.runtime.task",
                                     description="Run one task of a megalaunch job step (see the module docstring).")
    parser.add_argument("--signal", default="SIGUSR2", help="the chain's stop signal (blocked for the command)")
    parser.add_argument("--rank-output", choices=("all", "failing"), default="all",
                        help="failing: hold the output of ranks other than the first and last until they fail "
                             "or are slow "
                             "(runtime/observation/rank_output.py)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    opts = parser.parse_args(argv)
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not command:
        parser.error("give the command after --")
    return run(command, resolve_signal(opts.signal), opts.rank_output)


if __name__ == "__main__":
    sys.exit(main())
