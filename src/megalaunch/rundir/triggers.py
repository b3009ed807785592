"""Trigger files, both sides: the CLI writes them (any member of the run's group), the job looks
(cheaply), decides, and consumes them with an audit record.

A trigger is `RUN/triggers/<verb>` holding JSON (when, host, why). Rank 0 looks once every
`trigger_interval` steps with one directory listing, folds the result with the signal flag into one
integer, and the caller makes every rank agree with a collective. Consuming records who asked (the
file's owner, not what the file claims), when and why in `triggers/consumed/` (the owner's) and removes
the file.

`triggers/` is the one place members write (3770: setgid, sticky), so everything in it is read as
untrusted (rundir/untrusted.py): a link, a FIFO, a directory, a hard link, an oversized or non-JSON file
is refused without being read, recorded once in the ledger with who planted it, removed where the job
can, and never acted on."""

from __future__ import annotations

import contextlib
import enum
import getpass
import json
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.errors import RunDirError
from megalaunch.rundir.access import group_name
from megalaunch.rundir.files import atomic_write_json
from megalaunch.rundir.paths import TRIGGER_VERBS, RunPaths
from megalaunch.rundir.untrusted import (
    MAX_TRIGGER_BYTES,
    MemberFile,
    Refused,
    open_member_file,
    printable,
    same_entry,
)

MAX_REASON_CHARS = 500
# Refused entries already recorded, per run directory: a box is made at every check, and an entry the
# job cannot remove (a member's non-empty directory) must not fill the ledger.
_REPORTED: set[tuple[str, tuple[int, int, int]]] = set()


class Decision(enum.IntEnum):
    """Ordered by severity, so a MAX all-reduce over ranks picks the strongest request."""

    CONTINUE = 0
    SAVE = 1  # checkpoint, keep training
    SIGNAL = 2  # checkpoint, exit; the chain continues (outcome `saved`)
    EXIT = 3  # checkpoint, exit; the chain ends (outcome `exited`)
    ABORT = 4  # exit now without saving; the chain ends (outcome `aborted`)


VERB_DECISION = {"save": Decision.SAVE, "exit": Decision.EXIT, "abort": Decision.ABORT}


@dataclass(frozen=True)
class Request:
    """A valid trigger: who asked (the file's owner), when, from where, why."""

    verb: str
    user: str
    uid: int
    time: float | None
    host: str | None
    reason: str | None
    inode: tuple[int, int, int]

    def record(self) -> dict[str, Any]:
        return {"verb": self.verb, "user": self.user, "uid": self.uid, "time": self.time, "host": self.host,
                "reason": self.reason}


@dataclass
class Scan:
    valid: dict[str, Request] = field(default_factory=dict)
    refused: list[Refused] = field(default_factory=list)


def parse(member: MemberFile, verb: str) -> Request | Refused:
    """A trigger's known fields, each checked; an empty file is a trigger without details."""
    try:
        data = json.loads(member.data.decode("utf-8")) if member.data.strip() else {}
    except UnicodeDecodeError:
        return _malformed(member, "binary", "not UTF-8 text")
    except json.JSONDecodeError:
        return _malformed(member, "malformed", "not JSON")
    if not isinstance(data, dict):
        return _malformed(member, "malformed", "not a JSON object")
    when = data.get("time")
    return Request(verb=verb, user=member.owner, uid=member.uid,
                   time=float(when) if isinstance(when, int | float) and not isinstance(when, bool) else None,
                   host=printable(data.get("host"), 255), reason=printable(data.get("reason"), MAX_REASON_CHARS),
                   inode=member.inode)


def _malformed(member: MemberFile, kind: str, why: str) -> Refused:
    return Refused(member.name, kind, member.owner, member.uid, len(member.data), why, member.inode)


