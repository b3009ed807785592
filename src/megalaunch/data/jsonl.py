"""JSON-lines rows, decoded one by one: each numbered by its 1-based line (blank lines skipped, still counted),
a row that is not UTF-8 text or not JSON given as the problem to name, never dropped. Shared by the chat rows
(tokenization/chat/rows.py) and GRPO's rollout rows (data/rollouts.py). Standard library only."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def json_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, the decoded row or None, what is wrong with it or None) for every non-blank line."""
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield number, None, f"not UTF-8 text (byte {e.start})"
            continue
        try:
            yield number, json.loads(text), None
        except json.JSONDecodeError as e:
            yield number, None, f"not JSON ({e.msg} at column {e.colno})"
