"""The laptop's half: run one command on the login node and pass its output and exit status through.

Until the login node's half has said hello, ssh's and the remote shell's stderr is held back: a wrong
host, a refused key or a missing megalaunch become one line (ssh.py's table, `explain_start`). After
the hello, stdout and stderr go through as they come."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import IO

from megalaunch.errors import RemoteError
from megalaunch.remote.ship import Request
from megalaunch.remote.ssh import (
    SERVER_SIDE,
    SshTarget,
    command_argv,
    control_dir,
    ensure_master,
    explain_ssh,
)
from megalaunch.remote.wire import MAX_LINE, decode_hello, encode_env, encode_request

GREETING_LINES = 200  # lines a login shell may print before the hello (a motd in .bashrc)


class StderrRelay:
    """Copies the command's stderr to ours, holding it back until `release` (or keeping it, for the
    one-line error of a start that failed)."""

    def __init__(self, source: IO[bytes], sink: IO[bytes]) -> None:
        self.source, self.sink = source, sink
        self.held = bytearray()
        self.released = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        while chunk := os.read(self.source.fileno(), 65536):
            with self.lock:
                if self.released:
                    self._write(chunk)
                else:
                    self.held += chunk

    def _write(self, data: bytes) -> None:
        try:
            self.sink.write(data)
            self.sink.flush()
        except (BrokenPipeError, ValueError):
            pass

    def add(self, data: bytes) -> None:
        with self.lock:
            self.held += data

    def release(self) -> None:
        with self.lock:
            self.released = True
            self._write(bytes(self.held))
            self.held.clear()

    def text(self) -> str:
        self.thread.join(timeout=5)
        return self.held.decode(errors="replace")


def explain_start(target: SshTarget, rc: int, stderr: str) -> RemoteError:
    """Why the login node's half never said hello."""
    cmd = target.megalaunch
    if rc == 255:
        return explain_ssh(target.host, rc, stderr)
    if rc in (126, 127) or "command not found" in stderr or "No such file or directory" in stderr:
        return RemoteError(f"megalaunch is not found on {target.host} (the command `{cmd}`)",
                           fix="install it there (pip install megalaunch) or name it: cluster.ssh.megalaunch "
                               "or MEGALAUNCH_REMOTE_COMMAND=/path/to/venv/bin/megalaunch")
    if SERVER_SIDE in stderr or "No such command" in stderr:
        return RemoteError(f"megalaunch on {target.host} (`{cmd}`) is too old for remote use (no `{SERVER_SIDE}`)",
                           fix="upgrade it there to this version")
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "no message")
    return RemoteError(f"megalaunch on {target.host} did not start (exit {rc}): {last}",
                       fix=f"run it there by hand: ssh {target.host} {cmd} --version")


def _hello(proc: subprocess.Popen[bytes], relay: StderrRelay) -> list[str] | None:
    """The names the login node asks for, or None when its half never said hello."""
    assert proc.stdout is not None
    for _ in range(GREETING_LINES):
        line = proc.stdout.readline(MAX_LINE)
        if not line:
            return None
        needs = decode_hello(line)
        if needs is not None:
            return needs
        relay.add(line)  # a login shell's greeting on stdout: shown on stderr, never mixed into the output
    return None


def _copy(source: IO[bytes], out: IO[bytes]) -> bool:
    """The command's stdout to ours as it comes; False when ours is closed."""
    try:
        while chunk := source.read1(65536):  # type: ignore[attr-defined]  # a BufferedReader
            out.write(chunk)
            out.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError):  # no second BrokenPipeError when Python flushes at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return False
    return True


def run_remote(target: SshTarget, request: Request, *, out: IO[bytes] | None = None,
               err: IO[bytes] | None = None, environ: Callable[[str], str | None] = os.environ.get) -> int:
    """Run `request` on `target.host`; its exit status. Ctrl-C ends the remote command too."""
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    sockets = control_dir()
    ensure_master(target, sockets)
    proc = subprocess.Popen(command_argv(target, sockets, [SERVER_SIDE]), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    relay = StderrRelay(proc.stderr, err)
    try:
        try:
            proc.stdin.write(encode_request(replace(request, via=target.host)))
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # the hello will not come either: explained below
        needs = _hello(proc, relay)
        if needs is None:
            raise explain_start(target, proc.wait(), relay.text())
        values = {n: v for n in needs if (v := environ(n)) is not None}
        proc.stdin.write(encode_env(values))  # stdin, never a command line: no process list shows it
        proc.stdin.flush()
        relay.release()
        if not _copy(proc.stdout, out):  # our reader went away (`| head`): stop the remote command too
            proc.terminate()
            proc.wait(timeout=10)
            return 141
        rc = proc.wait()
        relay.thread.join(timeout=5)
        return rc
    except KeyboardInterrupt:
        proc.terminate()  # the channel closes; the login node's half sees end of file and stops the command
        proc.wait(timeout=10)
        return 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
