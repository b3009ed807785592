"""Every `ssh` command line megalaunch runs, and what its failures mean.

OpenSSH's client as the user runs it (their keys, agent and ~/.ssh/config), with `BatchMode=yes` so
that nothing ever prompts (a prompt would hang a command that reads its stdin from us). One
connection per login node is reused: a control master (`ControlMaster`/`ControlPersist`) whose socket
sits in a private directory of the user's (0700, checked), so another user of the laptop cannot ride
on it. The master is started on its own, with its stderr in a file: a master forked by a command
whose stderr is a pipe would hold that pipe open for minutes."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megalaunch.errors import RemoteError

PERSIST_S = 600  # the master outlives the last command by ten minutes
CONNECT_TIMEOUT_S = 15
START_TIMEOUT_S = 60
SERVER_SIDE = "remote-side"  # the login node's half: `megalaunch remote-side` (server.py)
SOCKET_PATH_MAX = 104  # sun_path is 104 bytes on macOS, 108 on Linux
SOCKET_NAME = 1 + 40 + 17  # "/" + %C (a SHA-1 in hex) + the ".XXXXXXXXXXXXXXXX" ssh adds while binding
FIX_TRY = "try it by hand: ssh -o BatchMode=yes {host} true"


@dataclass(frozen=True)
class SshTarget:
    """A login node and the command that runs megalaunch there."""

    host: str
    megalaunch: str = "megalaunch"
    config: str | None = None  # another ssh_config file (ssh -F), MEGALAUNCH_SSH_CONFIG

    def __post_init__(self) -> None:
        check_host(self.host)
        if not shlex.split(self.megalaunch):
            raise RemoteError("the remote megalaunch command is empty", field="cluster.ssh.megalaunch",
                              fix="name it, e.g. megalaunch or /path/to/venv/bin/megalaunch")


def check_host(host: str) -> str:
    """A destination `ssh` takes, and nothing it would read as an option."""
    if not host or host.startswith("-") or any(c.isspace() or ord(c) < 32 for c in host):
        raise RemoteError(f"{host!r} is not an SSH destination", field="--host",
                          valid="user@login, an ~/.ssh/config alias or ssh://user@host:port")
    return host


def control_dir() -> Path:
    """The private directory of the control sockets: MEGALAUNCH_SSH_CONTROL_DIR, else
    $XDG_RUNTIME_DIR/megalaunch-ssh, else /tmp/megalaunch-ssh-UID. Refused unless it is a real
    directory of ours that nobody else can enter."""
    env = os.environ.get("MEGALAUNCH_SSH_CONTROL_DIR")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(env) if env else (Path(runtime) / "megalaunch-ssh" if runtime and os.path.isdir(runtime)
                                  else Path("/tmp") / f"megalaunch-ssh-{os.getuid()}")  # short: macOS's $TMPDIR is not
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as e:
        raise RemoteError(f"cannot make the SSH control directory {path}: {e.strerror}",
                          fix="set MEGALAUNCH_SSH_CONTROL_DIR to a directory of yours") from None
    if len(str(path)) + SOCKET_NAME > SOCKET_PATH_MAX:
        raise RemoteError(f"the SSH control directory {path} is too long a path for a socket (at most "
                          f"{SOCKET_PATH_MAX - SOCKET_NAME} characters)",
                          fix="set MEGALAUNCH_SSH_CONTROL_DIR to a shorter path, e.g. ~/.ssh/megalaunch")
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RemoteError(f"the SSH control directory {path} is not a private directory of yours (mode "
                          f"{stat.S_IMODE(st.st_mode):o}, owner {st.st_uid})",
                          fix=f"chmod 700 {path} if it is yours, or set MEGALAUNCH_SSH_CONTROL_DIR")
    return path


def ssh_binary() -> str:
    found = shutil.which("ssh")
    if found is None:
        raise RemoteError("OpenSSH's client `ssh` is not installed here",
                          fix="install it (apt-get install openssh-client; macOS has it)")
    return found


def base_argv(target: SshTarget, sockets: Path) -> list[str]:
    """`ssh` and the options every call shares: no prompt, the shared control socket."""
    return [ssh_binary(), *(["-F", target.config] if target.config else []),
            "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4",
            "-o", f"ControlPath={sockets}/%C"]


def master_argv(target: SshTarget, sockets: Path) -> list[str]:
    return [*base_argv(target, sockets), "-o", "ControlMaster=yes", "-o", f"ControlPersist={PERSIST_S}",
            "-f", "-N", "-T", "--", target.host]


def control_argv(target: SshTarget, sockets: Path, op: str) -> list[str]:
    """`ssh -O check|exit`: asks the master, never the network."""
    return [*base_argv(target, sockets), "-O", op, "--", target.host]


def remote_command(target: SshTarget, words: list[str]) -> str:
    """The one string the login node's shell runs: every word quoted, so nothing in it is shell syntax."""
    return "exec " + " ".join(shlex.quote(w) for w in [*shlex.split(target.megalaunch), *words])


