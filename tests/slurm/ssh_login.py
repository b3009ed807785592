"""A private sshd on the loopback interface, playing the cluster's login node for remote-use tests.

It runs as the team user mlalice (so a locked password and PAM do not matter, and whoever logs in is
mlalice, as on a real login node), with its own config, a host key made here, a non-privileged port
and one authorized key. The "laptop" is this test process (root) with an ssh_config of its own
(MEGALAUNCH_SSH_CONFIG): the alias `login` is the right key and a known host key; `login-badkey` offers a
key the server does not know; `login-unknown` has no known host key."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
USER = "mlalice"


@dataclass(frozen=True)
class Login:
    ssh_config: Path  # the laptop's ssh_config (-F)
    log: Path  # sshd's own log (LogLevel DEBUG1)
    port: int
    pid: int


def _keygen(path: Path) -> Path:
    if path.exists():
        return path
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_files(srv: Path, port: int, user_key: Path) -> Path:
    """sshd's config, host key and authorized keys, readable by the user it runs as (and nobody else)."""
    host_key = _keygen(srv / "host_key")
    (srv / "authorized_keys").write_text(user_key.with_suffix(".pub").read_text())
    cfg = srv / "sshd_config"
    cfg.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {host_key}", f"PidFile {srv}/sshd.pid",
        "UsePAM no", "StrictModes no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes", f"AuthorizedKeysFile {srv}/authorized_keys", f"AllowUsers {USER}",
        "LogLevel DEBUG1", "MaxStartups 50", ""]))
    uid, gid = pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid
    for p in (srv, host_key, srv / "authorized_keys", cfg):
        os.chown(p, uid, gid)
    srv.chmod(0o700)
    return cfg


def _client_files(cli: Path, port: int, user_key: Path, host_pub: str) -> Path:
    bad_key = _keygen(cli / "stranger_key")
    known = cli / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_pub}\n")
    (cli / "empty_known_hosts").write_text("")
    common = f"  HostName 127.0.0.1\n  Port {port}\n  User {USER}\n  IdentitiesOnly yes\n"
    cfg = cli / "ssh_config"
    cfg.write_text(
        f"Host login\n{common}  IdentityFile {user_key}\n  UserKnownHostsFile {known}\n"
        f"Host login-badkey\n{common}  IdentityFile {bad_key}\n  UserKnownHostsFile {known}\n"
        f"Host login-unknown\n{common}  IdentityFile {user_key}\n  UserKnownHostsFile {cli}/empty_known_hosts\n"
        "  StrictHostKeyChecking yes\n")
    return cfg


def _start(cli: Path, srv: Path, user_key: Path) -> tuple[subprocess.Popen[bytes], int, Path, Path]:
    """sshd listening on a free port (another port if the one picked was taken meanwhile)."""
    log = cli / "sshd.log"
    for _ in range(3):
        port = _free_port()
        cfg = _server_files(srv, port, user_key)
        ssh_config = _client_files(cli, port, user_key, " ".join((srv / "host_key.pub").read_text().split()[:2]))
        with open(log, "wb") as out:
            proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, user=USER, group=pwd.getpwnam(USER).pw_gid,
                                    extra_groups=[], process_group=0)
        deadline = time.monotonic() + 15
        while b"Server listening" not in log.read_bytes():
            if proc.poll() is not None:
                break
            assert time.monotonic() < deadline, f"sshd did not start: {log.read_text()}"
            time.sleep(0.05)
        else:
            return proc, port, ssh_config, log
        assert "Address already in use" in log.read_text(), f"sshd exited: {log.read_text()}"
    raise AssertionError(f"sshd found no free port: {log.read_text()}")


@contextlib.contextmanager
def login_node(laptop: Path, server: Path) -> Iterator[Login]:
    """sshd up on 127.0.0.1 until the block ends; the laptop's files in `laptop` (made here, root-only),
    the server's in `server` (made here, mlalice-only: its parent must let mlalice through)."""
    laptop.mkdir(mode=0o700)
    server.mkdir()
    proc, port, ssh_config, log = _start(laptop, server, _keygen(laptop / "id_ed25519"))
    try:
        yield Login(ssh_config, log, port, proc.pid)
    finally:
        proc.terminate()  # sshd -D: its sessions' children are ended by their own hang-up
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
