"""The self-requeuing chain (docs/architecture.md, "The chain"): what `megalaunch job begin` and `job end` decide.

A segment's fate is read from state: outcome.json (written by the trainer, tagged with the job id),
the checkpoint tracker and the ledger, never from the exit status alone. Both backends use this
module; they differ only in how a successor is queued and a job cancelled (`backend.JobControl`).
Here: the decisions and the crash-loop guard; a segment's fate and clean-up are `segment_end`'s,
queueing the successor is `successor`'s, the bad nodes are `suspects`'."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from megalaunch.launcher.accounting.evidence import abnormal_ends
from megalaunch.launcher.chain.backend import JobControl
from megalaunch.launcher.chain.first_stage import (
    convert_from_hf,
    score_teacher,
    stage_work_pending,
    tokenize_chats,
)
from megalaunch.launcher.chain.last_stage import export_hf
from megalaunch.launcher.chain.notify import Notifier, StopKind
from megalaunch.launcher.chain.segment_end import (
    advanced,
    remove_failed_saves,
    settle_tracker,
    what_ended,
    write_goodput,
)
from megalaunch.launcher.chain.successor import Successor
from megalaunch.launcher.chain.suspects import Suspects
from megalaunch.rundir.hostlist import expand_hostlist
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.resume_request import requested_iteration
from megalaunch.rundir.state import read_outcome
from megalaunch.rundir.triggers import VERB_DECISION, TriggerBox
from megalaunch.rundir.trust import check_layout, check_path, tighten, verify_trusted
from megalaunch.runtime.checkpoint.resume import resume_point
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.rank.storage import free_bytes

STOP_EXIT_CODE = 100  # `job begin` exit status meaning "the chain is over, do not train"


@dataclass(frozen=True)
class Verdict:
    proceed: bool  # begin: train now / end: the chain goes on
    reason: str
    needs_person: bool = False  # a pause (not a stop) that a person must resume: chain.notify tells


def log(message: str) -> None:
    print(f"megalaunch: {message}", file=sys.stderr, flush=True)


class Chain:
    def __init__(self, paths: RunPaths, scheduler: JobControl, settings: RuntimeSettings | None = None) -> None:
        self.paths = paths
        self.scheduler = scheduler
        self.settings = settings or RuntimeSettings.load(paths)  # the job's slice, not the whole recipe
        self.ledger = Ledger(paths)
        self.notifier = Notifier(paths, self.ledger, self.settings.notify)  # chain.notify (launcher/chain/notify.py)
        self.suspects = Suspects(paths, self.settings, self.ledger, scheduler, log)  # launcher/chain/suspects.py
        self.successor = Successor(paths, self.settings, self.ledger, scheduler, self.suspects, log)

    # ----------------------------------------------------------------------------------- begin
    def begin(self, job_id: str) -> Verdict:
        """Run at the start of every segment, before training."""
        untrusted = self._check_trust(job_id)
        if untrusted is not None:
            return untrusted
        self._account_for_vanished(job_id)
        restart = os.environ.get("SLURM_RESTART_COUNT")
        stopped = self.ledger.stopped()
        if stopped is not None or self.paths.cancel_requested.exists():
            reason = stopped["reason"] if stopped else "cancel requested"
            self.ledger.append("skipped", job_id=job_id, reason=reason)
            return Verdict(False, f"chain already stopped: {reason}")
        iteration = resume_point(self.paths)
        requested = requested_iteration(self.paths)  # a pending `megalaunch resume --from`: training starts there
        box = TriggerBox(self.paths)
        pending = box.pending()
        for verb in ("abort", "exit"):
            if verb in pending:
                decision = VERB_DECISION[verb]
                by = ""
                for rec in box.consume_for(decision, iteration, job_id):
                    self.ledger.append("trigger", job_id=job_id, verb=rec["verb"], iteration=iteration,
                                       requested_by=rec.get("user"), reason=rec.get("reason"),
                                       when="before training")
                    by = _who(rec) if rec["verb"] == verb else by
                return self.stop(job_id, f"{verb} trigger{by} pending at segment start", kind="by_user")
        stopped_by_guard = self._guard(job_id, record_continue=False)
        if stopped_by_guard is not None:
            return stopped_by_guard
        target = self.settings.train_iters
        start = iteration if requested is None else requested
        if start is not None and start >= target:
            return self.stop(job_id, f"training already reached its target (iteration {start})", kind="finished")
        # With first-stage work (tokenizing, converting, a teacher's scores) the successor is queued first: a long
        # stage may outlive this segment's time limit, and a job Slurm ends then never reaches `job end`. A stage
        # that fails stops the chain, which cancels it.
        post = getattr(self.settings, "post_training", None)
        early = stage_work_pending(self.paths, self.settings.chat_files, self.settings.from_hf, post)
        if early:
            self._queue_successor(job_id)
        if self.settings.chat_files and (failed := tokenize_chats(self.paths, self.settings.chat_files, job_id, log)):
            return self.stop(job_id, failed.reason, fix=failed.fix)
        if self.settings.from_hf and (failed := convert_from_hf(self.paths, self.settings.from_hf, job_id, log)):
            return self.stop(job_id, failed.reason, fix=failed.fix)
        if failed := score_teacher(self.paths, post, job_id, log):  # distill
            return self.stop(job_id, failed.reason, fix=failed.fix)
        self.ledger.append("started", job_id=job_id, checkpoint_iteration=iteration,
                           nodes=os.environ.get("SLURM_JOB_NODELIST"), restart_count=restart,
                           **({} if requested is None else {"resume_from": requested}))
        if not early:
            self._queue_successor(job_id)
        log(f"segment {job_id} starts at checkpoint iteration {iteration}")
        return Verdict(True, "train")

    def _queue_successor(self, job_id: str) -> None:
        if not self.settings.auto_requeue:
            return
        try:
            self.successor.queue(f"segment {job_id}")
        except Exception as e:  # Slurm did not answer: train anyway, `job end` queues it (unknown != failed)
            self.ledger.append("successor_not_queued", job_id=job_id, when="begin", error=str(e))
            log(f"could not queue the successor now ({e}); training anyway, `job end` tries again")

    def _check_trust(self, job_id: str) -> Verdict | None:
        """Before anything runs: the run directory is the owner's and nobody else can swap it, and every
        file the job executes or reads as configuration is the one the owner recorded
        (docs/security.md). A run made by an older megalaunch gets the current modes first."""
        from megalaunch.errors import RunDirError

        try:
            check_path(self.paths.root)
        except (RunDirError, OSError) as e:  # not the owner's run: write nothing into it
            fix = getattr(e, "fix", None)
            log(f"refusing to run: {getattr(e, 'message', e)}" + (f"\n  fix: {fix}" if fix else ""))
            return Verdict(False, f"untrusted run directory: {getattr(e, 'message', e)}")
        try:
            changed = tighten(self.paths)
            if changed:
                self.ledger.append("modes_tightened", job_id=job_id, changed=changed)
                log(f"run directory modes tightened: {', '.join(changed)}")
            check_layout(self.paths)
            verify_trusted(self.paths)
        except (RunDirError, OSError) as e:
            reason = e.message if isinstance(e, RunDirError) else str(e)
            log(f"refusing to run: {reason}")
            return self.stop(job_id, f"untrusted run directory: {reason}",
                             fix=getattr(e, "fix", None) or "submit the recipe again")
        return None

    def _account_for_vanished(self, current: str) -> None:
        """A segment that started but never reached `job end` (killed, node failure) is recorded as
        ended by the next segment, so the crash-loop budget sees it."""
        for seg in self.ledger.segments(self.ledger.current_epoch()):
            if seg.started is None or seg.ended is not None or seg.job_id == current:
                continue
            state = self.scheduler.state(seg.job_id)
            start_iter = seg.started.get("checkpoint_iteration")
            now = resume_point(self.paths)
            outcome = read_outcome(self.paths, seg.job_id)
            lost = self.suspects.after_node_failure(seg.job_id, state)
            self.ledger.append("ended", job_id=seg.job_id, outcome=(outcome or {}).get("status", "killed"),
                               slurm_state=state, exit_code=None, checkpoint_iteration=now,
                               new_checkpoint=advanced(start_iter, now), accounted_by=current,
                               **({"lost_nodes": lost} if lost else {}))

    def batch_host_lost(self, job_id: str, host: str, keeper_node: str, why: str | None = None) -> None:
        """The keeper (launcher/backends/keeper.py) saw Slurm take this job's batch host out of the running job,
        or the host stop beating (`why`, runtime/health/node_beat.py): the job script, and with it `job end`,
        is gone. The segment is recorded as ended (its host lost, a suspect) before the keeper cancels the job
        and the successor starts."""
        segment = next((s for s in self.ledger.segments() if s.job_id == job_id and s.started), None)
        if segment is not None and segment.ended is not None:  # `job end` ran: the script was not lost
            return
        started = segment.started if segment is not None else None
        now = resume_point(self.paths)
        reason = f"its batch host {host} (the node of the job script) was lost" + (f" ({why})" if why else "")
        self.suspects.record_lost(job_id, [host], f"job {job_id}: {reason}")
        self.suspects.exclude_from(self.pending_successors(job_id))  # queued at `job begin`: kept off the host
        self.ledger.append("ended", job_id=job_id, outcome="killed", reason=reason, slurm_state="NODE_FAIL",
                           exit_code=None, checkpoint_iteration=now,
                           new_checkpoint=advanced((started or {}).get("checkpoint_iteration"), now),
                           accounted_by=f"{job_id}'s keeper on {keeper_node}", lost_nodes=[host])
        log(f"segment {job_id}: {reason}; its keeper on {keeper_node} cancels the job so that the successor starts")

    # ------------------------------------------------------------------------------------- end
    def end(self, job_id: str, exit_code: int | None) -> Verdict:
        """Run after the training step of a segment: record the outcome and decide the chain."""
        started = next((s.started for s in self.ledger.segments() if s.job_id == job_id and s.started), None)
        start_iter = started.get("checkpoint_iteration") if started else None
        now = resume_point(self.paths)
        outcome = read_outcome(self.paths, job_id)
        ends = abnormal_ends(self.paths, job_id, self.paths.segment_log(job_id))
        status, reason, fix, figures = what_ended(self.paths, self.ledger, job_id, outcome, ends, exit_code)
        new_ckpt = advanced(start_iter, now)
        if status == "failed":
            self.suspects.after_failure(job_id, ends, expand_hostlist(str((started or {}).get("nodes") or "")))
        elif status == "unhealthy_node":
            self.suspects.after_health_check(job_id, outcome or {})
        self.suspects.after_passed_check(job_id, outcome or {})
        remove_failed_saves(self.paths, job_id, log)
        settle_tracker(self.paths, job_id, log)
        if status == "storage_full":  # the figures after the unfinished save was removed
            full = figures.pop("_full")
            free_now = free_bytes(self.paths.checkpoints)
            reason, figures = full.reason(free_now), {"storage": full.record(free_now)}
        self.ledger.append("ended", job_id=job_id, outcome=status, reason=reason, exit_code=exit_code,
                           checkpoint_iteration=now, new_checkpoint=new_ckpt,
                           first_failure=ends[0].__dict__ if ends else None, **({"fix": fix} if fix else {}),
                           **figures, **self.ledger.step_progress(job_id, now))
        log(f"segment {job_id} ended: {status}" + (f" ({reason})" if reason else "")
            + f", checkpoint iteration {now}")
        write_goodput(self.paths, log)
        return self.notifier.segment_ended(job_id, status, self._after_end(job_id, status, reason, fix, now))

    def _after_end(self, job_id: str, status: str, reason: Any, fix: Any, now: int | None) -> Verdict:
        """Stop the chain, or let the queued successor resume."""
        if status == "finished":
            return self._finished(job_id, now)
        if status in ("exited", "aborted"):
            verb = "exit" if status == "exited" else "abort"
            what = "saved and stopped" if verb == "exit" else "stopped without saving"
            return self.stop(job_id, f"{verb} trigger{_requested_by(self.paths, verb, job_id)}: {what}", kind="by_user")
        if status == "config_error":
            return self.stop(job_id, f"configuration error, no retry can fix it: {reason}",
                             fix=str(fix) if fix else "correct the recipe, then submit it again")
        if status == "storage_full":
            return self.stop(job_id, f"storage full, no retry can fix it: {reason}", fix=fix)
        if self.paths.cancel_requested.exists():
            return self.stop(job_id, str(reason) if status == "cancelled" else "cancel requested", kind="by_user")
        if now is not None and now >= self.settings.train_iters:
            return self._finished(job_id, now)
        stopped_by_guard = self._guard(job_id, record_continue=True)
        if stopped_by_guard is not None:
            return stopped_by_guard
        if not self.settings.auto_requeue:
            return Verdict(False, "auto-requeue is off: one segment only")
        if status in ("failed", "unhealthy_node"):  # the successor queued at `job begin` stays off the suspects
            self.suspects.exclude_from(self.pending_successors(job_id))
        error = self.successor.queue_if_begin_could_not(job_id)  # one queued now excludes them from the start
        if error is not None:
            return Verdict(False, f"the successor could not be queued: Slurm did not answer ({error}); the chain "
                                  f"pauses, nothing is lost: megalaunch resume {self.paths.root}", needs_person=True)
        return Verdict(True, f"outcome {status}: the next segment resumes")

    def _finished(self, job_id: str, now: int | None) -> Verdict:
        """Training reached its target: the last stage (chain.export_hf), then the chain stops."""
        if self.settings.export_hf:
            export_hf(self.paths, job_id, log)
        return self.stop(job_id, f"training reached its target (iteration {now})", kind="finished")

    def _guard(self, job_id: str, *, record_continue: bool) -> Verdict | None:
        """The crash-loop budget: K consecutive segments without a new checkpoint stop the chain."""
        budget = self.settings.max_segments_without_progress
        failures = self.ledger.consecutive_without_progress()
        if failures >= budget:
            self.ledger.append("guard", job_id=job_id, decision="stop", failures=failures, budget=budget)
            return self.stop(job_id, f"{failures} consecutive segments without a new checkpoint (budget {budget})")
        if failures and record_continue:
            self.ledger.append("guard", job_id=job_id, decision="continue", failures=failures, budget=budget)
        return None

    # ------------------------------------------------------------------------------------ stop
    def pending_successors(self, current: str | None = None) -> list[str]:
        """Queued segments that never started: the successor(s) to cancel when the chain stops."""
        return [s.job_id for s in self.ledger.segments()
                if s.started is None and s.ended is None and not s.skipped and s.job_id != current]

    def stop(self, job_id: str | None, reason: str, *, fix: str | None = None, kind: StopKind = "needs_person") -> Verdict:
        """End the chain: cancel the queued successor by job id, record why, tell chain.notify (`kind`)."""
        successors = self.pending_successors(job_id)
        if successors:
            try:
                self.scheduler.cancel_jobs(successors)
            except Exception as e:  # a failed cancel must not lose the record of the decision
                log(f"could not cancel successor(s) {successors}: {e}")
        self.ledger.append("chain_stopped", job_id=job_id, reason=reason, cancelled=successors,
                           **({"fix": fix} if fix else {}))
        log(f"chain stopped: {reason}" + (f"; cancelled {', '.join(successors)}" if successors else "")
            + (f"\n  fix: {fix}" if fix else ""))
        self.notifier.chain_stopped(job_id, reason, fix, kind)
        return Verdict(False, reason)


def _who(record: dict[str, object]) -> str:
    """' by USER ("REASON")' from a trigger's audit record."""
    user, why = record.get("user"), record.get("reason")
    return (f" by {user}" if user else "") + (f' ("{why}")' if why else "")


def _requested_by(paths: RunPaths, verb: str, job_id: str) -> str:
    """Who asked for the exit/abort that this segment acted on, from the consumed trigger's record."""
    records = [r for r in TriggerBox(paths).consumed()
               if r.get("verb") == verb and str(r.get("consumed_by_job")) == str(job_id)]
    return _who(records[-1]) if records else ""

