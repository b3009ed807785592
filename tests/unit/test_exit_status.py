"""A command that waits for a local chain exits as the chain ended (issue #50): non-zero for a configuration
error, a first stage that failed or any other error; 0 when it finished (submit and resume alike)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from tests.unit.helpers import cli, counter_recipe

from megalaunch.config.loader import load_recipe
from megalaunch.launcher.backends import local
from megalaunch.launcher.chain.first_stage import Failed
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.settings import RuntimeSettings


@pytest.mark.parametrize(("kind", "reason", "needs_person", "outcome", "code"), [
    ("finished", "training reached its target (iteration 20)", False, "finished", 0),
    ("by_user", 'exit trigger by bob ("eval"): saved and stopped', False, "exited", 0),
    ("by_user", "exit trigger pending at segment start", False, None, 0),
    ("by_user", "abort trigger by bob: stopped without saving", False, "aborted", local.EXIT_STOPPED_UNSAVED),
    ("by_user", "cancelled by bob", False, "cancelled", local.EXIT_STOPPED_UNSAVED),
    ("needs_person", "configuration error, no retry can fix it: x", False, "config_error", local.EXIT_ERROR),
    ("needs_person", "3 consecutive segments without a new checkpoint (budget 3)", False, "failed", local.EXIT_ERROR),
    (None, "auto-requeue is off: one segment only", False, "saved", 0),  # saved for its time limit
    (None, "auto-requeue is off: one segment only", False, "hung", local.EXIT_ERROR),
    (None, "auto-requeue is off: one segment only", False, "aborted", local.EXIT_STOPPED_UNSAVED),
    (None, "the successor could not be queued", True, "saved", local.EXIT_ERROR),  # a pause a person must resume
    (None, "chain already stopped: x", False, None, local.EXIT_ERROR),
])
def test_exit_status_follows_how_the_chain_ended(kind, reason, needs_person, outcome, code) -> None:
    assert local.exit_status(kind, reason, needs_person, outcome) == code


def _run_dir(tmp: Path) -> RunPaths:
    (d,) = [p for p in (tmp / "runs").iterdir() if not p.name.startswith(".")]
    return RunPaths(d)


def test_config_error_exits_non_zero_and_a_finishing_resume_exits_zero(tmp_path: Path) -> None:
    recipe = counter_recipe(tmp_path, training="{train_iters: 20}")
    failed = cli("submit", str(recipe), env={"COUNTER_FAIL": "config_error"}, timeout=120)
    assert failed.returncode == local.EXIT_ERROR, failed.stdout + failed.stderr
    assert "done: configuration error" in failed.stdout and "did not finish (exit status 1)" in failed.stderr
    paths = _run_dir(tmp_path)
    assert [s.outcome for s in Ledger(paths).segments()] == ["config_error"]
    resumed = cli("resume", str(paths.root), env={"COUNTER_STEP_S": "0.01"}, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "done: training reached its target" in resumed.stdout
    assert [s.outcome for s in Ledger(paths).segments()] == ["config_error", "finished"]


def test_a_finishing_chain_exits_zero(tmp_path: Path) -> None:
    proc = cli("submit", str(counter_recipe(tmp_path, training="{train_iters: 20}")),
               env={"COUNTER_STEP_S": "0.01"}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s.outcome for s in Ledger(_run_dir(tmp_path)).segments()] == ["finished"]


def test_a_failed_first_stage_exits_non_zero(tmp_path: Path, monkeypatch) -> None:
    """As `submit --from-hf DIR --data DIR` with malformed chat files: the first stage refuses, no segment trains."""
    loaded = load_recipe("tiny", [f"run.root={tmp_path}", "training.train_iters=100"])
    prepared = prepare_run(loaded)
    paths = write_run(prepared)
    real = RuntimeSettings.load
    monkeypatch.setattr(local.RuntimeSettings, "load",
                        lambda p: dataclasses.replace(real(p), chat_files=str(tmp_path / "chats")))
    monkeypatch.setattr("megalaunch.launcher.chain.chain.tokenize_chats",
                        lambda *a: Failed("chats/a.jsonl rows 3, 7: no 'messages'", "fix the rows"))
    end = local.run_local_chain(paths, prepared.recipe, prepared.chain_name, echo=lambda line: None)
    assert end.exit_code == local.EXIT_ERROR and "no 'messages'" in end.reason
    assert not [s for s in Ledger(paths).segments() if s.started]
    started = local._started(paths, end)
    assert started.exit_code == local.EXIT_ERROR and started.job_id is None
