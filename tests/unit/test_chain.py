"""Chain decisions (job begin/end) against a real run directory, with a scheduler stand-in that
records successors and cancellations (the Slurm side is tested for real in tests/slurm)."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import run_status
from megalaunch.rundir.files import append_jsonl, atomic_write_text
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import write_outcome
from megalaunch.rundir.triggers import Decision, TriggerBox


class RecordingScheduler:
    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.cancelled: list[str] = []
        self.states: dict[str, str] = {}
        self.nodes: list[str] | None = None  # what `sinfo` would list (None: the local backend / no answer)
        self.excluded: dict[str, list[str]] = {}  # job -> nodes, at submission or by update
        self.batch_hosts: dict[str, str] = {}  # job -> the node that ran its job script (scontrol's BatchHost)

    def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None) -> str | None:
        jid = str(100 + len(self.submitted))
        self.submitted.append(jid)
        if exclude:
            self.excluded[jid] = list(exclude)
        return jid

    def known_nodes(self, partition: str | None) -> list[str] | None:
        return self.nodes

    def exclude(self, job_ids: list[str], nodes: list[str]) -> None:
        for j in job_ids:
            self.excluded[j] = list(nodes)

    def cancel_jobs(self, job_ids: list[str]) -> None:
        self.cancelled.extend(job_ids)

    def state(self, job_id: str) -> str | None:
        return self.states.get(job_id)

    def batch_host(self, job_id: str) -> str | None:
        return self.batch_hosts.get(job_id)


@pytest.fixture()
def run(tmp_path: Path) -> tuple[RunPaths, RecordingScheduler, Chain]:
    loaded = load_recipe("tiny", [f"run.root={tmp_path}", "chain.max_segments_without_progress=2",
                                  "training.train_iters=100"])
    paths = write_run(prepare_run(loaded))
    sched = RecordingScheduler()
    return paths, sched, Chain(paths, sched)


def _ckpt(paths: RunPaths, it: int) -> None:
    atomic_write_text(paths.tracker, f"{it}\n")


def _outcome(monkeypatch: pytest.MonkeyPatch, paths: RunPaths, job: str, status: str, **kw: object) -> None:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", job)
    write_outcome(paths, status, **kw)  # type: ignore[arg-type]


def test_segment_queues_successor_and_continues_after_a_save(run, monkeypatch) -> None:
    paths, sched, chain = run
    assert chain.begin("1").proceed
    assert sched.submitted == ["100"]
    _ckpt(paths, 40)
    _outcome(monkeypatch, paths, "1", "saved", iteration=40)
    v = chain.end("1", 0)
    assert v.proceed and sched.cancelled == []


def test_finished_cancels_the_waiting_successor(run, monkeypatch) -> None:
    paths, sched, chain = run
    chain.begin("1")
    _ckpt(paths, 100)
    _outcome(monkeypatch, paths, "1", "finished", iteration=100)
    v = chain.end("1", 0)
    assert not v.proceed and "target" in v.reason
    assert sched.cancelled == ["100"]
    assert chain.ledger.stopped()["cancelled"] == ["100"]


def test_exit_code_zero_without_outcome_is_a_failure(run) -> None:
    paths, sched, chain = run
    chain.begin("1")
    chain.end("1", 0)
    ended = chain.ledger.segments()[0].ended
    assert ended["outcome"] == "failed" and "no outcome" in ended["reason"]


def test_stale_outcome_of_another_job_is_ignored(run, monkeypatch) -> None:
    paths, sched, chain = run
    _outcome(monkeypatch, paths, "0", "finished")
    chain.begin("1")
    v = chain.end("1", 0)
    assert v.proceed  # a failure, within budget; not "finished"
    assert chain.ledger.segments()[0].ended["outcome"] == "failed"


def test_crash_loop_budget_stops_the_chain(run) -> None:
    paths, sched, chain = run
    assert chain.begin("1").proceed
    assert chain.end("1", 1).proceed  # 1 of 2
    assert chain.begin("100").proceed
    v = chain.end("100", 1)
    assert not v.proceed and "2 consecutive segments" in v.reason
    assert sched.cancelled == ["101"]
    guard = chain.ledger.last("guard")
    assert guard["decision"] == "stop" and guard["failures"] == 2


def test_progress_resets_the_budget(run, monkeypatch) -> None:
    paths, sched, chain = run
    chain.begin("1")
    chain.end("1", 1)
    chain.begin("100")
    _ckpt(paths, 10)
    _outcome(monkeypatch, paths, "100", "saved")
    chain.end("100", 0)
    chain.begin("101")
    assert chain.end("101", 1).proceed


def test_pending_exit_trigger_stops_before_training(run) -> None:
    paths, sched, chain = run
    TriggerBox(paths).write("exit", "stop please")
    v = chain.begin("1")
    assert not v.proceed
    assert sched.submitted == []
    assert not paths.trigger("exit").exists()
    consumed = list(paths.consumed_triggers.glob("*exit*.json"))
    assert len(consumed) == 1
    trig = chain.ledger.last("trigger")
    assert trig["verb"] == "exit" and trig["reason"] == "stop please"


def test_killed_segment_is_accounted_for_by_the_next(run) -> None:
    paths, sched, chain = run
    chain.begin("1")  # then the node dies: no `job end`
    sched.states["1"] = "NODE_FAIL"
    chain.begin("100")
    seg1 = chain.ledger.segments()[0]
    assert seg1.ended["outcome"] == "killed" and seg1.ended["slurm_state"] == "NODE_FAIL"
    assert seg1.ended["accounted_by"] == "100"
    assert chain.ledger.consecutive_without_progress() == 1


def test_config_error_stops_at_once(run, monkeypatch) -> None:
    paths, sched, chain = run
    chain.begin("1")
    _outcome(monkeypatch, paths, "1", "failed", reason="bad flag", kind="config")
    v = chain.end("1", 1)
    assert not v.proceed and "configuration error" in v.reason


def test_config_error_outcome_stops_with_its_fix_in_status(run, monkeypatch) -> None:
    paths, sched, chain = run
    chain.begin("1")
    assert sched.submitted == ["100"]
    _outcome(monkeypatch, paths, "1", "config_error", reason="AssertionError: x (megatron/a.py:3)",
             fix="--set training.attention=sdpa")
    v = chain.end("1", 1)
    assert not v.proceed and "no retry can fix it" in v.reason and "megatron/a.py:3" in v.reason
    assert sched.cancelled == ["100"]  # the queued successor does not run the same error again
    stopped = chain.ledger.stopped()
    assert stopped is not None and stopped["fix"] == "--set training.attention=sdpa"
    ended = chain.ledger.segments()[0].ended
    assert ended is not None and ended["outcome"] == "config_error"
    from megalaunch.launcher.status_format import format_run_status

    text = format_run_status(run_status(paths))
    assert "fix: --set training.attention=sdpa" in text and "CONFIG_ERROR" in text


def test_a_rank_that_failed_on_the_config_stops_the_chain_though_rank_0_said_failed(run, monkeypatch) -> None:
    """Rank 1's assertion got the step killed; rank 0 only saw a broken collective."""
    paths, sched, chain = run
    chain.begin("1")
    _outcome(monkeypatch, paths, "1", "failed", reason="RuntimeError: Connection reset by peer")
    paths.tasks("1").mkdir(parents=True)
    from megalaunch.rundir.files import atomic_write_json

    atomic_write_json(paths.task_error("1", 1), {"rank": 1, "config": True, "reason": "ValueError: bad shape",
                                                "fix": None, "time": 5.0})
    atomic_write_json(paths.task_error("1", 0), {"rank": 0, "config": False,
                                                "reason": "RuntimeError: Connection reset by peer", "time": 6.0})
    v = chain.end("1", 1)
    assert not v.proceed and "rank 1: ValueError: bad shape" in v.reason
    assert chain.ledger.stopped()["fix"]  # a generic one when none is known


