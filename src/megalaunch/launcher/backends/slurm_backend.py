"""The Slurm backend: sbatch, squeue, scancel through the one Slurm client (launcher/backends/slurm.py)."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import time
from typing import TYPE_CHECKING

from megalaunch.errors import PreflightError
from megalaunch.launcher.accounting.nodes import ExclusionPlan, current_plan
from megalaunch.launcher.chain.backend import (
    QUERY_TIMEOUT_S,
    Echo,
    Live,
    Started,
    record_cancel,
    resumed_event,
    unfinished,
)
from megalaunch.rundir.ledger import Ledger, Segment
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.registry import register

if TYPE_CHECKING:  # pragma: no cover
    from megalaunch.launcher.prepare.prepare import PreparedRun


class SlurmBackend:
    name = "slurm"

    def __init__(self) -> None:
        from megalaunch.launcher.backends.slurm import SlurmClient

        self.client = SlurmClient()  # submissions: Slurm's default patience
        self.query = SlurmClient(timeout_s=QUERY_TIMEOUT_S)  # what a person waits for: status, cancel

    def start(self, prepared: PreparedRun, echo: Echo) -> Started:
        """Write the run directory and queue the first segment."""
        from megalaunch.launcher.prepare.write import write_run

        r = prepared.recipe
        for field, names in (("cluster.secret_env", r.cluster.secret_env), ("chain.notify.webhook_env",
                                                                            r.chain.notify.webhook_env)):
            missing = [n for n in names if not os.environ.get(n)]
            if missing:  # sbatch passes the submitting shell's environment on; no file holds the value
                raise PreflightError(f"{', '.join(missing)} not set in this shell", field=field,
                                     fix=f"export {missing[0]}=... before submitting (its value is never written "
                                         "to disk)")
        self.client.check_available()  # fail before writing anything if Slurm is absent
        paths = write_run(prepared)
        plan = self._plan(paths, echo)
        try:
            job_id = self._sbatch(paths, _exclude_args(plan))
        except BaseException:
            shutil.rmtree(paths.root, ignore_errors=True)  # nothing written unless submitted
            raise
        Ledger(paths).append("submitted", job_id=job_id, by="megalaunch submit")
        _record(paths, job_id, plan)
        register(paths.root)
        return Started(paths, job_id)

    def resume(self, paths: RunPaths, echo: Echo, from_iteration: int | None = None) -> Started:
        """Restart a stopped chain from its last checkpoint, or from the one of a pending
        `resume --from` request (a new epoch in the ledger)."""
        with contextlib.suppress(FileNotFoundError):
            paths.cancel_requested.unlink()
        ledger = Ledger(paths)
        ledger.append("chain_resumed", **resumed_event(from_iteration))
        plan = self._plan(paths, echo)
        job_id = self._sbatch(paths, ["--dependency=singleton", *_exclude_args(plan)])
        ledger.append("submitted", job_id=job_id, by="megalaunch resume")
        _record(paths, job_id, plan)
        return Started(paths, job_id)

    def cancel(self, paths: RunPaths, timeout_s: float = 60.0) -> list[str]:
        """Cancel every queued or running job of the chain and wait until none is left. The jobs are
        found with one query (the chain's unique job name) and cancelled by id. If Slurm does not
        answer, nothing is written and nothing is cancelled: the error says so."""
        client = self.query
        targets = sorted(client.squeue(name=paths.root.name))
        paths.cancel_requested.write_text(f"{getpass.getuser()} {time.time()}\n")
        client.scancel(targets)
        deadline = time.monotonic() + timeout_s
        while targets and time.monotonic() < deadline:
            if not client.squeue(targets):
                break
            time.sleep(0.5)
        record_cancel(paths, targets)
        return targets

    def live(self, segments: list[Segment]) -> tuple[dict[str, Live], str | None]:
        """One `squeue` for every unfinished segment given, or ({}, why) when Slurm did not answer."""
        from megalaunch.errors import SlurmError

        ids = [s.job_id for s in unfinished(segments)]
        if not ids:
            return {}, None
        try:
            jobs = self.query.squeue(ids)
        except SlurmError as e:
            return {}, str(e)
        return {j: Live(i.state, i.reason if i.reason not in ("None", "") else None) for j, i in jobs.items()}, None

    def _plan(self, paths: RunPaths, echo: Echo) -> ExclusionPlan | None:
        """The team's suspect nodes that a job queued now stays off (launcher/accounting/nodes.py)."""
        from megalaunch.runtime.rank.settings import RuntimeSettings

        plan = current_plan(RuntimeSettings.load(paths), self.known_nodes, echo)
        if plan is not None:
            echo(f"node-health ledger: this job {plan.describe()}")
        return plan

    def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None,
                         signal_lead_s: int | None = None) -> str | None:
        extra = ["--dependency=singleton", *([f"--exclude={','.join(exclude)}"] if exclude else [])]
        if signal_lead_s is not None:  # a command-line option overrides the script's #SBATCH --signal line
            from megalaunch.runtime.rank.settings import RuntimeSettings

            sig = RuntimeSettings.load(paths).stop_signal.removeprefix("SIG")
            extra.append(f"--signal={sig}@{int(signal_lead_s)}")
        return self._sbatch(paths, extra)

    def _sbatch(self, paths: RunPaths, extra: list[str]) -> str:
        """Queue the run's job script as the owner recorded it (rundir/trust.py): the checked bytes go to
        sbatch on its standard input, so a file swapped after the check is never what runs."""
        from megalaunch.rundir.trust import read_trusted

        text = read_trusted(paths, "job.sbatch").decode()
        return self.client.sbatch(paths.job_script, extra, cwd=paths.root, text=text)

    def known_nodes(self, partition: str | None) -> list[str] | None:
        from megalaunch.errors import SlurmError

        try:
            return self.query.node_names(partition) or None
        except SlurmError:  # Slurm did not answer: unknown, never "no nodes"
            return None

    def exclude(self, job_ids: list[str], nodes: list[str]) -> None:
        for job_id in job_ids:
            self.client.exclude_nodes(job_id, nodes)

    def cancel_jobs(self, job_ids: list[str]) -> None:
        self.client.scancel(job_ids)

    def state(self, job_id: str) -> str | None:
        info = self.client.job_state(job_id)
        return info.state if info else None

    def batch_host(self, job_id: str) -> str | None:
        info = self.client.job_state(job_id)
        return (info.batch_host or None) if info else None


def _exclude_args(plan: ExclusionPlan | None) -> list[str]:
    return [f"--exclude={','.join(plan.exclude)}"] if plan is not None and plan.exclude else []


def _record(paths: RunPaths, job_id: str, plan: ExclusionPlan | None) -> None:
    if plan is not None:
        Ledger(paths).append("exclusion", job_id=job_id, excluded=plan.exclude, kept=plan.kept)
