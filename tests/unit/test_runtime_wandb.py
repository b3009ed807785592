"""W&B: one run id per experiment, kept in RUN/state/wandb.json; steps only go forward; offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from megalaunch.rundir.files import read_json
from megalaunch.rundir.paths import RunPaths

pytest.importorskip("wandb")


def test_one_id_across_segments_and_monotonic_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megalaunch.runtime.observation.wandb_run import WandbRun, state_file

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    paths = RunPaths(tmp_path / "run")
    paths.state.mkdir(parents=True)
    first = WandbRun.open(paths, project="p", entity=None, mode="offline", name="exp", job_id="1")
    assert first.log(5, {"loss": 2.0}) and first.log(10, {"loss": 1.5, "tflops": None})
    first.finish()
    second = WandbRun.open(paths, project="p", entity=None, mode="offline", name="exp", job_id="2")
    assert second.run_id == first.run_id
    assert not second.log(10, {"loss": 9.9})  # already logged by the first segment (a crash replay)
    assert second.log(11, {"loss": 1.4})
    second.finish()
    state = read_json(state_file(paths))
    assert state["last_step"] == 11 and state["id"] == first.run_id
    assert state["sync_command"].startswith("wandb sync --include-offline ")
    runs = sorted((paths.root / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.split("-")[3] == first.run_id for r in runs)  # offline-run-DATE_TIME-ID[-N]
    assert "WANDB_API_KEY" not in "".join(p.read_text(errors="ignore") for p in paths.state.iterdir())
