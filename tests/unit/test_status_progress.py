"""`status` on a run directory written by megalaunch's own writers: the iteration it shows is never
behind the last checkpoint, and tokens/s and the ETA come from a window of recent log intervals (the
run's average once nothing runs), never from zero."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.helpers import counter_recipe

from megalaunch.launcher.prepare import prepare_submission, write_run
from megalaunch.launcher.status import format_run_status, run_status
from megalaunch.rundir.files import append_jsonl, atomic_write_text
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import shown_iteration, write_progress


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    recipe = counter_recipe(tmp_path, training="{train_iters: 400}")
    return write_run(prepare_submission(str(recipe), []))


def test_progress_behind_the_checkpoint_is_shown_at_the_checkpoint(paths: RunPaths) -> None:
    write_progress(paths, iteration=170, loss=2.0)
    atomic_write_text(paths.tracker, "173\n")  # as Megatron's tracker after a save on the signal
    st = run_status(paths)
    assert (st["iteration"], st["last_checkpoint"]) == (173, 173)
    assert "iteration: 173 / 400   last checkpoint: 173" in format_run_status(st)
    write_progress(paths, iteration=190, loss=2.0)  # training went on past the checkpoint
    assert run_status(paths)["iteration"] == 190


def test_shown_iteration() -> None:
    assert shown_iteration(None, None) is None
    assert shown_iteration({"iteration": 5}, None) == 5
    assert shown_iteration(None, 20) == 20
    assert shown_iteration({"iteration": 19}, 20) == 20
    assert shown_iteration({"iteration": 21}, 20) == 21
