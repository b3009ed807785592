"""The signal window: the last stretch of a segment in which the stop signal may come. A periodic save
that would start there is skipped: the stop save takes its place (docs/training.md, "The signal lead").

Slurm sends `--signal=SIG@LEAD` between LEAD and LEAD + its check period (30 s) before the time limit;
the local backend's timer is exact. So the window opens at `deadline - lead - delay`. Rank 0 learns the
deadline once, at start (`MEGALAUNCH_DEADLINE`, which the local backend sets; Slurm's
`SLURM_JOB_END_TIME` where it exists; else `squeue -h -j $SLURM_JOB_ID -o %e` with a short timeout),
and this segment's lead: the rendered one, or the one `job begin` raised for it from the saves it
measured (the ledger's `lead_raised` record for this job; launcher/prepare/signal_lead.py). Unknown deadline
or lead: no skipping. The decision is rank 0's and broadcast, so every rank skips the same save."""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from dataclasses import dataclass

from megalaunch.runtime.rank.context import RankContext

DEADLINE_ENV = "MEGALAUNCH_DEADLINE"  # seconds since the epoch at which the segment's time limit falls
SQUEUE_TIMEOUT_S = 5.0
REASON = "inside the signal window"


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    lead_s: float | None = None
    """The rendered signal lead (None: a run made before the runtime knew it: no skipping)."""
    delay_s: float = 0.0
    """How late the signal may come after LEAD before the limit (Slurm's check period; 0 locally)."""


def window_opens(deadline: float | None, lead_s: float | None, delay_s: float) -> float | None:
    """When the signal window opens (seconds since the epoch), or None when it cannot be known."""
    if deadline is None or lead_s is None:
        return None
    return deadline - lead_s - delay_s


def inside_signal_window(now: float, deadline: float | None, lead_s: float | None, delay_s: float) -> bool:
    """A periodic save due at `now` falls inside the window: skip it, the stop save takes its place."""
    opens = window_opens(deadline, lead_s, delay_s)
    return opens is not None and now >= opens


def parse_end_time(text: str) -> float | None:
    """squeue's %e ("2026-11-27T06:31:00", the controller's local time) as seconds since the epoch."""
    text = text.strip()
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None  # "N/A", "Unknown", nothing


def find_deadline(env: dict[str, str] | None = None) -> float | None:
    env = dict(os.environ) if env is None else env
    for name in (DEADLINE_ENV, "SLURM_JOB_END_TIME"):
        if env.get(name):
            try:
                return float(env[name])
            except ValueError:
                pass
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True,
                             timeout=SQUEUE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_end_time(out.stdout) if out.returncode == 0 else None


def segment_lead(ctx: RankContext, rendered: float | None) -> float | None:
    """This segment's lead: the one `job begin` raised for it, else the rendered one."""
    from megalaunch.rundir.ledger import Ledger

    lead = rendered
    try:
        for e in Ledger(ctx.paths).events():
            if e.get("event") == "lead_raised" and str(e.get("job_id")) == str(ctx.job_id):
                lead = float(e["to"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return lead


class StopWindow:
    """Rank 0 knows the deadline and the lead; every rank asks `skip_periodic` at the same saves."""

    def __init__(self, ctx: RankContext, config: WindowConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.deadline: float | None = None
        self.lead_s: float | None = config.lead_s
        if ctx.is_zero and config.lead_s is not None:
            self.deadline = find_deadline()
            self.lead_s = segment_lead(ctx, config.lead_s)
            opens = window_opens(self.deadline, self.lead_s, config.delay_s)
            ctx.log("signal window: " + ("unknown deadline, no periodic save is skipped" if opens is None else
                                         f"opens {opens - time.time():.0f} s from now (lead {self.lead_s:g} s "
                                         f"+ up to {config.delay_s:g} s late)"))

    def skip_periodic(self, iteration: int) -> bool:
        """A collective (every rank reaches the same periodic saves): skip this one?"""
        if self.config.lead_s is None:  # every rank knows: nothing to agree on
            return False
        inside = self.ctx.is_zero and inside_signal_window(time.time(), self.deadline, self.lead_s, self.config.delay_s)
        if self.ctx.world > 1:
            from megalaunch.runtime.rank.collectives import broadcast_from_zero

            inside = bool(broadcast_from_zero(int(inside)))
        if not inside:
            return False
        if self.ctx.is_zero:
            assert self.deadline is not None
            self.ctx.log(f"periodic save at iteration {iteration} skipped: {REASON} "
                         f"({self.deadline - time.time():.0f} s to the limit); the stop save takes its place")
            self.ctx.ledger("save_skipped", iteration=iteration, kind="periodic", reason=REASON,
                            to_limit_s=round(self.deadline - time.time(), 1), lead_s=self.lead_s,
                            delay_s=self.config.delay_s)
        return True
