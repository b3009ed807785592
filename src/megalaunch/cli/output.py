"""Printing for the CLI: results to stdout, diagnostics to stderr."""

from __future__ import annotations

import json
import shlex
import sys
from typing import Any

# Set by `megalaunch remote-side` (docs/remote.md): the login node the laptop reached this one as, so
# that the commands printed as "next" work where the user typed the first one.
VIA_HOST: str | None = None


def ml() -> str:
    """How to call megalaunch in a printed hint: with `--host` when the command came over SSH."""
    return f"megalaunch --host {shlex.quote(VIA_HOST)}" if VIA_HOST else "megalaunch"


def say(text: str = "") -> None:
    print(text, flush=True)


def warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
