"""Which checkpoints stay on disk, and whether the next save fits (issue 23; docs/training.md,
"Checkpoints and disk").

The rule (`keep`, a pure function over iteration lists, shared by the job and `megalaunch status`):
`keep_last: N` keeps the N newest complete checkpoints, so that at most N complete ones are on disk
plus the one being written. Milestones (multiples of `milestone_interval`) and checkpoints an
evaluation still waits for are kept as well and not counted in N. The checkpoint this segment resumed
from is kept only while no newer complete one exists. Anything newer than the newest complete
checkpoint is never touched (a save may be writing it); incomplete leftovers older than it are garbage.
`keep_last` < 1 keeps everything.

Before a save (`check_space`, rank 0): the bytes one checkpoint needs are the measured size of the
newest complete checkpoint on disk (the prediction made at render time when there is none yet), plus
what an unfinished newer save still has to write; when they do not fit, what the rule allows is
deleted first and the space measured again. A save that still does not fit is never started:
a periodic or `save`-trigger save is skipped (training goes on), a stop save ends the segment
`storage_full`."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megalaunch.rundir.files import append_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint.resume import (
    INCOMPLETE_RE,
    checkpoint_iterations,
    delete_directory,
    is_complete,
    iter_dir,
    read_tracker,
    sweep_deletions,
)
from megalaunch.runtime.rank.storage import describe, free_bytes, free_inodes

MARGIN = 0.05  # room asked for beyond one checkpoint's bytes (metadata, file-system rounding)


@dataclass(frozen=True)
class Kept:
    """`keep`'s answer: why each complete checkpoint stays, and what may go."""

    last: list[int]  # the newest `keep_last` ones that are neither milestones nor waiting for an eval
    milestones: list[int]
    waiting_eval: list[int]
    resumed: list[int]  # resumed from, no newer complete one yet (outside `last` only with keep_last 0)
    protected: list[int]  # asked for by the caller (the tracker's, the one just loaded), outside the above
    doomed: list[int] = field(default_factory=list)  # complete and incomplete ones retention deletes

    def counts(self) -> dict[str, int]:
        return {"keep_last": len(self.last), "milestones": len(self.milestones), "waiting_eval": len(self.waiting_eval),
                "other": len(self.resumed) + len(self.protected)}


def keep(present: Sequence[int], complete: Iterable[int], *, keep_last: int, milestone_interval: int = 0,
         eval_pending: Iterable[int] = (), resumed_from: int | None = None, protect: Iterable[int] = ()) -> Kept:
    """The retention rule over iteration lists: `present`, every `iter_*` directory; `complete`, those
    that are complete."""
    done = sorted(set(complete) & set(present))
    newest = done[-1] if done else None
    milestones = [i for i in done if milestone_interval > 0 and i % milestone_interval == 0]
    pending = set(eval_pending)
    waiting = [i for i in done if i in pending and i not in milestones]
    regular = [i for i in done if i not in milestones and i not in pending]
    last = regular[-keep_last:] if keep_last >= 1 else regular
    named = {*last, *milestones, *waiting}
    resumed = [newest] if newest is not None and resumed_from == newest and newest not in named else []
    protected = sorted({i for i in protect if i in done} - named - set(resumed))
    kept = named | set(resumed) | set(protected)
    doomed = [i for i in present if newest is not None and i < newest and i not in kept] if keep_last >= 1 else []
    return Kept(last, milestones, waiting, resumed, protected, doomed)


# --- on disk --------------------------------------------------------------------------------------

def prune(paths: RunPaths, *, keep_last: int, milestone_interval: int = 0, eval_pending: Iterable[int] = (),
          resumed_from: int | None = None, protect: Iterable[int] = (), job_id: str | None = None,
          background: bool = False) -> list[int]:
    """Apply `keep` to the run's checkpoints (the tracker's iteration is protected too) and delete the
    incomplete saves `plan_resume` moved aside and what an ended process left half-deleted. Returns the
    deleted iterations; each is a ledger event (written once the directory is renamed away). `background`:
    the files are unlinked in a thread (resume.delete_directory), off the training loop."""
    if keep_last < 1:
        return []
    present = checkpoint_iterations(paths)
    complete = [i for i in present if is_complete(paths, i)]
    tracker = read_tracker(paths)
    protect = {*protect, *([tracker] if isinstance(tracker, int) else [])}
    doomed = keep(present, complete, keep_last=keep_last, milestone_interval=milestone_interval,
                  eval_pending=eval_pending, resumed_from=resumed_from, protect=protect).doomed
    for iteration in doomed:
        delete_directory(iter_dir(paths, iteration), background=background)
        _record(paths, {"event": "checkpoint_deleted", "time": time.time(), "job_id": job_id, "iteration": iteration})
    prune_incomplete(paths, job_id=job_id, background=background)
    return doomed


def prune_incomplete(paths: RunPaths, *, job_id: str | None, background: bool = False) -> list[str]:
    """Delete the incomplete saves `plan_resume` moved aside (`iter_N.incomplete-<job>`). No job
    writes one: a segment renames it when it starts, after the segment that wrote it has ended (the
    chain runs one segment at a time), and a live save is never renamed. Returns the names deleted."""
    try:
        names = sorted(n for n in os.listdir(paths.checkpoints) if INCOMPLETE_RE.match(n))
    except FileNotFoundError:
        return []
    for name in names:
        delete_directory(paths.checkpoints / name, background=background)
        _record(paths, {"event": "incomplete_checkpoint_deleted", "time": time.time(), "job_id": job_id,
                        "iteration": int(name[5:12]), "directory": name})
    sweep_deletions(paths.checkpoints, background=background)
    return names


