"""Issue 23, in the job: the retention rule (a pure function over iteration lists), the check before
every save (fits / retention then fits / skipped / storage_full) on a real small filesystem, and the
trainer's `storage_full` ending (the unfinished save removed, the figures, its own records on a full
disk). The filesystem is a tmpfs mounted for the test; the checkpoints are real files."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.tmpfs import fill, mounted_tmpfs

from megalaunch.launcher.accounting.storage import checkpoint_usage, format_usage
from megalaunch.rundir.evals import EvalPaths
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime import train
from megalaunch.runtime.checkpoint import resume, retention
from megalaunch.runtime.checkpoint.checkpoints import CheckpointConfig, Checkpoints
from megalaunch.runtime.checkpoint.retention import check_space, keep
from megalaunch.runtime.rank.context import RankContext
from megalaunch.runtime.rank.failures import classify
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.rank.storage import SaveDoesNotFit, free_bytes
from megalaunch.runtime.session import Session
from megalaunch.runtime.stop.signals import SignalFlag

MiB = 1 << 20


# --- the rule ----------------------------------------------------------------------------------------

def test_keep_last_counts_neither_milestones_nor_checkpoints_waiting_for_an_eval() -> None:
    its = list(range(10, 100, 10))
    k = keep(its, its, keep_last=2, milestone_interval=30, eval_pending={50})
    assert (k.last, k.milestones, k.waiting_eval) == ([70, 80], [30, 60, 90], [50])
    assert k.doomed == [10, 20, 40] and k.counts() == {"keep_last": 2, "milestones": 3, "waiting_eval": 1, "other": 0}
    # once the eval ran, 50 is an old checkpoint like any other
    assert keep(its, its, keep_last=2, milestone_interval=30).doomed == [10, 20, 40, 50]


def test_the_checkpoint_resumed_from_is_kept_only_until_a_newer_one_is_complete() -> None:
    # keep_last 0 keeps everything; with 1 the resumed-from one is the newest complete: kept as such
    assert keep([10, 20], [10, 20], keep_last=1, resumed_from=20).doomed == [10]
    # 30 is being written (not complete): 20 stays
    assert keep([10, 20, 30], [10, 20], keep_last=1, resumed_from=20).doomed == [10]
    # 30 is complete: 20 goes, resumed from or not
    assert keep([20, 30], [20, 30], keep_last=1, resumed_from=20).doomed == [20]


def test_never_newer_than_the_newest_complete_and_crashed_leftovers_go() -> None:
    k = keep([10, 15, 20, 25], [10, 20], keep_last=1)
    assert k.doomed == [10, 15]  # 15 never completed; 25 may be an asynchronous save still writing
    assert keep([10, 20], [], keep_last=1).doomed == []  # nothing complete: nothing is touched
    assert keep([10, 20, 30], [10, 20, 30], keep_last=0).doomed == []  # keep_last 0: keep every one


@pytest.mark.parametrize(("keep_last", "milestone", "segment_saves"), [(2, 0, 3), (1, 0, 2), (2, 40, 4), (3, 30, 1)])
def test_a_chain_never_holds_more_than_keep_last_plus_the_one_being_written(keep_last: int, milestone: int,
                                                                            segment_saves: int) -> None:
    """Save by save over resumed segments (each resumes from the newest complete one, retention at its
    start and after every save): regular checkpoints on disk while a save writes <= keep_last + 1."""
    present: list[int] = []
    resumed: int | None = None
    for n, it in enumerate(range(10, 400, 10)):
        if n % segment_saves == 0:  # a new segment: resumed from the newest, retention at its start
            resumed = present[-1] if present else None
            present = [i for i in present if i not in keep(present, present, keep_last=keep_last,
                                                           milestone_interval=milestone, resumed_from=resumed).doomed]
        regular = [i for i in present if not (milestone and i % milestone == 0)]
        assert len(regular) + 1 <= keep_last + 1, (it, present)  # + `it`, being written
        present.append(it)
        present = [i for i in present if i not in keep(present, present, keep_last=keep_last,
                                                       milestone_interval=milestone, resumed_from=resumed).doomed]


# --- the check before a save, on a real filesystem -------------------------------------------------------

@pytest.fixture()
def fs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "fs", "16m") as d:
        yield d


def _run(fs: Path) -> RunPaths:
    paths = RunPaths(fs / "run")
    for d in (paths.state, paths.checkpoints):
        d.mkdir(parents=True)
    return paths


def _checkpoint(paths: RunPaths, iteration: int, size: int = 2 * MiB, *, complete: bool = True) -> Path:
    """A legacy `torch` checkpoint of `size` bytes (mp_rank_00/model_optim_rng.pt); incomplete: its file empty."""
    d = resume.iter_dir(paths, iteration) / "mp_rank_00"
    d.mkdir(parents=True)
    (d / "model_optim_rng.pt").write_bytes(b"\1" * size if complete else b"")
    if complete:
        paths.tracker.write_text(f"{iteration}\n")
    return d.parent


def test_the_need_is_the_newest_checkpoint_measured_else_the_prediction(fs: Path) -> None:
    paths = _run(fs)
    sizes = retention.Sizes()
    assert sizes.need(paths, 123) == (123, None) and sizes.need(paths, None) == (None, None)
    _checkpoint(paths, 10, 2 * MiB)
    assert sizes.need(paths, 123) == (2 * MiB, 10)
    partial = resume.iter_dir(paths, 20)  # a torch_dist save still writing (no .metadata yet): its rest counts too
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\1" * MiB)
    assert sizes.need(paths, 123) == (3 * MiB, 10)


def test_fits_then_retention_then_skip_or_storage_full(fs: Path) -> None:
    paths = _run(fs)
    for i in (10, 20, 30):
        _checkpoint(paths, i, 2 * MiB)
    need = retention.Sizes().need(paths, None)
    room = lambda: retention.prune(paths, keep_last=1, job_id="5")  # noqa: E731  (keep_last lowered by resume --set)
    check = check_space(paths.checkpoints, need, stop=False, make_room=room)
    assert (check.verdict, check.deleted, check.need, check.measured_on) == ("save", [], 2 * MiB, 30)
    filler = fill(fs, MiB)  # 1 MiB left: retention makes room (10 and 20 go), then it fits
    check = check_space(paths.checkpoints, need, stop=False, make_room=room)
    assert (check.verdict, check.deleted) == ("save", [10, 20]) and check.free >= 4 * MiB
    filler.unlink()
    fill(fs, MiB)  # nothing left to delete: a periodic save is skipped, a stop save cannot be made
    skip = check_space(paths.checkpoints, need, stop=False, make_room=room)
    full = check_space(paths.checkpoints, need, stop=True, make_room=room)
    assert (skip.verdict, full.verdict, skip.deleted) == ("skip", "storage_full", [])
    assert skip.free <= MiB and "0.0021 GB needed (the size of checkpoint 30; a 5% margin more is asked)" in skip.where(paths.checkpoints)
    assert resume.checkpoint_iterations(paths) == [30]


def _room(paths: RunPaths, **config: int) -> Checkpoints:
    return Checkpoints(RankContext(paths, 0, 1, "7"), CheckpointConfig(keep_last=2, **config))


def test_a_periodic_save_that_does_not_fit_is_skipped_and_shown_a_stop_save_raises(
        fs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = _run(fs)
    _checkpoint(paths, 10, 2 * MiB)
    room = _room(paths, train_iters=100)
    assert room.before_save(20, "periodic")  # plenty of room
    fill(fs, MiB)
    assert not room.before_save(30, "periodic") and not room.before_save(40, "trigger")
    out = capsys.readouterr().out
    assert "periodic save at iteration 30 skipped: not enough free space: filesystem tmpfs" in out
    skipped = [e for e in read_jsonl(paths.ledger) if e["event"] == "save_skipped"]
    assert [(e["iteration"], e["kind"], e["filesystem"], e["need_bytes"]) for e in skipped] == [
        (30, "periodic", "tmpfs", 2 * MiB), (40, "trigger", "tmpfs", 2 * MiB)]
    assert skipped[0]["free_bytes"] <= MiB and skipped[0]["mount"] == str(fs)
    for iteration, kind in ((50, "stop"), (60, "final"), (100, "periodic")):  # 100: train_iters
        with pytest.raises(SaveDoesNotFit, match=f"no room for the {kind} save at iteration {iteration}: "
                                                 "filesystem tmpfs"):
            room.before_save(iteration, kind)
    lines = "\n".join(format_usage(checkpoint_usage(paths, events=read_jsonl(paths.ledger))))
    assert "warning: the trigger save at iteration 40 was skipped (job 7): filesystem tmpfs" in lines
    assert f"megalaunch resume {paths.root}" in lines


def test_a_stop_save_short_of_room_keeps_only_the_newest_checkpoint_a_periodic_one_is_skipped(fs: Path) -> None:
    """keep_last 2 holds 10 and 20; the disk fills from outside. A periodic save is skipped (20 and 10
    stay); the stop save is worth more than checkpoint 10: retention squeezes down to 20 and saves."""
    paths = _run(fs)
    for i in (10, 20):
        _checkpoint(paths, i, 2 * MiB)
    room = _room(paths, train_iters=100)
    fill(fs, MiB)
    assert not room.before_save(30, "periodic")
    assert resume.checkpoint_iterations(paths) == [10, 20]
    assert room.before_save(31, "stop")
    assert resume.checkpoint_iterations(paths) == [20]
    (squeezed,) = [e for e in read_jsonl(paths.ledger) if e["event"] == "retention_squeezed"]
    assert (squeezed["iteration"], squeezed["kind"], squeezed["deleted"], squeezed["keep_last"]) == (31, "stop", [10], 2)
    lines = "\n".join(format_usage(checkpoint_usage(paths, events=read_jsonl(paths.ledger))))
    assert "warning: the periodic save at iteration 30 was skipped (job 7): filesystem tmpfs" in lines
    assert "warning: the stop save at iteration 31 fit only after retention deleted checkpoint(s) [10] beyond " \
           "keep_last 2 (job 7); fix: " in lines
    # keep_last 0 (every save kept) is never squeezed: the stop save that does not fit ends storage_full
    keep_all = Checkpoints(RankContext(paths, 0, 1, "7"), CheckpointConfig(keep_last=0))
    _checkpoint(paths, 31, 2 * MiB)  # the stop save: ~1 MiB left again
    with pytest.raises(SaveDoesNotFit):
        keep_all.before_save(40, "stop")
    assert resume.checkpoint_iterations(paths) == [20, 31]


def test_a_filesystem_out_of_inodes_is_short_of_room_whatever_its_free_bytes(tmp_path: Path) -> None:
    """Plenty of bytes, no inodes left (a tmpfs with nr_inodes, a quota on files, Lustre's MDT full):
    a save would fail creating its files. Counted like bytes: the periodic save is skipped and says
    why, the stop save squeezes retention (deleting 10 frees its 3 inodes) and goes ahead."""
    with mounted_tmpfs(tmp_path / "fs", "64m", inodes=64) as fs:
        paths = _run(fs)
        for i in (10, 20):
            _checkpoint(paths, i, 1000)  # 3 inodes each: iter_N, mp_rank_00, the file
        paths.ledger.write_text("")  # the ledger's own inode, before the filesystem runs out
        room = _room(paths, train_iters=100)
        n = 0
        while retention.free_inodes(fs) > 3:  # fill the inode table, not the bytes
            (fs / f"empty-{n}").touch()
            n += 1
        assert free_bytes(fs) > 60 * MiB
        assert not room.before_save(30, "periodic")
        (skip,) = [e for e in read_jsonl(paths.ledger) if e["event"] == "save_skipped"]
        assert (skip["iteration"], skip["free_inodes"], skip["need_inodes"]) == (30, 3, 6)  # 3 x 1.05 + 2, rounded up
        assert room.before_save(31, "stop")
        assert resume.checkpoint_iterations(paths) == [20]
        lines = "\n".join(format_usage(checkpoint_usage(paths, events=read_jsonl(paths.ledger))))
        assert "was skipped (job 7): filesystem tmpfs" in lines and "had 3 free inodes, 6 needed; fix: " in lines
def test_status_counts_why_each_checkpoint_is_kept(fs: Path) -> None:
    paths = _run(fs)
    paths.runtime_json.write_text(RuntimeSettings(train_iters=100, save_interval=10, keep_last=2,
                                                  milestone_interval=20).to_json())
    for i in (10, 20, 30, 40, 50):
        _checkpoint(paths, i, 1000)
    _checkpoint(paths, 60, complete=False)
    EvalPaths(paths, 30).write_state("queued")
    usage = checkpoint_usage(paths)
    assert usage["kept"] == {"keep_last_setting": 2, "keep_last": [10, 50], "milestones": [20, 40],
                             "waiting_eval": [30], "other": [60]}
    assert ("  kept: 2 by keep_last 2, 2 milestones (20, 40), 1 waiting for an evaluation (30), "
            "1 being written or unfinished (60)") in format_usage(usage)


# --- the trainer's storage_full ending --------------------------------------------------------------------

@pytest.fixture()
def session(fs: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "7")
    paths = _run(fs)
    flag = SignalFlag()
    yield Session(paths, RuntimeSettings(train_iters=100, save_interval=10, checkpoint_bytes=3 * MiB), flag,
                  rank=0, world=1)
    flag.restore()


def test_a_save_that_fills_the_disk_ends_storage_full_without_its_partial_save(session: Session, fs: Path) -> None:
    paths = session.ctx.paths
    _checkpoint(paths, 10, 2 * MiB)
    partial = resume.iter_dir(paths, 20)
    partial.mkdir()
    try:
        with open(partial / "__0_0.distcp", "wb") as f:  # the save writes until the disk refuses
            while True:
                f.write(b"\0" * MiB)
    except OSError as e:
        assert e.errno == errno.ENOSPC
        failure = classify(_wrapped(e), started=True)
    end = train._judge(session, train.Ending(failure=failure))
    assert end.status == "storage_full" and not partial.exists()
    train._conclude(session, end)
    outcome = read_json(paths.outcome)
    assert outcome["status"] == "storage_full" and outcome["need_bytes"] == 2 * MiB
    assert outcome["filesystem"] == "tmpfs" and outcome["removed_saves"] == [20] and outcome["free_bytes"] > 10 * MiB
    assert "[Errno 28] No space left on device" in outcome["reason"] and "now filesystem tmpfs" in outcome["reason"]


def _wrapped(error: OSError) -> RuntimeError:
    try:
        raise RuntimeError("checkpoint save failed") from error
    except RuntimeError as e:
        return e


def test_the_stop_save_that_does_not_fit_and_a_disk_too_full_for_the_outcome(
        session: Session, fs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing of this segment to remove, nothing left free: the outcome cannot be written, which is said."""
    fill(fs, 0)
    with pytest.raises(SaveDoesNotFit) as e:
        session.before_save(40, "stop")
    end = train._judge(session, train.Ending(status="storage_full", reason=f"storage full: {e.value.reason}", code=0))
    train._conclude(session, end)
    assert free_bytes(fs) < 64 * 1024 and read_json(session.ctx.paths.outcome) is None
    out = capsys.readouterr().out
    assert "no room for the stop save at iteration 40: filesystem tmpfs" in out
    assert "(the predicted checkpoint size; a 5% margin more is asked)" in out and "outcome not written: [Errno 28]" in out


def test_retention_after_a_save_unlinks_in_the_background_and_the_next_check_waits_for_it(
        fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention after a save renames the doomed checkpoint away at once and unlinks its files in a thread
    (17 GB took ~7 s on an H100 machine's disk, inside the training loop); the next save's space check
    waits for that thread, so the space it frees is measured free; a `.deleting-*` directory an ended
    process left is swept."""
    import shutil
    import threading

    paths = _run(fs)
    for it in (10, 20):
        _checkpoint(paths, it, 2 * MiB)
    leftover = paths.checkpoints / ".deleting-iter_0000005-999999999"  # a pid that is not this process
    leftover.mkdir()
    (leftover / "shard").write_bytes(b"\1" * MiB)
    release = threading.Event()
    real_rmtree = shutil.rmtree
    started: list[str] = []

    def slow_rmtree(path: object, *a: object, **k: object) -> None:  # a slow disk: unlinking waits
        started.append(Path(str(path)).name)
        release.wait(30)
        real_rmtree(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(resume.shutil, "rmtree", slow_rmtree)
    room = _room(paths, train_iters=100)
    _checkpoint(paths, 30, 2 * MiB)
    room.after_save(30, 0.1)  # keep_last 2: 10 goes, in the background
    assert resume.checkpoint_iterations(paths) == [20, 30]  # renamed away at once
    assert sorted(started) == sorted([f".deleting-iter_0000010-{os.getpid()}", leftover.name])
    assert free_bytes(fs) < 16 * MiB - 7 * MiB  # 10's files and the leftover's still take their space
    checked = threading.Thread(target=room.before_save, args=(40, "periodic"))
    checked.start()
    checked.join(0.5)
    assert checked.is_alive()  # the space check waits for the deletions
    release.set()
    checked.join(30)
    assert not checked.is_alive()
    assert sorted(p.name for p in paths.checkpoints.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000020", "iter_0000030"]
    assert not [p for p in paths.checkpoints.iterdir() if p.name.startswith(".deleting-")]
