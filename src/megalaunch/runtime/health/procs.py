"""The processes of this machine, read from /proc without a library: shared by the task supervisor
(runtime/task.py: what a dying rank leaves behind) and the hang killer (runtime/hangwatch.py:
which processes are the step's). Standard library only."""

from __future__ import annotations

import os
from collections.abc import Iterator


def proc_stats() -> Iterator[tuple[int, bytes, list[bytes]]]:
    """(pid, command name, the fields after the name: state, parent, group, ...) of every process, from
    /proc/PID/stat. The name is in parentheses and may hold spaces; the fields after it are fixed."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        yield int(entry.name), stat[stat.find(b"(") + 1:stat.rfind(b")")], stat[stat.rfind(b")") + 2:].split()