def test_transient_failures_still_count_against_the_budget(run, monkeypatch) -> None:
    paths, sched, chain = run
    for i, job in enumerate(("1", "2")):
        chain.begin(job)
        _outcome(monkeypatch, paths, job, "failed", reason="RuntimeError: NCCL error: unhandled system error")
        paths.tasks(job).mkdir(parents=True)
        from megalaunch.rundir.files import atomic_write_json

        atomic_write_json(paths.task_error(job, 0), {"rank": 0, "config": False, "reason": "NCCL", "time": 1.0})
        v = chain.end(job, 1)
        assert v.proceed == (i == 0), v.reason
    assert "2 consecutive segments without a new checkpoint" in v.reason


def test_stopped_chain_skips_a_late_segment(run, monkeypatch) -> None:
    paths, sched, chain = run
    chain.begin("1")
    _outcome(monkeypatch, paths, "1", "exited")
    chain.end("1", 0)
    v = chain.begin("100")
    assert not v.proceed and "already stopped" in v.reason


def test_status_shows_the_checkpoint_actually_resumed_after_a_fallback(run, monkeypatch) -> None:
    paths, sched, chain = run
    _ckpt(paths, 120)
    chain.begin("1")  # `job begin` sees the tracker at 120 ...
    # ... the trainer finds 120 incomplete and resumes from 100
    append_jsonl(paths.ledger, {"event": "resume_fallback", "job_id": "1", "tracker": 120, "to": 100, "time": 0})
    append_jsonl(paths.ledger, {"event": "resumed", "job_id": "1", "iteration": 100, "time": 0})
    _ckpt(paths, 130)
    _outcome(monkeypatch, paths, "1", "saved", iteration=130)
    chain.end("1", 0)
    (row,) = [r for r in run_status(paths)["segments"] if r["job_id"] == "1"]
    assert (row["start_iteration"], row["end_iteration"]) == (100, 130)


