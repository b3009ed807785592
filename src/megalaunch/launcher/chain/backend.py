"""The interface every backend implements (docs/architecture.md, "Backends"); `backends.backend_for`
picks one by name.

A backend starts a prepared run, resumes and cancels a chain, tells the live state of its segments,
and, for the chain's own decisions at `job begin`/`job end`, queues a successor, cancels jobs by id
and reads one job's state."""

from __future__ import annotations

import getpass
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from megalaunch.rundir.ledger import Ledger, Segment
from megalaunch.rundir.paths import RunPaths

if TYPE_CHECKING:  # pragma: no cover
    from megalaunch.launcher.prepare.prepare import PreparedRun

Echo = Callable[[str], None]
QUERY_TIMEOUT_S = 10.0  # one Slurm query per command: status and cancel answer within ~10 s, Slurm down or not


@dataclass(frozen=True)
class Started:
    paths: RunPaths
    job_id: str | None  # queued (Slurm), or None when the chain already ran here (local)
    outcome: str | None = None  # local: why the chain stopped
    exit_code: int = 0  # local: the waiting command's exit status (backends/local.py, `exit_status`)


@dataclass(frozen=True)
class Live:
    state: str  # RUNNING, PENDING, ... as the backend says
    reason: str | None = None


class JobControl(Protocol):
    """What the chain needs at `job begin` / `job end`."""

    # signal_lead_s: the successor's stop signal this long before its limit instead of the rendered lead
    def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None,
                         signal_lead_s: int | None = None) -> str | None: ...
    def cancel_jobs(self, job_ids: list[str]) -> None: ...
    def state(self, job_id: str) -> str | None: ...
    def batch_host(self, job_id: str) -> str | None: ...  # the node that ran the job script (None: unknown)
    def known_nodes(self, partition: str | None) -> list[str] | None: ...  # None: cannot tell / no nodes
    def exclude(self, job_ids: list[str], nodes: list[str]) -> None: ...


class Backend(JobControl, Protocol):
    name: str

    def start(self, prepared: PreparedRun, echo: Echo) -> Started: ...
    def resume(self, paths: RunPaths, echo: Echo, from_iteration: int | None = None) -> Started: ...
    def cancel(self, paths: RunPaths) -> list[str]: ...
    def live(self, segments: list[Segment]) -> tuple[dict[str, Live], str | None]: ...


def unfinished(segments: list[Segment]) -> list[Segment]:
    return [s for s in segments if s.ended is None and not s.skipped]


def resumed_event(from_iteration: int | None) -> dict[str, int]:
    """The `chain_resumed` ledger fields: the iteration `megalaunch resume --from` asked for (the
    ledger adds who asked)."""
    return {} if from_iteration is None else {"from_iteration": from_iteration}


def record_cancel(paths: RunPaths, targets: list[str]) -> None:
    ledger = Ledger(paths)
    ledger.append("cancelled", job_ids=targets)
    ledger.append("chain_stopped", job_id=None, reason=f"cancelled by {getpass.getuser()}", cancelled=targets)


def cancelled_by(paths: RunPaths) -> str:
    """`megalaunch cancel` left its name in state/cancel_requested ("USER TIME")."""
    try:
        who = paths.cancel_requested.read_text().split()[0]
    except (OSError, IndexError):
        return "cancelled"
    return f"cancelled by {who}"
