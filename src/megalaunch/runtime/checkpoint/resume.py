"""Which checkpoint to resume from, and which ones to keep.

Only complete checkpoints are trusted (`incomplete_reason`, runtime/checkpoint/completeness.py says what complete is).

Rank 0 plans; the others follow the plan through a broadcast. Checkpoints that cannot be used are
renamed (`iter_0000200.incomplete-<job>`, `.unreadable-<job>`, `.abandoned-<job>`), and every such
step is a ledger record. Which checkpoints retention keeps is runtime/checkpoint/retention.py's. Incomplete saves
are garbage (nothing can load them): retention deletes those moved aside, and the trainer (on
`storage_full`) and `job end` delete the one their own segment failed to finish (`remove_failed_saves`).
Unreadable and abandoned ones are kept for a person to look at."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import append_jsonl, atomic_write_text
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.resume_request import read_resume_request, settle_resume_request
from megalaunch.runtime.checkpoint.completeness import incomplete_reason

ITER_RE = re.compile(r"^iter_(\d{7})$")
INCOMPLETE_RE = re.compile(r"^iter_(\d{7})\.incomplete-[^/]+$")  # moved aside by `plan_resume`


def iter_dir(paths: RunPaths, iteration: int) -> Path:
    return paths.checkpoints / f"iter_{iteration:07d}"


def checkpoint_iterations(paths: RunPaths) -> list[int]:
    """Iterations with an `iter_NNNNNNN` directory, oldest first (complete or not)."""
    try:
        names = os.listdir(paths.checkpoints)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := ITER_RE.match(n)) and (paths.checkpoints / n).is_dir())


def read_tracker(paths: RunPaths) -> int | str | None:
    """The tracker's iteration; "garbled" when it exists but holds no iteration; None when absent."""
    try:
        text = paths.tracker.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return "garbled"
    if text.isdigit():
        return int(text)
    return "garbled"


def is_complete(paths: RunPaths, iteration: int) -> bool:
    return incomplete_reason(iter_dir(paths, iteration)) is None


@dataclass
class ResumePlan:
    """Rank 0's choice. `iteration` None: start from scratch."""

    iteration: int | None
    events: list[dict[str, Any]] = field(default_factory=list)


def plan_resume(paths: RunPaths, *, job_id: str | None, requested: int | None = None,
                skip: set[int] | frozenset[int] = frozenset()) -> ResumePlan:
    """Choose the newest complete checkpoint (or `requested`), move unusable newer ones aside, make
    the tracker name the choice, and return the plan with its ledger events (already appended).

    Without `requested`, a pending `megalaunch resume --from` request (state/resume_request.json) is
    applied and then renamed (`.done-<job>`), or, when its checkpoint is unusable, renamed
    (`.refused-<job>`) and refused with ValueError: either way only this segment acts on it."""
    tracker = read_tracker(paths)
    iterations = [i for i in checkpoint_iterations(paths) if i not in skip]
    plan = ResumePlan(None)

    def event(name: str, **data: Any) -> None:
        record = {"event": name, "time": time.time(), "job_id": job_id, **data}
        plan.events.append(record)
        append_jsonl(paths.ledger, record)

    request: dict[str, Any] | None = None
    if requested is None:
        try:
            request = read_resume_request(paths)
        except ValueError as e:
            settle_resume_request(paths, "refused", job_id)
            event("resume_refused", iteration=None, reason=str(e))
            raise
        if request is not None:
            requested = int(request["iteration"])
    if requested is not None:
        plan.iteration = _plan_requested(paths, requested, request, iterations, job_id, event)
    else:
        plan.iteration = _plan_newest(paths, tracker, iterations, job_id, event)
    _point_tracker(paths, plan.iteration)
    return plan


def _plan_requested(paths: RunPaths, requested: int, request: dict[str, Any] | None, iterations: list[int],
                    job_id: str | None, event: Callable[..., None]) -> int:
    """`requested` if it is complete (newer checkpoints moved aside as abandoned); ValueError if not."""
    asked = (f"megalaunch resume --from {requested} (by {request.get('user', '?')})" if request is not None
             else f"--resume-from {requested}")
    reason = incomplete_reason(iter_dir(paths, requested))
    if reason is not None:
        complete = [i for i in iterations if is_complete(paths, i)]
        if request is not None:
            settle_resume_request(paths, "refused", job_id)
            event("resume_refused", iteration=requested, reason=reason, complete=complete,
                  requested_by=request.get("user"))
        raise ValueError(f"{asked}: checkpoint {requested} is not usable ({reason}); "
                         f"complete ones: {complete or 'none'}")
    for newer in (i for i in iterations if i > requested):
        _move_aside(paths, newer, "abandoned", job_id)
    event("resume_from", iteration=requested, abandoned=[i for i in iterations if i > requested],
          **({"requested_by": request.get("user"), "requested_at": request.get("time")} if request else {}))
    if request is not None:
        settle_resume_request(paths, "done", job_id)
    return requested


