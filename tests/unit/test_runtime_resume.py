"""Checkpoint completeness, resume planning with fallback, retention and the data-blend check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.checkpoint import resume, retention


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    p = RunPaths(tmp_path / "run")
    for d in (p.checkpoints, p.state):
        d.mkdir(parents=True)
    return p


def legacy_checkpoint(paths: RunPaths, iteration: int, *, empty: bool = False, tracker: bool = True) -> None:
    """A `torch`-format checkpoint: mp_rank_00/model_optim_rng.pt."""
    d = resume.iter_dir(paths, iteration) / "mp_rank_00"
    d.mkdir(parents=True)
    (d / "model_optim_rng.pt").write_bytes(b"" if empty else b"weights")
    if tracker:
        paths.tracker.write_text(f"{iteration}\n")


def dist_checkpoint(paths: RunPaths, iteration: int) -> Path:
    """A real torch_dist-style checkpoint written by torch.distributed.checkpoint (one process)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    d = resume.iter_dir(paths, iteration)
    dcp.save({"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(16)}, checkpoint_id=str(d), no_dist=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    paths.tracker.write_text(f"{iteration}\n")
    return d


def events(paths: RunPaths, name: str) -> list[dict]:
    return [r for r in read_jsonl(paths.ledger) if r["event"] == name]


def test_legacy_completeness(paths: RunPaths) -> None:
    legacy_checkpoint(paths, 10)
    legacy_checkpoint(paths, 20, empty=True)
    assert resume.incomplete_reason(resume.iter_dir(paths, 10)) is None
    assert "empty" in resume.incomplete_reason(resume.iter_dir(paths, 20))
    assert resume.incomplete_reason(resume.iter_dir(paths, 30)) == "missing"


def test_dist_checkpoint_truncated_or_missing_pieces(paths: RunPaths) -> None:
    d = dist_checkpoint(paths, 10)
    assert resume.incomplete_reason(d) is None
    shard = next(d.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert "truncated shard" in resume.incomplete_reason(d)
    shard.unlink()
    assert "missing shard" in resume.incomplete_reason(d)
    (d / ".metadata").write_bytes(b"garbage")
    assert "unreadable .metadata" in resume.incomplete_reason(d)
    (d / ".metadata").unlink()
    assert resume.incomplete_reason(d) == "missing .metadata"


def test_plan_picks_newest_complete_and_moves_incomplete_aside(paths: RunPaths) -> None:
    legacy_checkpoint(paths, 10)
    legacy_checkpoint(paths, 20)
    legacy_checkpoint(paths, 30, empty=True)  # the tracker points here
    plan = resume.plan_resume(paths, job_id="7")
    assert plan.iteration == 20 and paths.read_tracker() == 20
    assert (paths.checkpoints / "iter_0000030.incomplete-7").is_dir()
    (ev,) = events(paths, "resume_fallback")
    assert ev["tracker"] == 30 and ev["to"] == 20 and ev["rejected"][0]["iteration"] == 30
    assert ev["job_id"] == "7" and "time" in ev


def test_plan_with_garbled_tracker(paths: RunPaths) -> None:
    legacy_checkpoint(paths, 10)
    paths.tracker.write_text("\x00\x17garbage")
    plan = resume.plan_resume(paths, job_id="8")
    assert plan.iteration == 10 and paths.read_tracker() == 10
    assert events(paths, "resume_fallback")[0]["tracker"] == "garbled"


def test_plan_quiet_when_all_is_well_and_empty_run(paths: RunPaths) -> None:
    assert resume.plan_resume(paths, job_id="1").iteration is None
    legacy_checkpoint(paths, 10)
    assert resume.plan_resume(paths, job_id="1").iteration == 10
    assert read_jsonl(paths.ledger) == []


def test_plan_without_any_complete_checkpoint_starts_over(paths: RunPaths) -> None:
    legacy_checkpoint(paths, 10, empty=True)
    plan = resume.plan_resume(paths, job_id="9")
    assert plan.iteration is None and not paths.tracker.exists()
    assert events(paths, "resume_fallback")[0]["to"] is None


def test_resume_from_older_iteration_abandons_newer(paths: RunPaths) -> None:
    for i in (10, 20, 30):
        legacy_checkpoint(paths, i)
    plan = resume.plan_resume(paths, job_id="5", requested=10)
    assert plan.iteration == 10 and paths.read_tracker() == 10
    assert sorted(p.name for p in paths.checkpoints.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000010", "iter_0000020.abandoned-5", "iter_0000030.abandoned-5"]
    assert events(paths, "resume_from")[0]["abandoned"] == [20, 30]
    with pytest.raises(ValueError, match="not usable"):
        resume.plan_resume(paths, job_id="5", requested=40)


def test_fall_back_from_unloadable_checkpoint(paths: RunPaths) -> None:
    legacy_checkpoint(paths, 10)
    assert resume.fall_back_from(paths, 10, RuntimeError("bad"), "3") is None  # nothing older: keep it
    assert resume.iter_dir(paths, 10).is_dir()
    legacy_checkpoint(paths, 20)
    assert resume.fall_back_from(paths, 20, RuntimeError("bad pickle\nmore"), "3") == 10
    assert paths.read_tracker() == 10 and (paths.checkpoints / "iter_0000020.unreadable-3").is_dir()
    assert events(paths, "resume_fallback")[0]["reason"] == "RuntimeError: bad pickle"


def test_retention_keeps_last_milestones_and_protected(paths: RunPaths) -> None:
    """keep_last 2 counts 50 and 70; the milestones 20, 40, 60 are kept besides them, and so is 10 (protected)."""
    for i in (10, 20, 30, 40, 50, 60, 70):
        legacy_checkpoint(paths, i)
    legacy_checkpoint(paths, 80, empty=True, tracker=False)  # an asynchronous save still writing
    deleted = retention.prune(paths, keep_last=2, milestone_interval=20, protect={10}, job_id="4")
    assert deleted == [30]
    assert resume.checkpoint_iterations(paths) == [10, 20, 40, 50, 60, 70, 80]
    assert [e["iteration"] for e in events(paths, "checkpoint_deleted")] == [30]
    assert not list(paths.checkpoints.glob(".deleting-*"))


def test_retention_deletes_crashed_leftovers_but_never_the_only_checkpoint(paths: RunPaths) -> None:
    legacy_checkpoint(paths, 10, empty=True, tracker=False)  # a save that crashed
    legacy_checkpoint(paths, 20)
    assert retention.prune(paths, keep_last=1) == [10]
    assert retention.prune(paths, keep_last=1) == []
    assert resume.checkpoint_iterations(paths) == [20]


def _failed_save(paths: RunPaths, iteration: int) -> Path:
    """A torch_dist save cut short before its `.metadata` (written last): full-size shards, tracker unchanged."""
    before = paths.tracker.read_text()
    d = dist_checkpoint(paths, iteration)
    (d / ".metadata").unlink()
    paths.tracker.write_text(before)
    return d


def test_retention_deletes_incomplete_saves_moved_aside(paths: RunPaths) -> None:
    """Issue 15: a failed signal save moved aside as iter_N.incomplete-JOB is deleted by the next
    retention; abandoned and unreadable ones stay, and so does a newer save still being written."""
    dist_checkpoint(paths, 10)
    _failed_save(paths, 20)
    assert resume.plan_resume(paths, job_id="7").iteration == 10  # the next segment moves it aside
    aside = paths.checkpoints / "iter_0000020.incomplete-7"
    assert aside.is_dir() and any(aside.glob("*.distcp"))
    for kept in ("iter_0000005.abandoned-3", "iter_0000006.unreadable-4"):
        (paths.checkpoints / kept).mkdir()
    dist_checkpoint(paths, 30)
    writing = resume.iter_dir(paths, 40)
    writing.mkdir()  # an asynchronous save in progress
    assert retention.prune(paths, keep_last=2, job_id="8") == []
    assert not aside.exists() and not list(paths.checkpoints.glob(".deleting-*"))
    assert sorted(p.name for p in paths.checkpoints.iterdir() if p.is_dir()) == [
        "iter_0000005.abandoned-3", "iter_0000006.unreadable-4", "iter_0000010", "iter_0000030", "iter_0000040"]
    (ev,) = events(paths, "incomplete_checkpoint_deleted")
    assert ev["iteration"] == 20 and ev["directory"] == aside.name and ev["job_id"] == "8"


def test_segment_end_removes_its_unfinished_save(paths: RunPaths) -> None:
    dist_checkpoint(paths, 10)
    failed = _failed_save(paths, 20)
    assert resume.remove_failed_saves(paths, job_id="5") == [20]
    assert not failed.exists() and resume.checkpoint_iterations(paths) == [10]
    (ev,) = events(paths, "incomplete_checkpoint_deleted")
    assert ev["reason"] == "missing .metadata" and ev["job_id"] == "5"
    assert resume.remove_failed_saves(paths, job_id="5") == []  # the complete one is never touched


def test_segment_end_keeps_what_the_tracker_names_or_when_it_is_garbled(paths: RunPaths) -> None:
    dist_checkpoint(paths, 10)
    _failed_save(paths, 20)
    paths.tracker.write_text("20\n")  # Megatron finished it: the light check is not the judge then
    assert resume.remove_failed_saves(paths, job_id="5") == []
    paths.tracker.write_text("garbage\n")
    assert resume.remove_failed_saves(paths, job_id="5") == []
    assert resume.checkpoint_iterations(paths) == [10, 20]


def test_resume_point_is_a_whole_save_the_tracker_never_reached(paths: RunPaths) -> None:
    """A rank killed in a save's last barrier, after every file was written: Megatron never moves the tracker
    (CI: tracker 10, iteration 15 whole), the next step resumes from 15 (plan_resume), and the records say so."""
    assert resume.resume_point(paths) is None
    dist_checkpoint(paths, 10)
    dist_checkpoint(paths, 15)
    paths.tracker.write_text("10\n")
    _failed_save(paths, 20)  # an unfinished one above it is not a resume point
    paths.tracker.write_text("10\n")
    assert resume.resume_point(paths) == 15
    assert resume.remove_failed_saves(paths, job_id="5") == [20]  # the whole one stays
    assert resume.resume_point(paths) == 15 == resume.plan_resume(paths, job_id="6").iteration
    paths.tracker.write_text("garbage\n")  # unreadable: the newest whole one, as plan_resume chooses
    assert resume.resume_point(paths) == 15
    paths.tracker.write_text("15\n")
    resume.iter_dir(paths, 30).mkdir()  # a save being written, or an empty directory: not a resume point
    assert resume.resume_point(paths) == 15


def test_settle_tracker_moves_only_to_a_fully_whole_save(paths: RunPaths) -> None:
    dist_checkpoint(paths, 10)
    assert resume.settle_tracker(paths, job_id="5") is None  # nothing newer: untouched
    whole = dist_checkpoint(paths, 15)
    paths.tracker.write_text("10\n")
    shard = sorted(whole.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # named and not empty (the light check) but truncated (the full one)
    assert resume.resume_point(paths) == 15 and resume.settle_tracker(paths, job_id="5") is None
    assert paths.read_tracker() == 10 and not events(paths, "tracker_moved")
    shard.write_bytes(data)
    paths.tracker.write_text("garbage\n")  # unreadable: plan_resume's to judge
    assert resume.settle_tracker(paths, job_id="5") is None
    paths.tracker.write_text("10\n")
    assert resume.settle_tracker(paths, job_id="5") == 15 and paths.read_tracker() == 15
    (moved,) = events(paths, "tracker_moved")
    assert (moved["from"], moved["to"]) == (10, 15)
    assert resume.settle_tracker(paths, job_id="5") is None  # settled


def test_blend_check(paths: RunPaths) -> None:
    paths.data_blend.write_text("1.0 /data/a\n")
    resume.check_blend(paths, allow_change=False, write=True, job_id="1")
    legacy_checkpoint(paths, 10)
    resume.check_blend(paths, allow_change=False, write=True, job_id="2")  # unchanged: fine
    paths.data_blend.write_text("0.5 /data/a\n0.5 /data/b\n")
    with pytest.raises(resume.BlendChanged, match=r"without `megalaunch resume --set`.*megalaunch resume .* --set data.blend_file="):
        resume.check_blend(paths, allow_change=False, write=True, job_id="3")
    resume.check_blend(paths, allow_change=True, write=True, job_id="4")
    assert events(paths, "blend_changed")[0]["job_id"] == "4"
    resume.check_blend(paths, allow_change=False, write=True, job_id="5")  # the new blend is the reference now
