"""Printing for the CLI: results to stdout, diagnostics to stderr."""

from __future__ import annotations

import json
import sys
from typing import Any


def say(text: str = "") -> None:
    print(text, flush=True)


def warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