def test_stop_reason_names_who_asked_and_the_cancelled_successor_says_so(run, monkeypatch) -> None:
    paths, sched, chain = run
    chain.begin("1")
    TriggerBox(paths).write("exit", "eval at 10k")
    TriggerBox(paths).consume_for(Decision.EXIT, 40, "1")
    _ckpt(paths, 40)
    _outcome(monkeypatch, paths, "1", "exited", iteration=40)
    v = chain.end("1", 0)
    assert v.reason == f'exit trigger by {getpass.getuser()} ("eval at 10k"): saved and stopped'
    rows = {r["job_id"]: r for r in run_status(paths)["segments"]}
    assert rows["100"]["state"] == "CANCELLED" and rows["100"]["reason"] == f"by the chain: {v.reason}"


def test_status_says_unknown_when_slurm_does_not_answer(tmp_path: Path, monkeypatch) -> None:
    loaded = load_recipe("tiny", [f"run.root={tmp_path}", "cluster.backend=slurm"])
    paths = write_run(prepare_run(loaded))
    chain = Chain(paths, RecordingScheduler())
    chain.ledger.append("submitted", job_id="7", by="megalaunch submit")
    chain.begin("7")  # running, successor 100 queued
    # Slurm's client at the subprocess boundary: a squeue that cannot reach the controller
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    squeue = bin_dir / "squeue"
    squeue.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n'
                      'echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2\nexit 1\n')
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    st = run_status(paths)
    assert calls.read_text().splitlines() == ["-h -o %i|%j|%T|%r|%u|%M|%N -j 7,100"]  # one query for both
    assert st["chain_state"] == "unknown" and "Unable to contact" in st["slurm_error"]
    assert [(r["job_id"], r["state"]) for r in st["segments"]] == [("7", "UNKNOWN"), ("100", "UNKNOWN")]


def test_segment_end_deletes_the_save_it_left_unfinished(run, monkeypatch) -> None:
    """Issue 15: a save that failed (here: one rank's shard file empty) is gone once `job end` ran;
    the complete checkpoint before it stays. (Issue 23: on a full disk the chain then stops.)"""
    from megalaunch.rundir.files import read_jsonl
    from megalaunch.runtime.checkpoint.resume import checkpoint_iterations, iter_dir

    paths, sched, chain = run
    chain.begin("1")
    for it, data in ((40, b"weights"), (50, b"")):
        (iter_dir(paths, it) / "mp_rank_00").mkdir(parents=True)
        (iter_dir(paths, it) / "mp_rank_00" / "model_optim_rng.pt").write_bytes(data)
    _ckpt(paths, 40)
    _outcome(monkeypatch, paths, "1", "failed", reason="OSError: No space left on device")
    assert not chain.end("1", 1).proceed  # storage_full: no retry can fix it
    assert checkpoint_iterations(paths) == [40]
    (ev,) = [r for r in read_jsonl(paths.ledger) if r["event"] == "incomplete_checkpoint_deleted"]
    assert ev["iteration"] == 50 and ev["job_id"] == "1"


def test_status_of_a_finished_run_names_the_conversion(run, monkeypatch) -> None:
    """Issue 15: every stage prints its next command; a finished training run's is the conversion."""
    import shlex

    from megalaunch.launcher.status_format import format_run_status

    paths, sched, chain = run
    chain.begin("1")
    _ckpt(paths, 60)
    _outcome(monkeypatch, paths, "1", "saved", iteration=60)
    chain.end("1", 0)
    assert run_status(paths)["next"] is None  # not done yet: no conversion to suggest
    chain.begin("100")
    _ckpt(paths, 100)
    _outcome(monkeypatch, paths, "100", "finished", iteration=100)
    chain.end("100", 0)
    text = format_run_status(run_status(paths))
    (line,) = [x for x in text.splitlines() if x.startswith("  next: ")]
    assert shlex.split(line.removeprefix("  next: ")) == [
        "megalaunch", "convert", "mcore-to-hf", str(paths.root), "--out", str(paths.root / "hf")]


def test_the_successor_is_queued_before_first_stage_work_and_cancelled_when_it_fails(run, monkeypatch) -> None:
    """A long first stage (tokenizing chat files, converting, a teacher's scores) may outlive the segment's time
    limit: the successor is queued before it starts; a stage that fails stops the chain and cancels it."""
    import dataclasses

    from megalaunch.launcher.chain.first_stage import Failed

    paths, sched, chain = run
    chain.settings = dataclasses.replace(chain.settings, chat_files="/data/chats")
    seen: list[int] = []

    def stage(*_: object) -> Failed:
        seen.append(len(sched.submitted))
        return Failed("chats/a.jsonl row 3: no 'messages'", "fix the row")

    monkeypatch.setattr("megalaunch.launcher.chain.chain.tokenize_chats", stage)
    verdict = chain.begin("1")
    assert seen == [1] and not verdict.proceed
    assert sched.cancelled == sched.submitted == ["100"]
    from megalaunch.launcher.chain.first_stage import stage_work_pending

    assert stage_work_pending(paths, "/data/chats", None, None)
    atomic_write_text(paths.data_blend, "done\n")  # the stage's work done: the successor is queued after, as before
    assert not stage_work_pending(paths, "/data/chats", None, None)
    assert stage_work_pending(paths, None, None, {"method": "distill"})  # no complete teacher store yet
