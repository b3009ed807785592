"""The signal lead of the next segment, from the saves actually measured (docs/training.md, "The
signal lead").

The rendered lead (`#SBATCH --signal=SIG@LEAD`, config/preflight.signal_lead_s) rests on
`checkpoint.save_time_estimate_s`. Every segment's timeline records how long each of its checkpoints
took until complete on disk (`writes`; a workload's timeline: its blocking `saves`). At `job begin`
the chain takes the slowest of the last RECENT segments, with a margin, plus one step, Slurm's check
period and the signal margin; when that outgrows the rendered lead the successor gets it (Slurm:
`--signal=SIG@LEAD` on its sbatch command line, which overrides the script's line; local: the next
segment's timer) and the ledger records `lead_raised` for that job, where the job's own runtime
(runtime/stop/stop_window.py) reads it. Never lower than rendered. Standard library only."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megalaunch.rundir.files import read_json
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.settings import RuntimeSettings

SAVE_MARGIN = 1.25  # the slowest recent save, x this: the next save may be a little slower
RECENT = 5  # segments whose saves count (the filesystem's speed today, not a month ago)


def measured_lead_s(slowest_save_s: float, step_s: float, delay_s: float, margin_s: float,
                    factor: float = SAVE_MARGIN) -> int:
    """LEAD = slowest save x factor + one step + how late the signal may come + margin."""
    return math.ceil(slowest_save_s * factor + step_s + delay_s + margin_s)


@dataclass(frozen=True)
class LeadPlan:
    rendered: int
    lead: int
    slowest_save_s: float | None = None
    slowest_job: str | None = None
    step_s: float = 0.0
    capped: bool = False  # the measure asked for more than the time limit leaves (max_signal_lead_s)

    @property
    def raised(self) -> bool:
        return self.lead > self.rendered

    def record(self) -> dict[str, Any]:
        return {"from": self.rendered, "to": self.lead, "slowest_save_s": self.slowest_save_s,
                "slowest_save_job": self.slowest_job, "step_s": round(self.step_s, 3), "factor": SAVE_MARGIN,
                **({"capped": True} if self.capped else {})}


def segment_saves(timeline: dict[str, Any]) -> list[float]:
    """Seconds from each save's start until its checkpoint was complete."""
    spans = timeline.get("writes") or timeline.get("saves") or []
    return [float(s[2]) - float(s[1]) for s in spans if isinstance(s, list) and len(s) == 3]


def segment_step_s(timeline: dict[str, Any]) -> float | None:
    """The mean step between the first and the last iteration, blocking saves left out."""
    ph, its = timeline.get("phases") or {}, timeline.get("iterations") or {}
    first, last = its.get("first"), its.get("last")
    if not isinstance(first, int) or not isinstance(last, int) or last <= first:
        return None
    t0, t1 = ph.get("first_iteration_end"), ph.get("last_iteration_end")
    if not isinstance(t0, (int, float)) or not isinstance(t1, (int, float)):
        return None
    saving = sum(float(e) - float(b) for _, b, e in timeline.get("saves") or [] if t0 <= float(b) <= t1)
    return max(0.0, (t1 - t0 - saving) / (last - first))


def plan_lead(paths: RunPaths, settings: RuntimeSettings, events: list[dict[str, Any]] | None = None,
              recent: int = RECENT) -> LeadPlan | None:
    """The lead for the next segment (None: a run made before the rendered lead was recorded)."""
    if settings.signal_lead_s is None:
        return None
    rendered = int(settings.signal_lead_s)
    segments = [s for s in Ledger(paths).segments(events) if s.started is not None][-recent:]
    slowest: tuple[float, str] | None = None
    step = settings.step_time_estimate_s
    for s in segments:
        timeline = read_json(paths.timeline(s.job_id))
        if not isinstance(timeline, dict):
            continue
        for seconds in segment_saves(timeline):
            if slowest is None or seconds > slowest[0]:
                slowest = (seconds, s.job_id)
        step = max(step, segment_step_s(timeline) or 0.0)
    if slowest is None:
        return LeadPlan(rendered, rendered)
    lead = measured_lead_s(slowest[0], step, settings.signal_delay_s, settings.signal_margin_s)
    cap = settings.max_signal_lead_s  # a lead past it would leave a segment less than min_train_time_s
    capped = cap is not None and lead > cap
    lead = min(lead, cap) if cap is not None else lead
    return LeadPlan(rendered, max(rendered, lead), round(slowest[0], 3), slowest[1], step, capped)


def safe_plan(paths: RunPaths, settings: RuntimeSettings, log: Callable[[str], None]) -> LeadPlan | None:
    """`plan_lead`, or None (the rendered lead stands) when the timelines cannot be read."""
    try:
        return plan_lead(paths, settings)
    except Exception as e:  # accounting must never stop the chain
        log(f"could not compute the signal lead from the measured saves: {e}")
        return None


def record_lead(ledger: Ledger, job_id: str, lead: LeadPlan, log: Callable[[str], None]) -> None:
    ledger.append("lead_raised", job_id=job_id, **lead.record())
    log(f"signal lead of {job_id} raised {lead.rendered} -> {lead.lead} s (slowest recent save "
        f"{lead.slowest_save_s} s)" + ("; capped by the time limit less chain.min_train_time_s: raise "
                                       "cluster.time" if lead.capped else ""))


def stop_lines(events: list[dict[str, Any]]) -> list[str]:
    """For `status`: the leads raised, and the periodic saves skipped inside the signal window."""
    out = []
    for e in events:
        if e.get("event") == "lead_raised":
            out.append(f"job {e.get('job_id')}: signal lead raised {e.get('from')} -> {e.get('to')} s "
                       f"(slowest recent save {e.get('slowest_save_s')} s, job {e.get('slowest_save_job')})"
                       + ("; capped by the time limit: raise cluster.time" if e.get("capped") else ""))
        elif e.get("event") == "save_skipped" and e.get("reason") == "inside the signal window":
            out.append(f"job {e.get('job_id')}: periodic save at iteration {e.get('iteration')} skipped inside the "
                       f"signal window ({e.get('to_limit_s')} s to the limit); the stop save took its place")
    return out
