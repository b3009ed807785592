"""Whether a command runs here or on a login node, and which one.

The host, first found wins: `--host DEST` (anywhere on the line; `--host local`: here, whatever else
says), MEGALAUNCH_HOST, and for `submit` the recipe's `cluster.ssh.host` (a cluster profile's, a
`--set`'s). The command that runs megalaunch there: MEGALAUNCH_REMOTE_COMMAND, else the recipe's
`cluster.ssh.megalaunch`, else `megalaunch`. Another ssh_config file: MEGALAUNCH_SSH_CONFIG. A host
that is this machine's own name runs here (a profile with `ssh.host` used on the login node itself)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from megalaunch.errors import ConfigError, MegalaunchError
from megalaunch.remote.ssh import SshTarget, check_host

REMOTE_COMMANDS = ("submit", "status", "logs", "trigger", "cancel", "resume")
HOST_ENV = "MEGALAUNCH_HOST"
COMMAND_ENV = "MEGALAUNCH_REMOTE_COMMAND"
CONFIG_ENV = "MEGALAUNCH_SSH_CONFIG"
LOCAL = "local"


def take_host(argv: list[str]) -> tuple[str | None, list[str]]:
    """The value of `--host` (the last one given) and the words without it; `--` ends the search."""
    host, rest, i = None, [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            rest += argv[i:]
            break
        if word == "--host":
            if i + 1 == len(argv):
                raise ConfigError("--host needs a value", field="--host", valid="user@login, an ~/.ssh/config alias, "
                                  "ssh://user@host:port, or local")
            host, i = argv[i + 1], i + 2
            continue
        if word.startswith("--host="):
            host = word.split("=", 1)[1]
        else:
            rest.append(word)
        i += 1
    return host, rest


def _command(argv: list[str]) -> str | None:
    return next((w for w in argv if not w.startswith("-")), None)


def _may_name_a_host(argv: list[str], value_options: set[str], sets: list[str]) -> bool:
    """Whether loading the recipe could find `cluster.ssh`: a `--set` of it, or a local recipe file (the
    recipe, its includes, a profile) that says `ssh`. Shipped recipes never do (a test holds it), so a
    plain `submit llama3-8b` costs no second load of its recipe."""
    from megalaunch.remote.ship import build_request

    if any(s.startswith("cluster.ssh") for s in sets):
        return True
    try:
        return any("ssh" in text for text in build_request(argv, value_options).files.values())
    except (MegalaunchError, ValueError):  # not UTF-8, not YAML: the local load names it in one line
        return False


def _profile(argv: list[str], value_options: set[str]) -> dict[str, Any]:
    """A submit's `cluster.ssh` section as loaded here ({} when the recipe does not load here: the
    login node, or the local command, says why)."""
    from megalaunch.config.loader import load_tree
    from megalaunch.remote.ship import parse_words

    words = parse_words(argv, value_options)
    if words is None or not words.positionals:
        return {}
    sets = [argv[i][len(p):] for opt in ("--set", "-s") for i, p in words.options.get(opt, [])]
    if not _may_name_a_host(argv, value_options, sets):
        return {}
    clusters = [argv[i][len(p):] for i, p in words.options.get("--cluster", [])]
    try:
        tree, _ = load_tree(argv[words.positionals[0]], sets, cluster=clusters[-1] if clusters else None)
    except (MegalaunchError, OSError):
        return {}
    ssh = (tree.get("cluster") or {}).get("ssh") if isinstance(tree.get("cluster"), dict) else None
    return ssh if isinstance(ssh, dict) else {}


def is_this_machine(host: str) -> bool:
    """`host` names this machine (user@, ssh:// and :port aside): the profile is used on the login node."""
    name = host.removeprefix("ssh://").rsplit("@", 1)[-1].split(":", 1)[0].lower()
    here = socket.gethostname().lower()
    return name in (here, here.split(".", 1)[0])


def route(argv: list[str], value_options: Callable[[str], set[str]]) -> tuple[SshTarget | None, list[str]]:
    """(where to run, the words to run): None for here."""
    host, rest = take_host(argv)
    command = _command(rest)
    if command not in REMOTE_COMMANDS:
        if host not in (None, LOCAL):
            raise ConfigError(f"--host works with {', '.join(REMOTE_COMMANDS)}, not with {command or 'no command'}",
                              field="--host", fix="run other commands on the login node: ssh HOST megalaunch ...")
        return None, rest
    profile = _profile(rest, value_options(command)) if command == "submit" and host != LOCAL else {}
    host = host or os.environ.get(HOST_ENV) or profile.get("host")
    if not host or host == LOCAL or is_this_machine(check_host(str(host))):
        return None, rest
    megalaunch = os.environ.get(COMMAND_ENV) or profile.get("megalaunch") or "megalaunch"
    return SshTarget(str(host), str(megalaunch), os.environ.get(CONFIG_ENV) or None), rest
