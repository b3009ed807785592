"""Remote use over SSH against a real sshd on the loopback interface (ssh_login.py) with the real
Slurm cluster behind it: the laptop (root, this process) drives a chain that runs as mlalice, the
login node's user. submit, status, logs -f (and Ctrl-C), trigger save, cancel and resume go over ssh; the
recipe travels (the login node cannot read the laptop's copy); the secret reaches the submit through
stdin, never a command line; a wrong host, a refused key, an unknown host key and a missing megalaunch
are one line each."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import queue_ids, wait_for
from launch import MEGALAUNCH, REPO, counter_recipe, run_dir_of
from ssh_login import SSHD, USER, Login, login_node

from megalaunch.remote.ssh import SshTarget, close_master

pytestmark = pytest.mark.skipif(not Path(SSHD).exists() and os.environ.get("MEGALAUNCH_REQUIRE_SLURM") != "1",
                                reason="no sshd here: apt-get install openssh-server (scripts/test does, as root)")


@pytest.fixture
def login(tmp_path: Path, slurm_tmp: Path) -> Iterator[Login]:
    with login_node(tmp_path / "ssh", slurm_tmp / "sshd") as node:
        yield node


@pytest.fixture
def sockets() -> Iterator[Path]:
    """A short private directory for the control sockets (a socket's path has at most 104 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="mlssh-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _laptop_env(tmp_path: Path, login: Login, slurm_tmp: Path, sockets: Path, **extra: str) -> dict[str, str]:
    """The laptop's environment: an `ssh` that records its argv, the test's ssh_config, a private
    control directory, and the command that runs this checkout's megalaunch on the login node."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {tmp_path}/ssh-argv.log\n"
                                     "exec /usr/bin/ssh \"$@\"\n")
        (bin_dir / "ssh").chmod(0o755)
    remote = f"env PYTHONPATH={REPO / 'src'} XDG_STATE_HOME={slurm_tmp}/.state-mlalice {MEGALAUNCH}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGALAUNCH_", "SLURM_"))}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "PYTHONPATH": str(REPO / "src"),
            "MEGALAUNCH_SSH_CONFIG": str(login.ssh_config), "MEGALAUNCH_SSH_CONTROL_DIR": str(sockets),
            "MEGALAUNCH_REMOTE_COMMAND": remote, **extra}


def _ml(env: dict[str, str], *args: str, cwd: Path, host: str = "login") -> subprocess.CompletedProcess[str]:
    return subprocess.run([MEGALAUNCH, "--host", host, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def _cmdlines() -> Iterator[tuple[int, bytes]]:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            found = d.stat().st_uid, (d / "cmdline").read_bytes()
        except OSError:  # the process ended meanwhile
            continue
        yield found


class CmdlineWatch:
    """Samples every process's command line while it runs: which held `needle`."""

    def __init__(self, needle: bytes) -> None:
        self.needle, self.hits, self.samples, self.saw_remote_side = needle, list[bytes](), 0, False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            lines = [c for _, c in _cmdlines()]
            self.hits += [c for c in lines if self.needle in c]
            self.saw_remote_side |= any(b"remote-side" in c for c in lines)  # it watched the login node's half too
            self.samples += 1

    def __enter__(self) -> CmdlineWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _remote_sides() -> list[bytes]:
    uid = pwd.getpwnam("mlalice").pw_uid
    return [c for u, c in _cmdlines() if u == uid and b"remote-side" in c]


def _follow_and_interrupt(env: dict[str, str], run: Path, cwd: Path) -> None:
    """`logs -f` over ssh shows the counter's lines; Ctrl-C ends it here and its half on the login node."""
    proc = subprocess.Popen([MEGALAUNCH, "--host", "login", "logs", "-f", str(run)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    seen = b""
    while b"[counter rank 0]" not in seen:
        line = proc.stdout.readline()
        assert line, f"logs -f ended early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
        seen += line
    assert _remote_sides(), "the login node's half should be running while logs -f follows"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130  # the client waits up to 10 s for ssh to end; 2 loaded cores (CI)
    wait_for(lambda: not _remote_sides(), 15, interval=0.2, what="the login node's logs -f to end")


def test_submit_watch_trigger_cancel_over_ssh(tmp_path: Path, slurm_tmp: Path, login: Login, sockets: Path) -> None:
    secret = f"s3cret-{secrets.token_hex(8)}"
    made = counter_recipe(slurm_tmp, "viassh", user=USER, training={"train_iters": 1000000},
                          cluster={"time": "00:05:00", "secret_env": ["MEGALAUNCH_TEST_SECRET"]})
    laptop = tmp_path / "laptop-recipes"  # root-only: the login node's user cannot read it; it must travel
    laptop.mkdir(mode=0o700)
    recipe = laptop / made.name
    made.rename(recipe)
    env = _laptop_env(tmp_path, login, slurm_tmp, sockets, MEGALAUNCH_TEST_SECRET=secret)
    target = SshTarget("login", config=str(login.ssh_config))
    try:
        with CmdlineWatch(secret.encode()) as watch:
            sub = _ml(env, "submit", str(recipe), cwd=laptop)
        assert sub.returncode == 0, sub.stderr
        assert "submitted job" in sub.stdout and sub.stderr == ""
        assert "  megalaunch --host login logs " in sub.stdout  # the hints work where the user typed submit
        assert watch.saw_remote_side and watch.hits == [], "the secret was in a command line"
        run = run_dir_of(slurm_tmp)
        assert run.stat().st_uid == pwd.getpwnam("mlalice").pw_uid  # submitted on the login node, as its user

        st = wait_for(lambda: (s := json.loads(_ml(env, "status", str(run), "--json", cwd=laptop).stdout))
                      ["chain_state"] == "running" and s, 60, what="the chain to run")
        assert st["segments"][0]["state"] == "RUNNING"
        _follow_and_interrupt(env, run, laptop)

        saved = _ml(env, "trigger", "save", str(run), "--reason", "from the laptop", cwd=laptop)
        assert saved.returncode == 0 and "trigger 'save' written" in saved.stdout, saved.stderr
        consumed = wait_for(lambda: list((run / "triggers" / "consumed").glob("*-save-*.json")), 60,
                            what="the save trigger to be consumed")
        assert json.loads(consumed[0].read_text())["reason"] == "from the laptop"

        cancel = _ml(env, "cancel", str(run), cwd=laptop)
        assert cancel.returncode == 0 and cancel.stdout.startswith("cancelled "), cancel.stderr
        assert queue_ids(name=run.name) == []
        with CmdlineWatch(secret.encode()) as watch:  # resume asks for the run's secret names too (run.yaml)
            resumed = _ml(env, "resume", str(run), cwd=laptop)
        assert resumed.returncode == 0 and "submitted job" in resumed.stdout, resumed.stderr
        assert watch.hits == []
        assert _ml(env, "cancel", str(run), cwd=laptop).returncode == 0 and queue_ids(name=run.name) == []
    finally:
        close_master(target, sockets)
    argv_log = (tmp_path / "ssh-argv.log").read_text()
    assert "BatchMode=yes" in argv_log and "remote-side" in argv_log and secret not in argv_log
    log = login.log.read_text(errors="replace")
    assert log.count("Starting session: command for mlalice") >= 5 and secret not in log


@pytest.mark.parametrize(("host", "extra", "says"), [
    ("nosuch.invalid", {}, "cannot reach nosuch.invalid: the name does not resolve"),
    ("login-badkey", {}, "login-badkey refused your SSH key"),
    ("login-unknown", {}, "login-unknown's host key is unknown here or has changed"),
    ("login", {"MEGALAUNCH_REMOTE_COMMAND": "/nowhere/bin/megalaunch"}, "megalaunch is not found on login"),
])
def test_what_goes_wrong_is_one_line(tmp_path: Path, slurm_tmp: Path, login: Login, sockets: Path, host: str,
                                     extra: dict[str, str], says: str) -> None:
    env = _laptop_env(tmp_path, login, slurm_tmp, sockets, **extra)
    try:
        proc = _ml(env, "status", cwd=tmp_path, host=host)
    finally:
        close_master(SshTarget(host, config=str(login.ssh_config)), sockets)
    assert proc.returncode == 255 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megalaunch: error: {says}"), proc.stderr
