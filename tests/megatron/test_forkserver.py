"""The tests' fork server (tests/support/forkserver.py) keeps the promises the tests rely on: a child forked
through the shim leaves as the same program would (exit code, or killed by the same signal), gets every
catchable signal sent to the shim's process group in its own group, dies with its whole group when the
shim is killed with SIGKILL, and sees its own environment, directory and standard streams; a harness rank
forked from the server is a trainer whose task record and outcome are the fresh process's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from harness import Trainer, make_run, wait_for
from tests.support import forkserver

pytestmark = [pytest.mark.megatron,
              pytest.mark.skipif(not forkserver.enabled(), reason="the fork server is off here")]

# a child that reports its pid and session, then waits for signals, each written to a file as it comes
LISTENER = """
import os, signal, sys, time
out = sys.argv[1]
def note(signum, frame):
    with open(out, "a") as f:
        f.write(f"{signal.Signals(signum).name}\\n")
    if signum == signal.SIGTERM:
        sys.exit(7)
for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, note)
with open(out, "a") as f:
    f.write(f"pid {os.getpid()} sid {os.getsid(0)} cwd {os.getcwd()} env {os.environ.get('FORK_PROBE')}\\n")
while True:
    time.sleep(0.05)
"""


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_the_shim_exits_like_the_child_and_passes_env_cwd_and_streams(tmp_path: Path) -> None:
    py = forkserver.python()
    p = subprocess.run([py, "-c", "import os, sys; print(os.environ['FORK_PROBE'], os.getcwd()); sys.exit(5)"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "FORK_PROBE": "x1"},
                       timeout=60)
    assert p.returncode == 5 and p.stdout.split() == ["x1", str(tmp_path)], (p.returncode, p.stdout, p.stderr)
    p = subprocess.run([py, "-m", "json.tool"], input='{"b": [1]}', capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout) == {"b": [1]}, p.stderr


def test_signals_reach_the_childs_group_and_sigkill_of_the_shim_kills_it(tmp_path: Path) -> None:
    out = tmp_path / "got"
    (tmp_path / "listener.py").write_text(LISTENER)  # `-m listener` from its directory: forked, not exec'd
    shim = subprocess.Popen([forkserver.python(), "-m", "listener", str(out)], cwd=tmp_path,
                            env={**os.environ, "FORK_PROBE": "y2"}, start_new_session=True)
    first = wait_for(lambda: _lines(out)[:1], 60, what="the child's first line")[0].split()
    child = int(first[1])
    assert child != shim.pid and first[3] == str(child) and first[5:] == [str(tmp_path), "env", "y2"], first
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        os.killpg(shim.pid, sig)
        wait_for(lambda sig=sig: sig.name in _lines(out), 30, what=f"{sig.name} at the child")
    os.killpg(shim.pid, signal.SIGTERM)  # the child exits 7 on it; the shim leaves the same way
    assert shim.wait(30) == 7
    shim = subprocess.Popen([forkserver.python(), "-m", "listener", str(out)], cwd=tmp_path,
                            start_new_session=True)
    child = int(wait_for(lambda: [x for x in _lines(out) if x.startswith("pid ")][1:], 60,
                         what="the second child")[0].split()[1])
    os.killpg(shim.pid, signal.SIGKILL)
    assert shim.wait(30) == -signal.SIGKILL
    wait_for(lambda: not Path(f"/proc/{child}").exists(), 30, what="the child to die with the shim")


def test_a_forked_rank_writes_the_records_a_fresh_one_does(tmp_path: Path) -> None:
    paths = make_run(tmp_path, "training.train_iters=2", "training.lr_warmup_iters=1")
    t = Trainer(paths, world=1, job_id="7")
    assert isinstance(t.procs[0], forkserver.Rank)
    assert t.wait(240) == [0], t.log()[-3000:]
    assert t.outcome()["status"] == "finished"
    record = json.loads(paths.task_record("7", 0).read_text())
    assert record["exit_code"] == 0 and record["signal"] is None and record["pid"] != t.procs[0].pid, record


LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def test_a_reused_pid_is_not_taken_for_an_ended_child(tmp_path: Path) -> None:
    """pids wrap (pid_max 32768 on the CI machine): a child given the pid of one that ended earlier is
    still running, not ended with the earlier one's status (CI run 15 failed that way: a resumed segment's
    rank 'exited' before it had opened its log)."""
    if not os.access(LAST_PID, os.W_OK):
        pytest.skip("choosing the next pid needs root (writing /proc/sys/kernel/ns_last_pid)")
    server = forkserver.Server.get()
    env = dict(os.environ)
    for attempt in range(10):  # another process on the machine may take the pid first: try again
        ended = server.start(["-c", "pass"], env=env, log=tmp_path / f"ended{attempt}.log")
        assert ended.wait(60) == 0
        LAST_PID.write_text(str(ended.pid - 1))
        alive = server.start(["-c", "import signal; signal.pause()"], env=env, log=tmp_path / f"alive{attempt}.log")
        try:
            if alive.pid == ended.pid:
                assert alive.poll() is None, "the new child was taken for the ended one with its pid"
                break
        finally:
            os.kill(alive.pid, signal.SIGKILL)  # the process itself: it may not have its own session yet
            assert alive.wait(60) == -signal.SIGKILL
    else:
        pytest.skip("the pid was taken by another process ten times")


def test_a_connection_dropped_earlier_in_the_round_is_skipped() -> None:
    """poll() named a shim's connection readable, then reap() dropped it (its child ended) before its turn: the
    server must skip it, not read it (CI run 31: `recvmsg` on the closed socket, EBADF, the server gone)."""
    import io
    import socket

    listener, _ = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    shim_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    loop = forkserver._Loop(io.StringIO(), listener)
    loop.conns[server_end.fileno()] = server_end
    shim_end.close()  # readable now: its end closed
    loop.drop(server_end)
    loop.from_shim(server_end)  # raised OSError (EBADF) before
    assert loop.conns == {} and loop.child_of == {}

