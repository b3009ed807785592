"""The protocol between the two halves, on the SSH channel's stdin and stdout.

    laptop -> login  one JSON line: protocol, argv, files (relative path -> text), file_args
    login -> laptop  one line: `megalaunch-remote 1 {"needs": [NAMES]}`: the environment variables the
                     command needs from the submitting shell (cluster.secret_env, webhook variables)
    laptop -> login  one JSON line: {"env": {NAME: value}} for those of NAMES set here, nothing else
    then             the command's stdout and stderr as they come; its exit status is ssh's.
The laptop keeps stdin open until the command ends: its end of file means the laptop is gone (Ctrl-C
on `logs -f`), and the login node's half interrupts the command as Ctrl-C would."""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath
from typing import Any

from megalaunch.errors import MegalaunchError
from megalaunch.remote.ship import Request

PROTOCOL = 1
HELLO = b"megalaunch-remote %d " % PROTOCOL
MAX_LINE = 16 << 20
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


class WireError(MegalaunchError):
    """The other half spoke something else (another version, a damaged line)."""


def encode_request(request: Request) -> bytes:
    return json.dumps({"protocol": PROTOCOL, "argv": request.argv, "files": request.files,
                       "file_args": [list(a) for a in request.file_args], "via": request.via}).encode() + b"\n"


def decode_request(line: bytes) -> Request:
    data = _json(line, "the request")
    if data.get("protocol") != PROTOCOL:
        raise WireError(f"the laptop speaks protocol {data.get('protocol')!r}, this megalaunch {PROTOCOL}",
                        fix="install the same megalaunch version on both sides")
    argv, files, file_args = data.get("argv"), data.get("files"), data.get("file_args")
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv) and isinstance(files, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()) and isinstance(file_args, list)):
        raise WireError("the request is damaged (argv, files or file_args of the wrong type)")
    for key in files:
        check_relative(key)
    args = []
    for item in file_args:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and isinstance(item[1], str)
                and 0 <= item[0] < len(argv) and argv[item[0]].startswith(item[1])):
            raise WireError(f"the request names a file argument it does not hold: {item!r}")
        args.append((item[0], item[1]))
    via = data.get("via")
    return Request(argv, files, args, via if isinstance(via, str) and via and not via.startswith("-") else None)


def check_relative(key: str) -> str:
    """A path that stays inside the directory it is written under."""
    p = PurePosixPath(key)
    if not key or p.is_absolute() or ".." in p.parts or "\0" in key:
        raise WireError(f"the request names a file outside its directory: {key!r}")
    return key


def encode_hello(needs: list[str]) -> bytes:
    return HELLO + json.dumps({"needs": needs}).encode() + b"\n"


def decode_hello(line: bytes) -> list[str] | None:
    """The names the login node asks for; None when the line is not the hello (a shell's greeting)."""
    if not line.startswith(HELLO):
        return None
    needs = _json(line[len(HELLO):], "the hello").get("needs")
    if not isinstance(needs, list) or not all(isinstance(n, str) and _NAME.match(n) for n in needs):
        raise WireError("the login node's hello is damaged")
    return needs


def encode_env(values: dict[str, str]) -> bytes:
    return json.dumps({"env": values}).encode() + b"\n"


def decode_env(line: bytes, needs: list[str]) -> dict[str, str]:
    """Only the names asked for, only text values."""
    env = _json(line, "the environment").get("env")
    if not isinstance(env, dict):
        raise WireError("the environment line is damaged")
    return {k: v for k, v in env.items() if k in needs and isinstance(v, str) and "\0" not in v}


def _json(line: bytes, what: str) -> dict[str, Any]:
    if not line.endswith(b"\n"):
        raise WireError(f"{what} ended early (the other side closed the connection, or it is over {MAX_LINE >> 20} MiB)")
    try:
        data = json.loads(line)
    except ValueError:
        raise WireError(f"{what} is not JSON") from None
    if not isinstance(data, dict):
        raise WireError(f"{what} is not a JSON object")
    return data
