"""Save pacing (runtime/stop/save_pacing.py, issue #50): the rules, and the session's hooks around an
asynchronous save in flight: a periodic save due meanwhile is deferred (recorded once), owed at every
boundary until the write is complete, then taken; never past the bound; a stop save takes its place; a
stop that finds an earlier save still writing leaves with it when that costs less than another write.
No Megatron: the session's hooks as the seams call them, a clock the test moves."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import Decision
from megalaunch.runtime.checkpoint import resume
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.session import Session
from megalaunch.runtime.stop import save_pacing
from megalaunch.runtime.stop.decisions import at_boundary
from megalaunch.runtime.stop.save_pacing import deferral_bound_s, leave_with_written, periodic_verdict
from megalaunch.runtime.stop.signals import SignalFlag


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(save_pacing, "time", c)
    return c


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "7")
    monkeypatch.delenv(save_pacing.PACING_ENV, raising=False)
    paths = RunPaths(tmp_path)
    for d in (paths.triggers, paths.state, paths.checkpoints):
        d.mkdir(parents=True, exist_ok=True)
    flag = SignalFlag()

    def make(**kw: Any) -> Session:
        settings = RuntimeSettings(train_iters=100, save_interval=10, keep_last=0, save_time_estimate_s=30, **kw)
        return Session(paths, settings, flag, rank=0, world=1)

    yield make
    flag.restore()


def _events(s: Session, name: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(s.ctx.paths.ledger) if e["event"] == name]


def _writing(s: Session, iteration: int) -> None:
    """An asynchronous save of `iteration` handed to the writer and still writing."""
    assert s.before_save(iteration, "periodic")
    s.after_save(iteration, complete=False)


# --- the rules -------------------------------------------------------------------------------------------------

def test_the_verdict_defers_only_while_writing_and_within_the_bound() -> None:
    assert periodic_verdict(writing=False, now=50.0, due_since=0.0, bound_s=10) == "save"
    assert periodic_verdict(writing=True, now=50.0, due_since=None, bound_s=10) == "defer"  # first due now
    assert periodic_verdict(writing=True, now=9.9, due_since=0.0, bound_s=10) == "defer"
    assert periodic_verdict(writing=True, now=10.0, due_since=0.0, bound_s=10) == "wait"
    assert deferral_bound_s(None, 60) == 60 and deferral_bound_s(40, 60) == 80 and deferral_bound_s(20, 60) == 60


@pytest.mark.parametrize(("kind", "iteration", "writing", "trained", "write", "leave"), [
    ("stop", 15, 10, 2.0, 12.0, True),  # a little training since, a long write: leave with it
    ("stop", 15, 10, 12.0, 12.0, False),  # as much training as a write: write the stop's own
    ("stop", 10, 10, 0.0, 12.0, False),  # the save of this very iteration: not this rule's (it is the stop's)
    ("stop", 100, 90, 1.0, 12.0, False),  # at train_iters: the run's last checkpoint is always written
    ("trigger", 15, 10, 1.0, 12.0, False),  # a `save` trigger asks for a checkpoint now
    ("final", 15, 10, 1.0, 12.0, False),
    ("stop", 15, 10, None, 12.0, False),  # nothing measured: write it
])
def test_a_stop_leaves_with_the_save_in_flight_only_when_cheaper(kind: Any, iteration: int, writing: int,
                                                                 trained: float | None, write: float,
                                                                 leave: bool) -> None:
    assert leave_with_written(kind=kind, iteration=iteration, writing=writing, train_iters=100,
                              trained_since_s=trained, write_s=write) is leave


def test_an_owed_save_is_tried_at_the_next_boundary_unless_another_save_is_there() -> None:
    owed = at_boundary(Decision.CONTINUE, 21, 10, owed=True)
    assert (owed.save_now, owed.save_kind, owed.leave) == (True, "periodic", False)
    assert not at_boundary(Decision.CONTINUE, 21, 10).save_now  # nothing owed: nothing between intervals
    assert not at_boundary(Decision.CONTINUE, 30, 10, owed=True).save_now  # Megatron's own periodic save is there
    trigger = at_boundary(Decision.SAVE, 21, 10, owed=True)
    assert (trigger.save_now, trigger.save_kind) == (True, "trigger")  # the trigger save takes its place
    stop = at_boundary(Decision.SIGNAL, 21, 10, owed=True)
    assert (stop.save_now, stop.leave, stop.save_kind) == (False, True, "stop")  # Megatron's stop save does


# --- the session's hooks --------------------------------------------------------------------------------------

def test_a_periodic_save_due_during_a_write_is_deferred_then_taken(session: Any, clock: Clock) -> None:
    s = session()
    _writing(s, 10)
    clock.now += 3
    assert not s.before_save(20, "periodic") and s.save_owed(21)
    (deferred,) = _events(s, "save_deferred")
    assert (deferred["iteration"], deferred["writing"], deferred["writing_for_s"], deferred["bound_s"]) == (20, 10, 3.0, 30)
    clock.now += 1
    assert not s.before_save(21, "periodic") and len(_events(s, "save_deferred")) == 1  # recorded once
    clock.now += 1
    s.save_complete(10)  # Megatron finalized the write at the next boundary
    assert s.before_save(22, "periodic") and not s.save_owed(23)
    (taken,) = _events(s, "deferred_save_taken")
    assert {k: taken[k] for k in ("due", "iteration", "by", "waited", "deferred_s")} == \
        {"due": 20, "iteration": 22, "by": "periodic", "waited": False, "deferred_s": 2.0}


def test_a_deferral_ends_at_its_bound_and_waits(session: Any, clock: Clock) -> None:
    s = session()
    _writing(s, 10)
    clock.now += 20
    s.save_complete(10)  # a first write of 20 s: the bound is max(2 x 20, 30) = 40 s
    _writing(s, 20)
    assert not s.before_save(30, "periodic")
    clock.now += 39.9
    assert not s.before_save(35, "periodic")
    clock.now += 0.1
    assert s.before_save(36, "periodic")  # 40 s deferred: it goes ahead and waits for the write
    (taken,) = _events(s, "deferred_save_taken")
    assert (taken["due"], taken["iteration"], taken["waited"]) == (30, 36, True)


def test_a_stop_save_takes_the_owed_ones_place(session: Any, clock: Clock) -> None:
    s = session()
    _writing(s, 10)
    assert not s.before_save(20, "periodic")
    assert s.before_save(23, "stop") and not s.save_owed(24)
    (taken,) = _events(s, "deferred_save_taken")
    assert (taken["due"], taken["iteration"], taken["by"]) == (20, 23, "stop")


def test_without_pacing_every_save_goes_ahead(session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(save_pacing.PACING_ENV, "0")
    s = session()
    _writing(s, 10)
    assert s.before_save(20, "periodic") and not s.save_owed(21)
    assert not s.leave_with_written(25, "stop", 20)
    assert _events(s, "save_deferred") == []


def test_a_stop_during_a_write_leaves_with_it_and_says_so(session: Any, clock: Clock) -> None:
    s = session()
    _writing(s, 10)  # its blocking part ends now
    clock.now += 2.5
    s.pacing.iteration_ended()  # the boundary of iteration 15, where the stop is decided
    clock.now += 9.5
    s.save_complete(10)  # the stop's wait for it: a write of 12 s in all
    assert s.leave_with_written(15, "stop", 10)
    (replaced,) = _events(s, "stop_save_replaced")
    assert {k: replaced[k] for k in ("iteration", "checkpoint", "iterations_lost", "trained_since_s", "write_s")} == \
        {"iteration": 15, "checkpoint": 10, "iterations_lost": 5, "trained_since_s": 2.5, "write_s": 12.0}
    s.acted(Decision.SIGNAL, 15)
    (decision,) = _events(s, "decision")
    assert (decision["decision"], decision["iteration"], decision["checkpoint"]) == ("signal", 15, 10)


def test_a_stop_after_an_unusually_slow_write_writes_its_own(session: Any, clock: Clock) -> None:
    s = session()
    for iteration in (10, 20):  # writes of 2 s
        _writing(s, iteration)
        clock.now += 2.0
        s.save_complete(iteration)
    _writing(s, 30)
    clock.now += 12.0
    s.pacing.iteration_ended()
    clock.now += 0.5
    s.save_complete(30)  # written in 12.5 s (the disk busy); 12 s of training since, a write is ~2 s
    assert not s.leave_with_written(40, "stop", 30)
    assert not s.leave_with_written(100, "stop", 30)  # train_iters
    assert _events(s, "stop_save_replaced") == []


@pytest.mark.timeout(60)
def test_a_periodic_save_that_fits_does_not_wait_for_retentions_deletions(session: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    s = session()
    release = threading.Event()
    deleting = threading.Thread(target=release.wait, name="delete-iter_0000010", daemon=True)
    deleting.start()
    monkeypatch.setattr(resume, "_deleters", [deleting])
    try:
        assert s.before_save(20, "periodic")  # returns with the deletion still running (else: the timeout)
        assert deleting.is_alive()
    finally:
        release.set()
    waits: list[str] = []
    monkeypatch.setattr(resume, "wait_for_deletions", lambda timeout=None: waits.append("waited"))
    assert s.before_save(21, "stop") and waits == ["waited"]  # a stop save counts on the space they free
    monkeypatch.setenv(save_pacing.PACING_ENV, "0")
    assert session().before_save(30, "periodic") and waits == ["waited", "waited"]  # before pacing: always
