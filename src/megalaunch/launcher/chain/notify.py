"""Telling a person (issue #25, "Tell a person"): `chain.notify`'s commands and webhooks are given one
JSON message when the chain stops for a reason that needs a person, when it finishes, when it pauses
(the successor could not be queued), and, with `on_every_segment`, at every segment end and every
in-job restart (launcher/chain/restart.py).

Which stops tell (`Chain.stop(..., kind=...)`): every `chain_stopped` is `needs_person` unless it is
`finished` (training reached its target: told too, as good news) or `by_user` (an exit or abort
trigger, or a cancel: a person did it and knows; told only with `on_every_segment`).

A notification never changes what the chain does: every target runs in a thread of its own, all at
once, and `job begin`/`job end` wait at most the longest timeout (+2 s) for them; every exception is
caught; each attempt is a ledger event (`notified` / `notify_failed`) that names the target (a
command's program, a webhook's variable NAME or host), never a URL that may carry a token.
Standard library only: this runs in `job begin`/`job end` on the batch host."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

from megalaunch import __version__
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths

NOTIFY_JSON_ENV = "MEGALAUNCH_NOTIFY_JSON"  # a command gets the message here and on its stdin
GRACE_S = 2.0  # beyond the longest timeout, before a target that has not answered is given up
StopKind = Literal["needs_person", "finished", "by_user"]
_OUTCOME = {"needs_person": "stopped", "finished": "finished", "by_user": "stopped_by_user"}


class _Verdict(Protocol):
    @property
    def proceed(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def needs_person(self) -> bool: ...


V = TypeVar("V", bound=_Verdict)


@dataclass(frozen=True, kw_only=True)
class NotifySettings:
    """RuntimeSettings.notify, typed (config/schema.py NotifyConfig wrote it, config/notify.py checked it)."""

    commands: tuple[tuple[str, ...], ...] = ()
    webhook_env: tuple[str, ...] = ()
    webhooks: tuple[str, ...] = ()
    on_every_segment: bool = False
    timeout_s: float = 10.0
    command_timeout_s: float = 30.0

    @classmethod
    def from_job_slice(cls, data: dict[str, Any] | None) -> NotifySettings | None:
        if not data:
            return None
        return cls(commands=tuple(tuple(str(a) for a in c) for c in data.get("commands") or []),
                   webhook_env=tuple(data.get("webhook_env") or []), webhooks=tuple(data.get("webhooks") or []),
                   on_every_segment=bool(data.get("on_every_segment")),
                   timeout_s=float(data.get("timeout_s") or 10.0),
                   command_timeout_s=float(data.get("command_timeout_s") or 30.0))


def log(message: str) -> None:
    print(f"megalaunch: {message}", file=sys.stderr, flush=True)


class Notifier:
    """The chain's messenger: one message per segment at most (`job begin` and `job end` each build one)."""

    def __init__(self, paths: RunPaths, ledger: Ledger, job_slice: dict[str, Any] | None) -> None:
        self.paths = paths
        self.ledger = ledger
        try:
            self.settings = NotifySettings.from_job_slice(job_slice)
        except (TypeError, ValueError, AttributeError) as e:  # never a reason for the chain to fail
            log(f"notify: chain.notify in runtime.json is unreadable ({e}); nobody will be told")
            self.settings = None
        self.told: set[str | None] = set()  # job ids already told about

    def chain_stopped(self, job_id: str | None, reason: str, fix: str | None, kind: StopKind) -> None:
        """From `Chain.stop`, after the decision is recorded."""
        s = self.settings
        if s is not None and (kind != "by_user" or s.on_every_segment):
            self._tell(job_id, _OUTCOME[kind], reason, fix, needs_person=kind == "needs_person")

    def segment_ended(self, job_id: str, status: str, verdict: V) -> V:
        """From `Chain.end`, after its decision (returned unchanged): a pause needs a person; with
        on_every_segment every end is told, once (a stop that told already is not told again)."""
        s = self.settings
        if s is None or job_id in self.told:
            return verdict
        if verdict.needs_person:
            self._tell(job_id, "paused", verdict.reason, f"megalaunch resume {shlex.quote(str(self.paths.root))}",
                       needs_person=True, segment=status)
        elif s.on_every_segment:
            self._tell(job_id, "continues" if verdict.proceed else "ended", verdict.reason, None,
                       needs_person=False, segment=status)
        return verdict

    def restarted(self, job_id: str, step: int, status: str, reason: str) -> None:
        """From an in-job restart (launcher/chain/restart.py): told with on_every_segment."""
        if self.settings is not None and self.settings.on_every_segment:
            self._tell(job_id, "restarted", f"step {step} started in the same job after {status}: {reason}", None,
                       needs_person=False, segment=status)
            self.told.discard(job_id)  # the segment's own end is still told

    def _tell(self, job_id: str | None, outcome: str, reason: str, fix: str | None, *, needs_person: bool,
              segment: str | None = None) -> None:
        self.told.add(job_id)
        try:
            body = self.message(job_id, outcome, reason, fix, needs_person=needs_person, segment=segment)
            for target, error, seconds in deliver(self._targets(), body, self._bound()):
                self._record(job_id, outcome, target, error, seconds)
        except Exception as e:  # telling must never change what the chain does
            log(f"notify: {type(e).__name__}: {e}")

    def message(self, job_id: str | None, outcome: str, reason: str, fix: str | None, *, needs_person: bool,
                segment: str | None = None) -> str:
        root = self.paths.root
        status = f"megalaunch status {shlex.quote(str(root))}"
        text = (f"megalaunch: run {root.name} {outcome.replace('_', ' ')}: {reason}"
                + (f" | fix: {fix}" if fix else "") + f" | {status}")
        return json.dumps({"run": root.name, "run_dir": str(root), "job_id": job_id, "outcome": outcome,
                           "needs_person": needs_person, "reason": reason, "fix": fix, "segment": segment,
                           "status_command": status, "host": os.uname().nodename,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "text": text})

    def _targets(self) -> list[tuple[str, Callable[[str], None]]]:
        s = self.settings
        assert s is not None
        targets: list[tuple[str, Callable[[str], None]]] = []
        for argv in s.commands:
            targets.append((f"command {argv[0]}", partial(run_command, argv, timeout_s=s.command_timeout_s)))
        for name in s.webhook_env:
            targets.append((f"webhook ${name}", partial(_post_from_env, name, timeout_s=s.timeout_s)))
        for url in s.webhooks:
            parts = urlsplit(url)
            targets.append((f"webhook {parts.scheme}://{parts.netloc}", partial(post_json, url, timeout_s=s.timeout_s)))
        return targets

    def _bound(self) -> float:
        s = self.settings
        assert s is not None
        return max(s.timeout_s if s.webhook_env or s.webhooks else 0.0,
                   s.command_timeout_s if s.commands else 0.0) + GRACE_S

    def _record(self, job_id: str | None, outcome: str, target: str, error: str | None, seconds: float) -> None:
        fields = {"job_id": job_id, "target": target, "outcome": outcome, "seconds": round(seconds, 3)}
        log(f"notify: {target}: " + (f"failed ({error})" if error else "told"))
        try:
            if error:
                self.ledger.append("notify_failed", error=error, **fields)
            else:
                self.ledger.append("notified", **fields)
        except OSError as e:  # a full disk: the log line above is the record
            log(f"notify: could not record it in the ledger: {e}")