def _plan_newest(paths: RunPaths, tracker: int | str | None, iterations: list[int], job_id: str | None,
                 event: Callable[..., None]) -> int | None:
    """The newest complete checkpoint (newer incomplete ones moved aside), or None: from scratch."""
    chosen: int | None = None
    rejected: list[dict[str, Any]] = []
    for candidate in reversed(iterations):
        reason = incomplete_reason(iter_dir(paths, candidate))
        if reason is None:
            chosen = candidate
            break
        rejected.append({"iteration": candidate, "reason": reason})
    for r in rejected:
        _move_aside(paths, r["iteration"], "incomplete", job_id)
    newest = tracker if isinstance(tracker, int) else (iterations[-1] if iterations else None)
    if rejected or tracker == "garbled" or (tracker is not None and tracker != chosen):
        event("resume_fallback", tracker=tracker, newest=newest, to=chosen, rejected=rejected)
    return chosen


def fall_back_from(paths: RunPaths, iteration: int, error: BaseException, job_id: str | None) -> int | None:
    """A checkpoint that passed the completeness check failed to load. If an older complete one
    exists: move the bad one aside, point the tracker at the older one, record it, return it.
    Otherwise change nothing and return None (the segment fails; nothing is thrown away)."""
    older = [i for i in checkpoint_iterations(paths) if i < iteration and is_complete(paths, i)]
    if not older:
        return None
    _move_aside(paths, iteration, "unreadable", job_id)
    _point_tracker(paths, older[-1])
    append_jsonl(paths.ledger, {"event": "resume_fallback", "time": time.time(), "job_id": job_id,
                                "unreadable": iteration, "to": older[-1], "reason": one_line(error)})
    return older[-1]


def one_line(error: BaseException) -> str:
    """The error's first line with its class; a megalaunch error's own sentence (field, fix) as it is."""
    from megalaunch.errors import MegalaunchError

    prefix = "" if isinstance(error, MegalaunchError) else f"{type(error).__name__}: "
    text = f"{prefix}{error}".strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def _move_aside(paths: RunPaths, iteration: int, why: str, job_id: str | None) -> None:
    src = iter_dir(paths, iteration)
    if src.exists():
        os.replace(src, src.with_name(f"{src.name}.{why}-{job_id or os.getpid()}"))


def _point_tracker(paths: RunPaths, iteration: int | None) -> None:
    current = read_tracker(paths)
    if iteration is None:
        if current is not None:
            os.replace(paths.tracker, paths.tracker.with_name(paths.tracker.name + ".invalid"))
    elif current != iteration:
        atomic_write_text(paths.tracker, f"{iteration}\n")


# --- a segment's unfinished save (retention: runtime/checkpoint/retention.py) -----------------------------

def resume_point(paths: RunPaths) -> int | None:
    """The iteration the next step resumes from, as far as can be told without torch once every rank has
    exited: the newest checkpoint that is complete (`full=False`) when it is newer than the tracker's, else the
    tracker's; None: none. A save can be whole on disk with the tracker never moved to it: a rank killed
    in the save's last barrier, after every file was written (CI saw it: `plan_resume` then resumed from
    iteration 15 while the tracker said 10). `plan_resume` makes the same choice with the full check."""
    floor = paths.read_tracker()  # "release" (a converted checkpoint) is 0; unreadable: None
    for iteration in reversed(checkpoint_iterations(paths)):
        if floor is not None and iteration <= floor:
            break
        if incomplete_reason(iter_dir(paths, iteration), full=False) is None:
            return iteration
    return floor


def settle_tracker(paths: RunPaths, *, job_id: str | None) -> int | None:
    """`job end`, every rank gone: the tracker names a whole save newer than it (`resume_point`, then the full
    check), as the next `plan_resume` would, for `status`, `convert` and evaluation of a chain that stops here.
    Returns the iteration moved to (ledger `tracker_moved`), or None; an unreadable tracker is plan_resume's."""
    tracker = read_tracker(paths)
    point = resume_point(paths)
    if point is None or tracker == "garbled" or (isinstance(tracker, int) and point <= tracker):
        return None
    if incomplete_reason(iter_dir(paths, point)) is not None:
        return None
    _point_tracker(paths, point)
    append_jsonl(paths.ledger, {"event": "tracker_moved", "time": time.time(), "job_id": job_id, "from": tracker,
                                "to": point, "reason": "a whole save the tracker never named"})
    return point


def remove_failed_saves(paths: RunPaths, *, job_id: str | None) -> list[int]:
    """At the end of a segment, when every rank has exited: delete the checkpoint directories newer
    than the newest complete one that are incomplete (as far as can be told without torch), i.e. the
    saves this segment started and never finished (a failed or interrupted save; an iteration newer
    than every complete one can only be this segment's). Megatron writes the tracker after a save
    finishes, so nothing at or below the tracker's iteration is touched, and nothing at all while the
    tracker is unreadable. Returns the iterations deleted."""
    if read_tracker(paths) == "garbled":
        return []
    floor = resume_point(paths)
    failed = [i for i in checkpoint_iterations(paths) if i > (-1 if floor is None else floor)]
    for iteration in failed:
        reason = incomplete_reason(iter_dir(paths, iteration), full=False)
        delete_directory(iter_dir(paths, iteration))
        append_jsonl(paths.ledger, {"event": "incomplete_checkpoint_deleted", "time": time.time(), "job_id": job_id,
                                    "iteration": iteration, "directory": iter_dir(paths, iteration).name,
                                    "reason": reason})
    return failed