class TriggerBox:
    """The trigger files of one run: the CLI writes them, the job looks, consumes and audits them.

    When this process owns the run directory (the job, or the owner's own commands), refused entries
    are recorded in the ledger once each and removed; a member's `status` only reads."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self._last: Scan = Scan()

    # ------------------------------------------------------------------------ the member's side
    def write(self, verb: str, reason: str | None) -> Path:
        """Atomically create triggers/<verb> with when, where and why. Any member of the run's group can."""
        if verb not in TRIGGER_VERBS:
            raise RunDirError(f"unknown trigger '{verb}'", valid=", ".join(TRIGGER_VERBS))
        tdir = self.paths.triggers
        if not tdir.is_dir():
            raise RunDirError(f"{self.paths.root} has no triggers/ directory", fix="is this a megalaunch run directory?")
        record = {"verb": verb, "user": getpass.getuser(), "uid": os.getuid(), "host": socket.gethostname(),
                  "time": time.time(), "reason": reason}
        try:
            atomic_write_json(tdir / verb, record, mode=0o640)
        except PermissionError:
            if os.access(tdir, os.W_OK | os.X_OK):  # a colleague's file holds the name (sticky directory)
                raise self._taken(verb) from None
            group = group_name(tdir)
            raise RunDirError(f"permission denied writing a trigger in {tdir}: you ({getpass.getuser()}) are not "
                              f"a member of the run's group '{group}'",
                              fix=f"ask the run's owner to add you to '{group}' or to trigger it") from None
        return tdir / verb

    def _taken(self, verb: str) -> RunDirError:
        found = open_member_file(self.paths.trigger(verb), MAX_TRIGGER_BYTES)
        req = parse(found, verb) if isinstance(found, MemberFile) else found
        if isinstance(req, Request):
            return RunDirError(f"a '{verb}' trigger by {req.user} is already pending in {self.paths.triggers}",
                               fix=f"nothing to do: the job acts on it; check: megalaunch status {self.paths.root}")
        who = req.owner if isinstance(req, Refused) else "someone"
        return RunDirError(f"{self.paths.trigger(verb)} is held by an entry of {who} that is not a valid trigger",
                           fix="the job refuses and removes it at its next check; try again then")

    # --------------------------------------------------------------------------- the job's side
    def scan(self) -> Scan:
        """Read every trigger name present (one listing), each as untrusted; refusals are handled."""
        try:
            names = set(os.listdir(self.paths.triggers))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            names = set()
        scan = Scan()
        for verb in TRIGGER_VERBS:
            if verb not in names:
                continue
            found = open_member_file(self.paths.trigger(verb), MAX_TRIGGER_BYTES)
            got = parse(found, verb) if isinstance(found, MemberFile) else found
            if isinstance(got, Request):
                scan.valid[verb] = got
            elif got is not None:
                scan.refused.append(got)
        self._handle_refused(scan.refused)
        self._last = scan
        return scan

    def pending(self) -> list[str]:
        """Verbs with a valid trigger file (one listing of one directory)."""
        return list(self.scan().valid)

    def read(self, verb: str) -> dict[str, Any]:
        """A pending trigger's checked fields, or {} (none, or refused)."""
        req = self._last.valid.get(verb) or self.scan().valid.get(verb)
        return req.record() if req is not None else {}

    def _owns_run(self) -> bool:
        try:
            return os.stat(self.paths.root).st_uid == os.getuid()
        except OSError:
            return False

    def _handle_refused(self, refused: list[Refused]) -> None:
        if not refused or not self._owns_run():
            return
        from megalaunch.rundir.ledger import Ledger

        for r in refused:
            key = (str(self.paths.root), r.inode or (0, 0, 0))
            if key in _REPORTED:
                continue
            removed = self._remove(r)
            Ledger(self.paths).append("trigger_refused", **r.record(), removed=removed)
            print(f"megalaunch: refused trigger '{r.name}': {r.why} (planted by {r.owner}); "
                  f"{'removed' if removed else 'left in place'}, ignored", flush=True)
            _REPORTED.add(key)

    def _remove(self, r: Refused) -> bool:
        path = self.paths.trigger(r.name)
        if r.inode is not None and not same_entry(path, r.inode):
            return False
        try:
            if r.kind == "directory":
                os.rmdir(path)
            else:
                os.unlink(path)
            return True
        except OSError:
            return False

    def consume(self, verb: str, iteration: int | None, job_id: str | None = None) -> dict[str, Any] | None:
        """Record the trigger as taken (when, at which iteration) and remove it; returns the audit record,
        or None if it was not pending (or already consumed by someone else). Uses what the last scan read:
        the file is not read again, and a file swapped in since is left for the next look."""
        req = self._last.valid.get(verb)
        if req is None:
            req = self.scan().valid.get(verb)
        if req is None:
            return None
        path = self.paths.trigger(verb)
        if not same_entry(path, req.inode):
            return None
        record = {**req.record(), "consumed_at": time.time(), "consumed_iteration": iteration,
                  "consumed_by_job": job_id, "consumed_on": socket.gethostname()}
        self._write_consumed(verb, record)  # first: whoever sees the trigger gone finds its record
        self._last.valid.pop(verb, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        return record

    def _write_consumed(self, verb: str, record: dict[str, Any]) -> None:
        """Into triggers/consumed/, the owner's directory, only if it is one (not a member's link or dir)."""
        target = self.paths.consumed_triggers
        with contextlib.suppress(FileExistsError):
            os.mkdir(target, 0o2750)
        st = os.lstat(target)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            print(f"megalaunch: {target} is not the run owner's directory: the consumed '{verb}' trigger is "
                  "recorded in the ledger only", flush=True)
            return
        atomic_write_json(target / f"{time.strftime('%Y%m%dT%H%M%S')}-{verb}-{os.getpid()}.json", record)

    def consume_for(self, decision: Decision, iteration: int | None, job_id: str | None = None) -> list[dict[str, Any]]:
        """Consume every trigger the decision acted on (an exit also satisfies a pending save)."""
        verbs = {Decision.SAVE: ["save"], Decision.EXIT: ["save", "exit"],
                 Decision.ABORT: ["save", "exit", "abort"]}.get(decision, [])
        return [rec for verb in verbs if (rec := self.consume(verb, iteration, job_id)) is not None]

    def consumed(self) -> list[dict[str, Any]]:
        """The audit records, oldest first."""
        out = []
        for p in sorted(Path(self.paths.consumed_triggers).glob("*.json")):
            found = open_member_file(p, MAX_TRIGGER_BYTES * 2)
            if not isinstance(found, MemberFile):
                continue
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                data = json.loads(found.data)
                if isinstance(data, dict):
                    out.append(data)
        return out


def decide(box: TriggerBox | None, signal_received: bool) -> Decision:
    """Rank 0's local decision: the strongest pending trigger, or the signal (other ranks: box None)."""
    d = Decision.SIGNAL if signal_received else Decision.CONTINUE
    if box is not None:
        for verb in box.pending():
            d = max(d, VERB_DECISION[verb])
    return d