def _record(paths: RunPaths, record: dict[str, object]) -> None:
    """A ledger line; on a full filesystem (the reason retention may be running) it is said, not raised."""
    try:
        append_jsonl(paths.ledger, record)
    except OSError as e:
        print(f"[megalaunch] ledger {record['event']} not written: {e}", flush=True)


def bytes_on_disk(directory: Path) -> int:
    """What the files under `directory` take: per file its length or its allocated blocks, the larger."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += max(st.st_size, st.st_blocks * 512)
    return total


class Sizes:
    """The measured size of complete checkpoints (a complete checkpoint never changes: measured once)."""

    def __init__(self) -> None:
        self.complete: dict[int, tuple[int, int]] = {}  # iteration -> (bytes, inodes: its files and directories)

    def _newest(self, paths: RunPaths, present: list[int]) -> int | None:
        """The newest complete checkpoint, measured (once: a complete checkpoint never changes)."""
        for i in reversed(present):
            if i in self.complete or is_complete(paths, i):
                if i not in self.complete:
                    d = iter_dir(paths, i)
                    self.complete[i] = (bytes_on_disk(d), sum(1 + len(files) for _r, _d, files in os.walk(d)))
                return i
        return None

    def inodes(self, paths: RunPaths) -> int | None:
        """The inodes the next save takes: those of the newest complete checkpoint (None before one)."""
        newest = self._newest(paths, checkpoint_iterations(paths))
        return None if newest is None else self.complete[newest][1]

    def need(self, paths: RunPaths, predicted: int | None) -> tuple[int | None, int | None]:
        """(bytes the next save needs, the iteration they were measured on or None: the prediction).
        An unfinished newer save (an asynchronous one still writing) adds what it has left to write."""
        present = checkpoint_iterations(paths)
        newest = self._newest(paths, present)
        one = self.complete[newest][0] if newest is not None else predicted
        if one is None:
            return None, None
        writing = [i for i in present if newest is None or i > newest]
        rest = sum(max(0, one - bytes_on_disk(iter_dir(paths, i))) for i in writing)
        return one + rest, newest


@dataclass(frozen=True)
class SpaceCheck:
    """Rank 0's answer before a save."""

    verdict: str  # "save", "skip" (a periodic or trigger save that does not fit), "storage_full" (a stop save)
    free: int
    need: int | None
    measured_on: int | None  # the checkpoint whose size `need` is; None: the prediction
    deleted: list[int]
    squeezed: bool = False  # a stop save fitted only once retention kept just the newest complete checkpoint
    inodes: tuple[int, int] | None = None  # (free, needed) when the inodes, not the bytes, are short

    def where(self, directory: Path) -> str:
        """'filesystem tmpfs (/x, tmpfs), 0.3 MB free, 1.9 MB needed' (+ where the figure comes from)."""
        basis = (f"the size of checkpoint {self.measured_on}" if self.measured_on is not None
                 else "the predicted checkpoint size")
        inodes = f"; {self.inodes[0]:,} free inodes (files), {self.inodes[1]:,} needed" if self.inodes else ""
        return (describe(directory, self.need or 0, free=self.free, fix=None) + inodes
                + f" ({basis}; a {MARGIN:.0%} margin more is asked)")


def check_space(directory: Path, need: tuple[int | None, int | None], *, stop: bool,
                make_room: Callable[[], list[int]], squeeze: Callable[[], list[int]] | None = None,
                inodes: int | None = None) -> SpaceCheck:
    """Whether a save of `need[0]` bytes (and `inodes` files, where the filesystem counts them) fits
    `directory`'s filesystem; when not, `make_room()` (retention) first, then measure again. `stop`: a
    save the segment cannot go on without; for one, `squeeze()` (retention down to the newest complete
    checkpoint) comes next, since the iterations since that checkpoint are worth more than an older
    one kept by `keep_last`."""
    size, measured_on = need
    wanted = None if inodes is None else math.ceil(inodes * (1 + MARGIN)) + 2  # + the tracker's rewrite

    def measure(deleted: list[int], squeezed: bool = False) -> SpaceCheck:
        """verdict "save" when both fit, else "" (decided by the caller); the short inodes if they are."""
        free, files = free_bytes(directory), free_inodes(directory)
        short = (files, wanted) if wanted is not None and files is not None and files < wanted else None
        fits = (size is None or free >= size * (1 + MARGIN)) and short is None
        return SpaceCheck("save" if fits else "", free, size, measured_on, deleted, squeezed, short)

    check = measure([])
    if check.verdict != "save":
        check = measure(make_room())  # measured again: retention may also remove leftovers it does not list
    if check.verdict != "save" and stop and squeeze is not None:
        check = measure(check.deleted + squeeze(), squeezed=True)
    if check.verdict == "save":
        return check
    return dataclasses.replace(check, verdict="storage_full" if stop else "skip", squeezed=False)