DELETING_RE = re.compile(r"^\.deleting-.+-(\d+)$")  # renamed by delete_directory, being (or left half) deleted
_deleters: list[threading.Thread] = []


def delete_directory(directory: Path, *, background: bool = False) -> None:
    """Rename first, so a half-deleted directory never looks like a checkpoint; then delete, here or, with
    `background`, in a thread (a 17 GB checkpoint takes ~7 s to unlink: retention after a save must not
    stop training for it; wait_for_deletions before free space is measured). A deletion the process did
    not finish is a `.deleting-*` directory that sweep_deletions removes later."""
    doomed = directory.with_name(f".deleting-{directory.name}-{os.getpid()}")
    os.replace(directory, doomed)
    if not background:
        shutil.rmtree(doomed, ignore_errors=True)
        return
    thread = threading.Thread(target=shutil.rmtree, args=(doomed,), kwargs={"ignore_errors": True},
                              name=f"delete-{directory.name}", daemon=True)
    thread.start()
    _deleters.append(thread)


def wait_for_deletions(timeout: float | None = None) -> None:
    """Until this process's background deletions are done (the space they free is then free)."""
    for thread in list(_deleters):
        thread.join(timeout)
        if not thread.is_alive():
            _deleters.remove(thread)


def sweep_deletions(checkpoints: Path, *, background: bool = False) -> list[str]:
    """Delete what an ended process left half-deleted (`.deleting-*` of another pid). Returns the names."""
    try:
        names = sorted(n for n in os.listdir(checkpoints)
                       if (m := DELETING_RE.match(n)) and int(m.group(1)) != os.getpid())
    except FileNotFoundError:
        return []
    for name in names:
        if background:
            thread = threading.Thread(target=shutil.rmtree, args=(checkpoints / name,), kwargs={"ignore_errors": True},
                                      name=f"sweep-{name}", daemon=True)
            thread.start()
            _deleters.append(thread)
        else:
            shutil.rmtree(checkpoints / name, ignore_errors=True)
    return names


# --- the data blend this run trains on -----------------------------------------------------------

def blend_hash(paths: RunPaths) -> str | None:
    try:
        return hashlib.sha256(paths.data_blend.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def approved_blend(paths: RunPaths) -> str | None:
    """The blend sha256 that `megalaunch resume RUN --set` last recorded as the run's new blend (its
    `settings_changed` ledger event), or None when no command ever changed the blend."""
    from megalaunch.rundir.files import read_jsonl

    for event in reversed(read_jsonl(paths.ledger)):
        change = event.get("blend_sha256") if event.get("event") == "settings_changed" else None
        if isinstance(change, dict) and change.get("old") != change.get("new"):
            return str(change.get("new"))
    return None


def unapproved_blend_change(paths: RunPaths, *, allow_change: bool = False) -> tuple[str, str] | None:
    """(trained-on, current) sha256 when RUN/data_blend.txt differs from the blend the checkpoints were
    trained on and neither `resume --set` recorded the change nor the recipe allows any change."""
    current = blend_hash(paths)
    try:
        previous = paths.blend_hash.read_text().strip()
    except FileNotFoundError:
        previous = None
    if not (previous and current and previous != current and checkpoint_iterations(paths)):
        return None
    if allow_change or approved_blend(paths) == current:
        return None
    return previous, current


def blend_change_refusal(paths: RunPaths, previous: str, current: str) -> str:
    return (f"RUN/data_blend.txt changed since the checkpoints were written (sha256 {previous[:12]} -> "
            f"{current[:12]}) without `megalaunch resume --set`; restore it, or change the blend with "
            f"megalaunch resume {paths.root} --set data.blend_file=FILE (or data.blend=[...]), which records the change")


def check_blend(paths: RunPaths, *, allow_change: bool, write: bool, job_id: str | None) -> None:
    """Refuse to resume on a data blend other than the one the checkpoints were trained on (the
    hash is recorded next to them the first time), unless `megalaunch resume --set` recorded the
    change (or the recipe allows any change)."""
    current = blend_hash(paths)
    record = paths.blend_hash
    try:
        previous = record.read_text().strip()
    except FileNotFoundError:
        previous = None
    refused = unapproved_blend_change(paths, allow_change=allow_change)
    if refused is not None:
        raise BlendChanged(blend_change_refusal(paths, *refused))
    if previous and current and previous != current and checkpoint_iterations(paths) and write:
        append_jsonl(paths.ledger, {"event": "blend_changed", "time": time.time(), "job_id": job_id,
                                    "previous": previous, "current": current})
    if write and current and current != previous:
        paths.checkpoints.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, current + "\n")


class BlendChanged(ValueError):
    """The data blend differs from the one the checkpoints were trained on."""
