"""`megalaunch resume RUN [--from ITER]` on the login node (docs/training.md, "Resume from a chosen
checkpoint").

With `--from`, everything that can be checked without torch is checked before anything is written:
the user may write the run directory, no segment of the chain is running or queued, ITER is a
checkpoint directory that has not been moved aside, below `training.train_iters`, and complete as far
as a reading without torch tells (`runtime.checkpoint.resume.incomplete_reason(full=False)`: metadata.json
parses, `.metadata` is there and names shard files that exist and are not empty). Then a one-shot
request (state/resume_request.json) is written and the chain restarted; rank 0 of the segment that
trains does the full check, applies the request (newer checkpoints moved aside as
`iter_N.abandoned-<job>`, a `resume_from` ledger record) or refuses it (a configuration error that
stops the chain), and renames the request either way."""

from __future__ import annotations

from dataclasses import dataclass

from megalaunch.errors import RunDirError
from megalaunch.launcher.chain.backend import Backend, Echo, Started
from megalaunch.rundir.access import require_writable
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.resume_request import (
    read_resume_request,
    withdraw_resume_request,
    write_resume_request,
)
from megalaunch.runtime.checkpoint.resume import checkpoint_iterations, incomplete_reason, iter_dir


@dataclass(frozen=True)
class ResumeFrom:
    """What `resume --from` will do: start at `iteration`, move `newer` aside."""

    iteration: int
    newer: list[int]  # checkpoint directories after it, complete or not: the job moves them aside
    complete: list[int]  # complete as far as the login node can tell


def check_not_live(paths: RunPaths, backend: Backend, action: str = "resume restarts") -> None:
    """`resume` acts only on a stopped chain: a live one would get a second line of segments, and a
    queued segment would start on changed files. `action` names what refuses (`resume --set changes`)."""
    live, error = backend.live(Ledger(paths).segments())
    if live:
        jobs = ", ".join(f"{job} ({state.state.lower()})" for job, state in sorted(live.items()))
        raise RunDirError(f"the chain still has a segment running or queued: {jobs}; {action} a "
                          "stopped chain", fix=f"megalaunch trigger exit {paths.root} (saves, then stops) or "
                          f"megalaunch cancel {paths.root}, then run this again")
    if error is not None:
        raise RunDirError(f"cannot tell whether a segment of the chain is still queued or running ({error})",
                          fix="try again when the scheduler answers")


def check_resume_from(paths: RunPaths, backend: Backend, iteration: int, train_iters: int) -> ResumeFrom:
    """Refuse (a one-line RunDirError) what the job would refuse or should not be asked to do."""
    require_writable(paths.state, *([paths.checkpoints] if paths.checkpoints.is_dir() else []))
    check_not_live(paths, backend, "resume --from restarts")
    iterations = checkpoint_iterations(paths)
    complete = [i for i in iterations if incomplete_reason(iter_dir(paths, i), full=False) is None]
    valid = ", ".join(map(str, complete)) if complete else "none (this run has no complete checkpoint)"
    if iteration not in iterations:
        aside = sorted(p.name for p in paths.checkpoints.glob(f"iter_{iteration:07d}.*")) \
            if iteration >= 0 and paths.checkpoints.is_dir() else []
        what = f"was moved aside ({', '.join(aside)})" if aside else "does not exist"
        raise RunDirError(f"the checkpoint of iteration {iteration} {what}", field="--from",
                          valid=f"complete checkpoints: {valid}")
    reason = incomplete_reason(iter_dir(paths, iteration), full=False)
    if reason is not None:
        raise RunDirError(f"the checkpoint of iteration {iteration} is incomplete ({reason})", field="--from",
                          valid=f"complete checkpoints: {valid}")
    if iteration >= train_iters:
        raise RunDirError(f"iteration {iteration} is already at the target (training.train_iters {train_iters}): "
                          "nothing would be trained", field="--from", valid=f"below {train_iters}")
    return ResumeFrom(iteration, [i for i in iterations if i > iteration], complete)


def describe(plan: ResumeFrom) -> str:
    if not plan.newer:
        return f"resuming from iteration {plan.iteration} (the newest checkpoint: none is moved aside)"
    return (f"resuming from iteration {plan.iteration}; checkpoint{'s' if len(plan.newer) > 1 else ''} "
            f"{', '.join(map(str, plan.newer))} will be moved aside (kept as iter_NNNNNNN.abandoned-<job id>)")


def resume_chain(paths: RunPaths, backend: Backend, echo: Echo, *, from_iteration: int | None = None,
                 train_iters: int) -> Started:
    """Restart a stopped chain from its newest checkpoint, or, with `from_iteration`, check, write the
    one-shot request and restart it from there (the request is taken back if the restart fails)."""
    if from_iteration is None:
        withdrawn = withdraw_resume_request(paths)
        if withdrawn is not None:  # a `--from` that no segment got to apply: plain resume means the newest
            Ledger(paths).append("resume_request_withdrawn", iteration=withdrawn.get("iteration"),
                                 requested_by=withdrawn.get("user"))
            echo(f"withdrew the pending request to resume from iteration {withdrawn.get('iteration')} "
                 "(no segment had applied it)")
        return backend.resume(paths, echo)
    plan = check_resume_from(paths, backend, from_iteration, train_iters)
    try:
        previous = read_resume_request(paths)
    except ValueError:
        previous = None
    if previous is not None and previous["iteration"] != plan.iteration:
        echo(f"replacing the pending request to resume from iteration {previous['iteration']}")
    echo(describe(plan))
    write_resume_request(paths, plan.iteration)
    try:
        return backend.resume(paths, echo, from_iteration=plan.iteration)
    except BaseException:
        if withdraw_resume_request(paths) is not None:
            echo(f"the chain did not restart: withdrew the request to resume from iteration {plan.iteration}")
        raise
