"""The task supervisor (megalaunch.runtime.task) on real processes: the stop signal sent to a task's
whole process group, as Slurm sends it to every process of a job step, is seen by the workload and
kills none of its child processes (a multiprocessing Manager, the resource tracker, a spawn worker);
without the supervisor's blocking, the same signal kills them (the bug this prevents). A workload
killed with SIGKILL leaves no process behind; its exit is recorded and passed on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.task import descendants

WORKLOAD = r'''
import multiprocessing as mp, os, signal, sys, time
from megalaunch.runtime.stop.signals import SignalFlag

def child(q):
    time.sleep(float(sys.argv[2]))
    q.put("child done")

class PlainHandler:  # what a handler alone does: it protects only the process that installed it
    def __init__(self):
        self.seen = False
        signal.signal(signal.SIGUSR2, self.handle)
    def handle(self, *args):
        self.seen = True
    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while not self.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.seen

if __name__ == "__main__":
    flag = PlainHandler() if sys.argv[1] == "plain" else SignalFlag(signal.SIGUSR2)
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    q = manager.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print("ready", flush=True)
    if sys.argv[1] == "die":
        time.sleep(60)
    assert flag.wait(60), "no signal"
    print("signal seen", flush=True)
    p.join()
    print("child exit", p.exitcode, flush=True)
    print(q.get(timeout=10), flush=True)
    manager.shutdown()
'''


def _start(tmp: Path, mode: str, *, supervised: bool = True, child_s: float = 3.0) -> subprocess.Popen[str]:
    script = tmp / "workload.py"
    script.write_text(WORKLOAD)
    cmd = [sys.executable, str(script), mode, str(child_s)]
    if supervised:
        cmd = [sys.executable, "-m", "megalaunch.runtime.task", "--signal", "SIGUSR2", "--", *cmd]
    env = {**os.environ, "MEGALAUNCH_RUN_DIR": str(tmp), "MEGALAUNCH_JOB_ID": "77", "RANK": "3",
           "SLURMD_NODENAME": "nodeX"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the workload and its children are up
    assert line.strip() == "ready", line
    return proc


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(pid) == pgid:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat[stat.rfind(")") + 2] != "Z":
                    alive.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            continue
    return alive


def test_group_signal_spares_every_child_under_the_supervisor(tmp_path: Path) -> None:
    proc = _start(tmp_path, "signal")
    workload_children = descendants(proc.pid)
    assert len(workload_children) >= 4  # the workload, its resource tracker, Manager and spawn worker
    os.killpg(proc.pid, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "signal seen" in out and "child exit 0" in out and "child done" in out, out
    assert _group_alive(proc.pid) == []


def test_a_handler_alone_lets_the_group_signal_kill_the_children(tmp_path: Path) -> None:
    """The control: the workload with a plain handler instead of the blocking flag, same signal."""
    proc = _start(tmp_path, "plain", supervised=False)
    os.killpg(proc.pid, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=60)
    assert "signal seen" in out and f"child exit {-signal.SIGUSR2}" in out, out
    assert proc.returncode != 0, out  # the Manager died too: the queue is gone


def test_sigkill_leaves_no_process_and_is_recorded(tmp_path: Path) -> None:
    proc = _start(tmp_path, "die", child_s=60)
    trainer = next(p for p in descendants(proc.pid)
                   if "workload.py" in Path(f"/proc/{p}/cmdline").read_text().replace("\0", " "))
    killed_at = time.monotonic()
    os.kill(trainer, signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    took = time.monotonic() - killed_at
    assert proc.returncode == -signal.SIGKILL, out  # left the way its command left
    assert took < 10, took
    assert _group_alive(proc.pid) == []
    record = json.loads(RunPaths(tmp_path).task_record("77", 3).read_text())
    assert (record["rank"], record["node"], record["signal"], record["exit_code"]) == (3, "nodeX", "SIGKILL", None)
    assert record["pid"] == trainer and record["leftovers_killed"] >= 2
    assert "rank 3 on nodeX: command killed by SIGKILL" in out


@pytest.mark.parametrize("code", [0, 3])
def test_exit_status_passes_through(tmp_path: Path, code: int) -> None:
    proc = subprocess.run([sys.executable, "-m", "megalaunch.runtime.task", "--",
                           sys.executable, "-c", f"import sys; sys.exit({code})"], timeout=30)
    assert proc.returncode == code


def test_the_sweep_also_finds_what_left_the_tree_but_not_the_group() -> None:
    """A process re-parented to init in a race is no longer below the supervisor, but still in the
    task's process group: `descendants(..., group=)` lists it."""
    group = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                              "time.sleep(60)"], start_new_session=True)
    loner = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(group.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = descendants(group.pid)
        assert descendants(loner.pid) == []  # nothing below the loner ...
        assert sorted(descendants(loner.pid, group=group.pid)) == sorted([group.pid, grandchild])  # ... the group
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        loner.kill()
        group.wait()
        loner.wait()


def test_the_sweep_never_takes_another_task_of_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """slurmstepd puts every task of a step on a node in one process group (the first task's): rank 0's
    sweep of that group must leave rank 1 (and what rank 1 started) alone, and still find its own."""
    script = ("import os, subprocess, sys, time\n"
              "kids = [subprocess.Popen(['sleep', '60'], env={**os.environ, 'SLURM_PROCID': r}) for r in ('1', '0')]\n"
              "print(*(k.pid for k in kids), flush=True)\n"
              "time.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "SLURM_PROCID": "0"})
    try:
        assert leader.stdout is not None
        other, mine = (int(x) for x in leader.stdout.readline().split())
        outsider = os.getpid() + 10**7  # no such process: only the group is swept
        monkeypatch.setenv("SLURM_PROCID", "0")
        assert sorted(descendants(outsider, group=leader.pid)) == sorted([leader.pid, mine])
        monkeypatch.setenv("SLURM_PROCID", "1")
        assert descendants(outsider, group=leader.pid) == [other]
        monkeypatch.delenv("SLURM_PROCID")  # outside Slurm (the local backend: a group per task) the group is the task's
        assert len(descendants(outsider, group=leader.pid)) == 3
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
