"""The training entry's bookkeeping, without Megatron, through its Session (runtime/session.py): decisions
acted on (log, ledger, consumed triggers), the verdict that becomes outcome.json, saves and loads as
progress shows them, the Megatron argument list, rank environment."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.unit.report_chain import REPORT_CHAIN_GROUP

from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import Decision, TriggerBox
from megalaunch.runtime.loop.step import megatron_argv
from megalaunch.runtime.rank.dist_env import export_rank_env
from megalaunch.runtime.rank.fault_hooks import parse_hang
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.session import Session
from megalaunch.runtime.stop.signals import SignalFlag


def _session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> Iterator[Session]:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "42")
    paths = RunPaths(tmp_path)
    for d in (paths.triggers, paths.state, paths.checkpoints):
        d.mkdir(parents=True, exist_ok=True)
    flag = SignalFlag()
    yield Session(paths, RuntimeSettings(train_iters=100, save_interval=10), flag, rank=rank, world=2)
    flag.restore()


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    yield from _session(tmp_path, monkeypatch, rank=0)


@pytest.fixture
def rank1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Session]:
    yield from _session(tmp_path, monkeypatch, rank=1)


def test_acted_logs_consumes_and_records(session: Session, capsys: pytest.CaptureFixture[str]) -> None:
    (session.ctx.paths.triggers / "exit").write_text(json.dumps({"user": "ada", "reason": "done"}))
    (session.ctx.paths.triggers / "save").write_text("{}")
    session.acted(Decision.EXIT, 37)
    assert "[megalaunch rank 0] decision exit at iteration 37" in capsys.readouterr().out
    assert {(r["verb"], r["consumed_iteration"], r["consumed_by_job"]) for r in TriggerBox(session.ctx.paths).consumed()} == {
        ("exit", 37, "42"), ("save", 37, "42")}
    (rec,) = read_jsonl(session.ctx.paths.ledger)
    assert (rec["event"], rec["decision"], rec["iteration"], rec["job_id"]) == ("decision", "exit", 37, "42")
    assert sorted(rec["triggers"]) == ["exit", "save"]


def test_signal_also_satisfies_a_pending_save(session: Session) -> None:
    (session.ctx.paths.triggers / "save").write_text("{}")
    session.acted(Decision.SIGNAL, 5)
    assert [r["verb"] for r in TriggerBox(session.ctx.paths).consumed()] == ["save"]


def test_other_ranks_only_log(rank1: Session, capsys: pytest.CaptureFixture[str]) -> None:
    (rank1.ctx.paths.triggers / "abort").write_text("{}")
    rank1.acted(Decision.ABORT, 9)
    assert "[megalaunch rank 1] decision abort at iteration 9" in capsys.readouterr().out
    assert (rank1.ctx.paths.triggers / "abort").exists() and not rank1.ctx.paths.ledger.exists()


@pytest.mark.parametrize(("decision", "iteration", "early", "status"), [
    (Decision.CONTINUE, 100, False, "finished"),
    (Decision.SIGNAL, 100, True, "finished"),  # the signal came at the last iteration
    (Decision.SIGNAL, 40, True, "saved"),
    (Decision.EXIT, 40, True, "exited"),
    (Decision.ABORT, 100, True, "aborted"),
    (Decision.SAVE, 40, True, "failed"),  # Megatron left its loop for a reason of its own
    (Decision.CONTINUE, 0, False, "failed"),
])
def test_verdict(session: Session, decision: Decision, iteration: int, early: bool, status: str) -> None:
    session.decisions.decision, session.decisions.decision_iteration = decision, iteration
    session.observe.iteration = iteration
    assert session.verdict(exited_early=early)[0] == status


def test_parse_hang() -> None:
    assert parse_hang(None, 0) is None
    assert parse_hang("4", 0) == 4 and parse_hang("4", 1) is None
    assert parse_hang("4:1", 1) == 4 and parse_hang("4:1", 0) is None


def test_megatron_argv_is_the_rendered_file_verbatim(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.megatron_args.write_text("--num-layers\n2\n--save\n/x y\n")
    assert megatron_argv(paths) == ["--num-layers", "2", "--save", "/x y"]


def test_cpu_tensorboard_and_profile_flags_are_rendered(tmp_path: Path) -> None:
    from megalaunch.config.loader import load_recipe
    from megalaunch.config.megatron_args import megatron_args

    cpu = megatron_args(load_recipe("tiny", ["logging.tensorboard=true"]).recipe, RunPaths(tmp_path))
    assert cpu[cpu.index("--distributed-backend") + 1] == "gloo" and "--use-cpu-initialization" in cpu
    assert cpu[cpu.index("--tensorboard-dir") + 1] == str(tmp_path / "tensorboard")
    gpu = megatron_args(load_recipe("llama3-8b").recipe, RunPaths(tmp_path))
    assert "--distributed-backend" not in gpu and "--tensorboard-dir" not in gpu


def test_rank_env_from_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    r = export_rank_env()
    assert (r.rank, r.world_size, r.local_rank) == (5, 8, 1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")


def test_a_save_between_two_log_intervals_moves_progress_up_to_the_checkpoint(session: Session) -> None:
    from megalaunch.rundir.state import read_progress, write_progress

    write_progress(session.ctx.paths, iteration=170, consumed_samples=1360, loss=2.5, tokens_per_s=900.0)
    assert session.before_save(173, "stop")  # a save on the signal at 173, between the reports at 170 and 180
    session.after_save(173)
    progress = read_progress(session.ctx.paths)
    assert progress["iteration"] == 173 and progress["job_id"] == "42"
    assert progress["loss"] == 2.5 and progress["tokens_per_s"] == 900.0  # the last measured values
    write_progress(session.ctx.paths, iteration=180, consumed_samples=1440, loss=2.4)
    assert session.before_save(180, "periodic")
    session.after_save(180)
    assert read_progress(session.ctx.paths)["consumed_samples"] == 1440  # not lagging: left as it is


def test_a_resumed_segment_starts_its_progress_at_the_checkpoint_it_loaded(session: Session) -> None:
    from megalaunch.rundir.state import read_progress, write_progress

    write_progress(session.ctx.paths, iteration=400, consumed_samples=3200, loss=2.0)  # before `resume --from 200`
    session.loaded(200, 1600)
    progress = read_progress(session.ctx.paths)
    assert (progress["iteration"], progress["consumed_samples"], progress["loss"]) == (200, 1600, None)


@REPORT_CHAIN_GROUP
def test_a_segments_first_wandb_step_carries_the_chains_goodput(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                report_chain: RunPaths) -> None:
    """`job end` writes state/goodput.json after every segment (a real 3-segment chain on the local
    backend); the next segment's first W&B step carries it as chain/*, with its own start-up phases."""
    import shutil

    from megalaunch.launcher.accounting.goodput import chain_goodput
    from megalaunch.rundir.files import read_json
    from megalaunch.runtime.observation.wandb_run import segment_start

    shutil.copytree(report_chain.root, tmp_path / report_chain.root.name)  # the session below writes into it
    paths = RunPaths(tmp_path / report_chain.root.name)
    written = read_json(paths.goodput)
    assert written["segments"] >= 3 and 0 < written["goodput"] < 1  # tests/unit/report_chain.py: 3, more when slow
    again = chain_goodput(paths, written["time"])
    assert again["goodput"] == pytest.approx(written["goodput"], abs=1e-6)  # the accounting, not a copy
    from megalaunch.rundir.ledger import Ledger

    last = Ledger(paths).segments()[-1].job_id  # stands in for the next segment (same code path)
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", last)
    flag = SignalFlag()
    try:
        s = Session(paths, RuntimeSettings(train_iters=100, save_interval=10), flag, rank=0, world=1)
        for phase in ("setup_done", "model_build_start", "load_start", "load_end", "data_end", "first_iteration_end"):
            s.observe.phase(phase)
        got = segment_start(paths, s.observe.timeline.data["phases"], s.ctx.job_id)
    finally:
        flag.restore()
    assert got["chain/goodput"] == written["goodput"] and got["chain/wall_s"] == written["wall_s"]
    assert got["chain/productive_s"] == written["totals_s"]["productive"] > 0
    assert {"segment/imports_s", "segment/checkpoint_load_s", "segment/first_iteration_s", "segment/startup_s"} <= got.keys()
    assert got["segment/index"] == written["segments"]  # its number as status and logs show it
