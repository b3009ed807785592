"""`python ARGS...` run by the tests' fork server (tests/support/forkserver.py) instead of a new interpreter.

    python -I -S forkshim.py SOCKET REAL_PYTHON ARGS...     (the server writes a `python` script that does this)

The standard library only, ~20 ms. It sends ARGS, its environment, working directory and standard
input/output/error to the server, which forks the child from its pre-imported state and answers with the
child's pid; it then plays the child for whoever started it:
- every catchable signal it gets goes to the child's process group (the local backend signals a task's
  group, as Slurm signals every process of a step); SIGKILL cannot be caught, and kills the child's group
  when the server sees this end of the socket close;
- it leaves the way the child left: the same exit status, or killed by the same signal.
Without a server (the socket gone), it exec's REAL_PYTHON with ARGS."""

import contextlib
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGCONT, signal.SIGWINCH)


def main() -> int:
    path, real, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError:
        os.execv(real, [real, *args])
    child: int | None = None
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if child is None:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    child = json.loads(sock.recv(1 << 16))["pid"]
    for signum in pending:
        forward(signum, None)
    reply = sock.recv(1 << 16)
    if not reply:
        print("[forkshim] the fork server went away", file=sys.stderr)
        return 1
    status = json.loads(reply)["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL and sig != signal.SIGSTOP:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
