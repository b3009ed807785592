"""The successor segment (docs/architecture.md, "The chain"): `job begin` queues it (singleton dependency)
with the suspect nodes excluded (chain/suspects.py) and the stop signal's lead raised from the saves
measured (launcher/prepare/signal_lead.py); when Slurm did not answer then, `job end` queues it, retrying
for about two minutes before the chain pauses for a person."""

from __future__ import annotations

from megalaunch.launcher.chain.backend import Echo, JobControl
from megalaunch.launcher.chain.suspects import Suspects
from megalaunch.launcher.prepare.signal_lead import record_lead, safe_plan
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.settings import RuntimeSettings

SUCCESSOR_RETRY_S = (5, 10, 20, 30, 45)  # `job end`'s waits before each retry of a successor Slurm refused


class Successor:
    """Queues one run's next segment and records it in the ledger."""

    def __init__(self, paths: RunPaths, settings: RuntimeSettings, ledger: Ledger, scheduler: JobControl,
                 suspects: Suspects, log: Echo) -> None:
        self.paths = paths
        self.settings = settings
        self.ledger = ledger
        self.scheduler = scheduler
        self.suspects = suspects
        self.log = log

    def queue(self, by: str) -> str | None:
        """Submit the successor (`by`: who queued it, for the ledger); its job id, or None when the
        backend queues none. Raises what the backend raises when Slurm does not answer."""
        plan = self.suspects.plan()
        lead = safe_plan(self.paths, self.settings, self.log)  # from the saves measured
        raised = {"signal_lead_s": lead.lead} if lead is not None and lead.raised else {}
        successor = self.scheduler.submit_successor(self.paths, exclude=plan.exclude if plan else None, **raised)
        if successor is not None:
            self.ledger.append("submitted", job_id=successor, by=by, dependency="singleton")
            if raised and lead is not None:
                record_lead(self.ledger, successor, lead, self.log)
            if plan is not None:
                self.suspects.record_exclusion(successor, plan)
            self.log(f"queued successor {successor} (singleton)")
            if self.paths.cancel_requested.exists():  # a cancel raced with the submission
                self.scheduler.cancel_jobs([successor])
        return successor

    def queue_if_begin_could_not(self, job_id: str) -> str | None:
        """`job begin` could not queue this segment's successor (Slurm did not answer): queue it now,
        retrying for about two minutes. None when there is a successor; else Slurm's last error (recorded)."""
        if not any(e.get("job_id") == job_id for e in self.ledger.events() if e["event"] == "successor_not_queued"):
            return None
        import time

        error = ""
        for wait_s in (0, *SUCCESSOR_RETRY_S):
            time.sleep(wait_s)
            try:
                self.queue(f"segment {job_id} (at its end: `job begin` could not)")
                return None
            except Exception as e:
                error = str(e)
                self.log(f"could not queue the successor ({error})")
        self.ledger.append("successor_not_queued", job_id=job_id, when="end", error=error)
        return error