def deliver(targets: list[tuple[str, Callable[[str], None]]], body: str,
            bound_s: float) -> list[tuple[str, str | None, float]]:
    """Every target at once, each in a daemon thread; (target, error or None, seconds) for each, after
    at most `bound_s` (a target still busy then is given up: its thread dies with the process)."""
    results: dict[int, tuple[str | None, float]] = {}
    start = time.monotonic()

    def attempt(i: int, send: Callable[[str], None]) -> None:
        try:
            send(body)
            results[i] = (None, time.monotonic() - start)
        except BaseException as e:
            results[i] = (_describe(e), time.monotonic() - start)

    threads = [threading.Thread(target=attempt, args=(i, send), daemon=True, name=f"notify-{i}")
               for i, (_, send) in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, bound_s - (time.monotonic() - start)))
    late = f"no answer within {bound_s:g} s"
    return [(target, *results.get(i, (late, time.monotonic() - start))) for i, (target, _) in enumerate(targets)]


def _describe(e: BaseException) -> str:
    """An error, without the URL (it may carry a token): urllib's messages name the reason only."""
    import urllib.error

    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return f"{type(e.reason).__name__}: {e.reason}" if isinstance(e.reason, BaseException) else str(e.reason)
    return f"{type(e).__name__}: {e}"[:300]


def _post_from_env(name: str, body: str, *, timeout_s: float) -> None:
    """The URL is read here, in the job, from the variable the recipe names: no file ever holds it."""
    url = os.environ.get(name)
    if not url:
        raise LookupError(f"{name} is not set in the job's environment (export it before submit or resume)")
    post_json(url, body, timeout_s=timeout_s)


def post_json(url: str, body: str, *, timeout_s: float) -> None:
    """POST the message; any non-2xx answer, or no answer within timeout_s, raises."""
    if urlsplit(url).scheme not in ("http", "https"):
        raise ValueError("not an http(s) URL")  # urllib would also open file: and ftp:
    import urllib.request  # here: `job begin`/`job end` pay for http.client and ssl only when they tell

    request = urllib.request.Request(url, data=body.encode(), method="POST", headers={
        "Content-Type": "application/json", "User-Agent": f"megalaunch/{__version__}"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        response.read(1 << 16)


def run_command(argv: tuple[str, ...], body: str, *, timeout_s: float) -> None:
    """Run `argv` (no shell) with the message on stdin and in MEGALAUNCH_NOTIFY_JSON; its output goes to
    the job's log. Killed (its whole process group) after timeout_s; a non-zero exit raises."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, env={**os.environ, NOTIFY_JSON_ENV: body},
                            start_new_session=True)
    try:
        proc.communicate(body.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise TimeoutError(f"still running after {timeout_s:g} s: killed") from None
    if proc.returncode != 0:
        raise RuntimeError(f"exited with status {proc.returncode}")