def command_argv(target: SshTarget, sockets: Path, words: list[str]) -> list[str]:
    """A command over the master (ControlMaster=no: never a master itself; without one, a direct connection)."""
    return [*base_argv(target, sockets), "-o", "ControlMaster=no", "-T", "--", target.host,
            remote_command(target, words)]


def ensure_master(target: SshTarget, sockets: Path) -> None:
    """The control master to `target.host` is up: found, or started now. Its failure is one line."""
    check = subprocess.run(control_argv(target, sockets, "check"), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if check.returncode == 0:
        return
    with tempfile.TemporaryFile() as err:
        try:
            rc = subprocess.run(master_argv(target, sockets), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, timeout=START_TIMEOUT_S, check=False).returncode
        except subprocess.TimeoutExpired:
            raise RemoteError(f"no answer from {target.host} within {START_TIMEOUT_S} s",
                              fix=FIX_TRY.format(host=target.host)) from None
        err.seek(0)
        text = err.read().decode(errors="replace")
    if rc != 0:
        raise explain_ssh(target.host, rc, text)


def close_master(target: SshTarget, sockets: Path | None = None) -> None:
    """Ends the control master (tests, `ssh -O exit`); nothing when there is none."""
    subprocess.run(control_argv(target, sockets or control_dir(), "exit"), stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


# What OpenSSH says (its stderr) -> what happened and how to fix it. First match wins.
_SSH_FAILURES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("Could not resolve hostname", "Name or service not known"),
     "cannot reach {host}: the name does not resolve", "check the name or its Host entry in ~/.ssh/config"),
    (("Host key verification failed", "REMOTE HOST IDENTIFICATION HAS CHANGED", "host key for"),
     "{host}'s host key is unknown here or has changed; megalaunch never accepts one for you",
     "connect once with `ssh {host}` and check the fingerprint it shows"),
    (("Permission denied", "Too many authentication failures", "no matching host key type"),
     "{host} refused your SSH key (Permission denied; BatchMode: no password prompt)",
     "ssh-copy-id {host}, or name the key (IdentityFile) in ~/.ssh/config; " + FIX_TRY),
    (("Connection refused",), "{host} refused the connection (no SSH server on that port)", FIX_TRY),
    (("timed out", "No route to host", "Network is unreachable"), "no answer from {host}", FIX_TRY),
)


def explain_ssh(host: str, rc: int, stderr: str) -> RemoteError:
    """One line for a failed `ssh`: what OpenSSH said, named, with the fix."""
    for needles, what, fix in _SSH_FAILURES:
        if any(n in stderr for n in needles):
            return RemoteError(what.format(host=host), fix=fix.format(host=host))
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "no message")
    return RemoteError(f"ssh to {host} failed (exit {rc}): {last}", fix=FIX_TRY.format(host=host))
