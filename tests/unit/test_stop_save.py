"""One save per stop (docs/training.md, "The signal lead"): the signal window rule, the lead from the
saves measured, how `job begin` raises it for the successor, the async-save default, and the session's
hooks around an asynchronous save. Pure functions and real run directories; no Megatron."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.megatron_args import async_save
from megalaunch.launcher.backends.slurm_backend import SlurmBackend
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.signal_lead import measured_lead_s, plan_lead, segment_step_s, stop_lines
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import atomic_write_json, read_jsonl
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import Decision, TriggerBox
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.session import Session
from megalaunch.runtime.stop.signals import SignalFlag
from megalaunch.runtime.stop.stop_window import (
    DEADLINE_ENV,
    find_deadline,
    inside_signal_window,
    parse_end_time,
    window_opens,
)


def test_the_window_opens_lead_plus_the_signal_delay_before_the_limit() -> None:
    assert window_opens(1000.0, 100, 30) == 870.0
    assert not inside_signal_window(869.9, 1000.0, 100, 30)
    assert inside_signal_window(870.0, 1000.0, 100, 30)  # a save due at the opening is skipped
    assert inside_signal_window(999.0, 1000.0, 100, 0)
    assert not inside_signal_window(10**10, None, 100, 30)  # unknown deadline: no skipping
    assert not inside_signal_window(10**10, 1000.0, None, 30)  # unknown lead (an older run)


def test_the_deadline_from_the_environment_or_squeues_end_time() -> None:
    assert find_deadline({DEADLINE_ENV: "1234.5"}) == 1234.5
    assert find_deadline({"SLURM_JOB_END_TIME": "99"}) == 99.0
    assert find_deadline({}) is None
    assert parse_end_time("2026-11-27T06:31:00\n") == time.mktime((2026, 11, 27, 6, 31, 0, 0, 0, -1))
    assert parse_end_time("N/A") is None and parse_end_time("") is None


def test_the_lead_arithmetic() -> None:
    # slowest save 40 s x 1.25 + step 2 + Slurm's 30 s + margin 10
    assert measured_lead_s(40.0, 2.0, 30, 10) == 92
    assert measured_lead_s(40.0, 2.0, 0, 0, factor=1.0) == 42
    timeline = {"phases": {"first_iteration_end": 100.0, "last_iteration_end": 160.0},
                "iterations": {"first": 1, "last": 11}, "saves": [[5, 110.0, 130.0]]}
    assert segment_step_s(timeline) == pytest.approx(4.0)  # (60 s - 20 s saving) / 10 steps


def _settings(**kw: Any) -> RuntimeSettings:
    return RuntimeSettings(train_iters=100, save_interval=10, **kw)


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "7")
    paths = RunPaths(tmp_path)
    for d in (paths.triggers, paths.state, paths.checkpoints):
        d.mkdir(parents=True, exist_ok=True)
    flag = SignalFlag()

    def make(deadline_in_s: float | None, **kw: Any) -> Session:
        if deadline_in_s is not None:
            monkeypatch.setenv(DEADLINE_ENV, str(time.time() + deadline_in_s))
        return Session(paths, _settings(keep_last=1, **kw), flag, rank=0, world=1)

    yield make
    flag.restore()


def test_a_periodic_save_inside_the_window_is_skipped_and_recorded(session: Any) -> None:
    s = session(80, signal_lead_s=60, signal_delay_s=30)  # the window opened 10 s ago
    assert not s.before_save(20, "periodic")
    assert s.before_save(21, "stop") and s.before_save(22, "trigger")  # a stop or trigger save is never skipped
    (skip,) = [e for e in read_jsonl(s.ctx.paths.ledger) if e["event"] == "save_skipped"]
    assert (skip["iteration"], skip["reason"], skip["job_id"]) == (20, "inside the signal window", "7")
    assert "skipped inside the signal window" in stop_lines(read_jsonl(s.ctx.paths.ledger))[0]
    # the save at train_iters is the run's last: no stop save comes after it, so the window never skips it
    assert s.before_save(100, "periodic")
    assert [e["iteration"] for e in read_jsonl(s.ctx.paths.ledger) if e["event"] == "save_skipped"] == [20]


def test_outside_the_window_or_without_a_deadline_every_save_goes_ahead(session: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert session(200, signal_lead_s=60, signal_delay_s=30).before_save(20, "periodic")
    monkeypatch.delenv(DEADLINE_ENV)
    assert session(None, signal_lead_s=60, signal_delay_s=30).before_save(30, "periodic")
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() + 1))
    assert session(None).before_save(40, "periodic")  # a run made before the lead was recorded


def test_a_lead_raised_for_this_job_moves_its_window(session: Any) -> None:
    s = session(200, signal_lead_s=60, signal_delay_s=30)
    assert s.before_save(20, "periodic")
    Ledger(s.ctx.paths).append("lead_raised", job_id="7", **{"from": 60, "to": 180})
    assert not session(200, signal_lead_s=60, signal_delay_s=30).before_save(30, "periodic")


def test_an_async_save_is_accounted_when_complete(session: Any) -> None:
    """Retention and progress wait for the finalize; the blocking part is recorded when it returns."""
    s = session(None)
    done: list[int] = []
    s.checkpoints.after_save = lambda iteration, elapsed: done.append(iteration)
    assert s.before_save(10, "periodic")
    s.after_save(10, complete=False)
    assert done == [] and len(s.checkpoints.save_times) == 1 and s.observe.timeline.data["writes"] == []
    s.save_complete(10)
    (write,) = s.observe.timeline.data["writes"]
    assert done == [10] and write[0] == 10 and write[2] >= write[1]
    assert s.before_save(20, "periodic")
    s.after_save(20)  # synchronous: complete when it returns
    assert done == [10, 20] and len(s.observe.timeline.data["writes"]) == 2


def test_a_wait_for_an_asynchronous_save_is_save_time(session: Any) -> None:
    """Right after its save (a stop during it) the save's interval grows to the complete checkpoint;
    after iterations (before a stop save, the loop's end) the wait is one more interval of that checkpoint."""
    s = session(None)
    s.observe.timeline.iteration(9, flush=False)
    assert s.before_save(10, "periodic")
    s.after_save(10, complete=False)
    (begin, end) = s.observe.timeline.data["saves"][0][1:]
    s.save_waited(10, end + 0.01, end + 5.0)
    assert s.observe.timeline.data["saves"] == [[10, begin, end + 5.0]]
    s.observe.timeline.iteration(11, flush=False)
    assert s.before_save(20, "periodic")
    s.after_save(20, complete=False)
    s.observe.timeline.iteration(21, flush=False)  # training went on while it was writing
    now = s.observe.timeline.data["phases"]["last_iteration_end"]
    s.save_waited(20, now + 1.0, now + 3.0)
    saves = s.observe.timeline.data["saves"]
    assert [x[0] for x in saves] == [10, 20, 20] and saves[-1] == [20, now + 1.0, now + 3.0]
    assert s.checkpoints.save_times[-1] == pytest.approx(2.0) and len(s.checkpoints.save_times) == 4


def test_a_forced_decision_sees_a_stop_between_decision_points(session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from megalaunch.runtime.rank import collectives

    monkeypatch.setattr(collectives, "all_reduce_max", lambda value: value)  # one rank: the MAX is its own
    s = session(None, trigger_interval=5)
    TriggerBox(s.ctx.paths).write("exit", "test")
    assert s.decide(7) == Decision.CONTINUE  # not a decision point
    assert s.decide(7, force=True) == Decision.EXIT  # right after a save: decide now
    s.acted(Decision.EXIT, 7, after_save=True)
    (rec,) = [e for e in read_jsonl(s.ctx.paths.ledger) if e["event"] == "decision"]
    assert rec["during_save"] is True and rec["triggers"] == ["exit"]
    assert s.verdict(exited_early=True) == ("exited", "exit trigger at iteration 7")


def _timeline(paths: RunPaths, job: str, writes: list[list[float]]) -> None:
    paths.timeline(job).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(paths.timeline(job), {"job_id": job, "phases": {}, "saves": [], "writes": writes})


class _Scheduler:
    def __init__(self) -> None:
        self.leads: list[int | None] = []

    def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None,
                         signal_lead_s: int | None = None) -> str:
        self.leads.append(signal_lead_s)
        return str(200 + len(self.leads))

    def known_nodes(self, partition: str | None) -> None:
        return None

    def exclude(self, job_ids: list[str], nodes: list[str]) -> None: ...
    def cancel_jobs(self, job_ids: list[str]) -> None: ...

    def state(self, job_id: str) -> None:
        return None


def test_job_begin_raises_the_successors_lead_from_the_slowest_recent_save(tmp_path: Path) -> None:
    loaded = load_recipe("tiny", [f"run.root={tmp_path}", "checkpoint.save_time_estimate_s=10",
                                  "chain.step_time_estimate_s=1", "chain.signal_margin_s=5"])
    paths = write_run(prepare_run(loaded))
    settings = RuntimeSettings.load(paths)
    assert (settings.signal_lead_s, settings.signal_delay_s) == (16, 0)  # the local backend: save 10 + step 1 + 5
    sched = _Scheduler()
    chain = Chain(paths, sched)
    assert chain.begin("1").proceed and sched.leads == [None]  # nothing measured: the rendered lead
    _timeline(paths, "1", [[10, 100.0, 108.0]])  # 8 s: 8 x 1.25 + 1 + 5 = 16, not more than rendered
    chain.end("1", 0)
    assert chain.begin("201").proceed and sched.leads == [None, None]
    _timeline(paths, "201", [[20, 100.0, 103.0], [30, 200.0, 240.0]])  # a 40 s save
    chain.end("201", 0)
    assert chain.begin("202").proceed and sched.leads[-1] == 56  # 40 x 1.25 + 1 + 0 + 5
    (raised,) = [e for e in Ledger(paths).events() if e["event"] == "lead_raised"]
    assert (raised["job_id"], raised["from"], raised["to"], raised["slowest_save_s"]) == ("203", 16, 56, 40.0)
    assert "signal lead raised 16 -> 56 s" in stop_lines(Ledger(paths).events())[0]
    plan = plan_lead(paths, settings, recent=1)  # only the last segment that started (202: no timeline)
    assert plan is not None and not plan.raised
    _timeline(paths, "202", [[40, 0.0, 5000.0]])  # more than the 600 s limit leaves: capped
    capped = plan_lead(paths, settings)
    assert settings.max_signal_lead_s == 600 - 0 - loaded.recipe.chain.min_train_time_s  # limit - delay - min
    assert capped is not None and capped.capped and capped.lead == settings.max_signal_lead_s


def test_slurm_puts_a_raised_lead_on_the_successors_command_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    paths = write_run(prepare_run(load_recipe("tiny", [f"run.root={tmp_path}"])))
    seen: list[list[str]] = []
    backend = SlurmBackend.__new__(SlurmBackend)
    monkeypatch.setattr(backend, "_sbatch", lambda p, extra: seen.append(extra) or "9", raising=False)
    backend.submit_successor(paths, exclude=["n1"], signal_lead_s=95)
    backend.submit_successor(paths)
    assert seen == [["--dependency=singleton", "--exclude=n1", "--signal=USR2@95"], ["--dependency=singleton"]]


@pytest.mark.parametrize(("sets", "expected"), [
    (["cluster.gpus_per_node=0"], False),  # auto on the CPU: Megatron's persistent worker fails there
    (["cluster.gpus_per_node=1", "training.precision=bf16"], True),
    (["cluster.gpus_per_node=1", "checkpoint.ckpt_format=torch"], False),  # not a format async supports
    (["cluster.gpus_per_node=1", "checkpoint.async_save=false"], False),  # an explicit value stands
    (["cluster.gpus_per_node=0", "checkpoint.async_save=true"], True),  # (which preflight refuses)
])
def test_async_save_auto_is_on_with_gpus(sets: list[str], expected: bool) -> None:
    recipe = load_recipe("tiny", sets).recipe
    assert recipe.checkpoint.async_save in ("auto", True, False)
    assert async_save(recipe) is expected
