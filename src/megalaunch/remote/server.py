"""The login node's half (`megalaunch remote-side`, started by the laptop's ssh): read the request,
write the files that travelled into a private temporary directory, ask for the environment variables
the command needs, run it as if typed here, and stop it when the laptop goes away."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from megalaunch.errors import MegalaunchError
from megalaunch.remote.ship import Request
from megalaunch.remote.ssh import SERVER_SIDE
from megalaunch.remote.wire import (
    MAX_LINE,
    WireError,
    check_relative,
    decode_env,
    decode_request,
    encode_hello,
)

# (command name, its parsed parameters), or None when the words do not parse: the command says why
Params = Callable[[list[str]], "tuple[str, dict[str, Any]] | None"]
HANGUP_GRACE_S = 10.0  # after Ctrl-C's interrupt, how long the command may take to wind down


def materialize(request: Request, into: Path) -> list[str]:
    """The files written under `into`, and the argv naming them there."""
    for key, text in request.files.items():
        path = into / check_relative(key)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(text, encoding="utf-8")
    argv = list(request.argv)
    for index, prefix in request.file_args:
        argv[index] = prefix + str(into / check_relative(argv[index][len(prefix):]))
    if SERVER_SIDE in argv[:2]:
        raise WireError(f"the request asks for `{SERVER_SIDE}` itself")
    return argv


def _names(tree: dict[str, Any]) -> list[str]:
    def section(d: dict[str, Any], key: str) -> dict[str, Any]:
        value = d.get(key)
        return value if isinstance(value, dict) else {}

    cluster, notify = section(tree, "cluster"), section(section(tree, "chain"), "notify")
    names = [*(cluster.get("secret_env") or []), *(notify.get("webhook_env") or [])]
    return sorted({n for n in names if isinstance(n, str)})


def secret_names(argv: list[str], params: Params) -> list[str]:
    """The variables the command reads from the submitting shell: a submit's or a resume's
    cluster.secret_env and chain.notify.webhook_env (sbatch passes them on to the job). Nothing for a
    command that submits nothing; nothing when the recipe does not load (the command says why)."""
    from megalaunch.config.loader import load_tree, read_run_tree
    from megalaunch.launcher.control import find_run

    parsed = params(argv)
    if parsed is None:
        return []
    command, p = parsed
    try:
        if command == "submit" and not p.get("dry_run") and p.get("recipe"):
            return _names(load_tree(p["recipe"], list(p.get("set_") or []), cluster=p.get("cluster"))[0])
        if command == "resume" and p.get("run"):
            return _names(read_run_tree(find_run(p["run"])))
    except (MegalaunchError, OSError):
        pass
    return []


def watch_hangup(stdin: IO[bytes]) -> threading.Thread:
    """When the laptop's end closes (Ctrl-C there, a dropped connection), interrupt the command as
    Ctrl-C would here; if it is still running after the grace period, end the process."""

    def watch() -> None:
        try:  # the descriptor, not the buffered file: its lock would stall the interpreter's exit
            while os.read(stdin.fileno(), 65536):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(HANGUP_GRACE_S)
        os._exit(130)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def serve(run: Callable[[list[str], str | None], int], params: Params, stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """One request, start to end; the command's exit status. `run` gets the words and the host name
    the laptop used (for the hints the command prints)."""
    request = decode_request(stdin.readline(MAX_LINE))
    with tempfile.TemporaryDirectory(prefix="megalaunch-remote-") as tmp:  # 0700, gone at the end
        argv = materialize(request, Path(tmp))
        needs = secret_names(argv, params)
        stdout.write(encode_hello(needs))
        stdout.flush()
        os.environ.update(decode_env(stdin.readline(MAX_LINE), needs))
        watch_hangup(stdin)
        return run(argv, request.via)
