"""Trigger files, both sides: the CLI writes them (any member of the run's group), the job looks
(cheaply), decides, and consumes them with an audit record.

A trigger is `RUN/triggers/<verb>` holding JSON (who, uid, host, when, reason). Rank 0 looks once
every `trigger_interval` steps with one directory listing, folds the result with the signal flag into
one integer, and the caller makes every rank agree with a collective. Consuming moves the file to
`triggers/consumed/` with the iteration and time it took effect."""

from __future__ import annotations

import enum
import getpass
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from megalaunch.errors import RunDirError
from megalaunch.rundir.access import group_name
from megalaunch.rundir.files import atomic_write_json
from megalaunch.rundir.paths import TRIGGER_VERBS, RunPaths


class Decision(enum.IntEnum):
    """Ordered by severity, so a MAX all-reduce over ranks picks the strongest request."""

    CONTINUE = 0
    SAVE = 1  # checkpoint, keep training
    SIGNAL = 2  # checkpoint, exit; the chain continues (outcome `saved`)
    EXIT = 3  # checkpoint, exit; the chain ends (outcome `exited`)
    ABORT = 4  # exit now without saving; the chain ends (outcome `aborted`)


VERB_DECISION = {"save": Decision.SAVE, "exit": Decision.EXIT, "abort": Decision.ABORT}


class TriggerBox:
    """The trigger files of one run: the CLI writes them, the job looks, consumes and audits them."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths

    def write(self, verb: str, reason: str | None) -> Path:
        """Atomically create triggers/<verb> with who, when and why. Any member of the run's group can."""
        if verb not in TRIGGER_VERBS:
            raise RunDirError(f"unknown trigger '{verb}'", valid=", ".join(TRIGGER_VERBS))
        tdir = self.paths.triggers
        if not tdir.is_dir():
            raise RunDirError(f"{self.paths.root} has no triggers/ directory", fix="is this a megalaunch run directory?")
        record = {"verb": verb, "user": getpass.getuser(), "uid": os.getuid(), "host": socket.gethostname(),
                  "time": time.time(), "reason": reason}
        try:
            atomic_write_json(tdir / verb, record, mode=0o660)
        except PermissionError:
            group = group_name(tdir)
            raise RunDirError(f"permission denied writing a trigger in {tdir}: you ({getpass.getuser()}) are not "
                              f"a member of the run's group '{group}'",
                              fix=f"ask the run's owner to add you to '{group}' or to trigger it") from None
        return tdir / verb

    def pending(self) -> list[str]:
        """Verbs whose trigger file exists (one listing of one directory)."""
        try:
            names = os.listdir(self.paths.triggers)
        except FileNotFoundError:
            return []
        return [v for v in TRIGGER_VERBS if v in names]

    def read(self, verb: str) -> dict[str, Any]:
        try:
            data = json.loads(self.paths.trigger(verb).read_text() or "{}")
            return data if isinstance(data, dict) else {}
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return {}

    def consume(self, verb: str, iteration: int | None, job_id: str | None = None) -> dict[str, Any] | None:
        """Move the trigger to triggers/consumed/ with when it took effect; returns the audit record,
        or None if it was already gone (consumed by someone else)."""
        record = self.read(verb)
        src = self.paths.trigger(verb)
        if not src.exists():
            return None
        record.update({"verb": verb, "consumed_at": time.time(), "consumed_iteration": iteration,
                       "consumed_by_job": job_id, "consumed_on": socket.gethostname()})
        self.paths.consumed_triggers.mkdir(exist_ok=True)
        atomic_write_json(self.paths.consumed_triggers / f"{time.strftime('%Y%m%dT%H%M%S')}-{verb}-{os.getpid()}.json",
                          record)
        try:
            os.unlink(src)
        except FileNotFoundError:
            return None
        return record

    def consume_for(self, decision: Decision, iteration: int | None, job_id: str | None = None) -> list[dict[str, Any]]:
        """Consume every trigger the decision acted on (an exit also satisfies a pending save)."""
        verbs = {Decision.SAVE: ["save"], Decision.EXIT: ["save", "exit"],
                 Decision.ABORT: ["save", "exit", "abort"]}.get(decision, [])
        return [rec for verb in verbs if (rec := self.consume(verb, iteration, job_id)) is not None]

    def consumed(self) -> list[dict[str, Any]]:
        """The audit records, oldest first."""
        out = []
        for p in sorted(Path(self.paths.consumed_triggers).glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (json.JSONDecodeError, OSError):
                continue
        return out


def decide(box: TriggerBox | None, signal_received: bool) -> Decision:
    """Rank 0's local decision: the strongest pending trigger, or the signal (other ranks: box None)."""
    d = Decision.SIGNAL if signal_received else Decision.CONTINUE
    if box is not None:
        for verb in box.pending():
            d = max(d, VERB_DECISION[verb])
    return d
