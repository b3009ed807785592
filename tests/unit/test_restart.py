"""In-job restart decisions (launcher/chain/restart.py) against a real run directory, with the scheduler
stand-in of test_chain.py; the Slurm side (a killed rank, a spare node) is in tests/slurm/test_restart_slurm.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tests.unit.test_chain import RecordingScheduler

from megalaunch.config.loader import load_recipe
from megalaunch.errors import ConfigError
from megalaunch.launcher.accounting.goodput import chain_goodput
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.chain.restart import archive_step, startup_estimate, step_end, step_nodes
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import run_status
from megalaunch.launcher.status_format import format_run_status
from megalaunch.rundir.files import atomic_write_json, atomic_write_text
from megalaunch.rundir.paths import RunPaths, step_file
from megalaunch.rundir.state import write_outcome
from megalaunch.rundir.triggers import TriggerBox


def _chain(tmp_path: Path, *sets: str) -> tuple[RunPaths, Chain]:
    loaded = load_recipe("tiny", [f"run.root={tmp_path}", "cluster.backend=slurm", "training.train_iters=100",
                                  "chain.restarts_per_segment=2", "chain.max_segments_without_progress=3", *sets])
    paths = write_run(prepare_run(loaded))
    return paths, Chain(paths, RecordingScheduler())


@pytest.fixture()
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("MEGALAUNCH_DEADLINE", str(time.time() + 3600))
    return monkeypatch


def _timeline(paths: RunPaths, data: dict[str, object]) -> None:
    paths.timeline("7").parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(paths.timeline("7"), data)


def _fail(paths: RunPaths, status: str = "failed", **kw: object) -> None:
    write_outcome(paths, status, reason=f"test: {status}", **kw)  # type: ignore[arg-type]


def test_a_failed_step_restarts_and_its_evidence_moves_aside(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, chain = _chain(tmp_path)
    chain.begin("7")
    assert step_nodes(chain, "7", 0) == ["node1"]  # tiny: 1 node; node2 is left over
    atomic_write_text(paths.tracker, "20\n")
    _fail(paths)
    paths.tasks("7").mkdir(parents=True)
    (paths.tasks("7") / "rank-00000.json").write_text('{"rank": 0, "signal": "SIGKILL", "node": "node1"}')
    _timeline(paths, {"phases": {"process_start": 1.0}})
    end = step_end(chain, "7", 0, 137)
    assert end.restart and end.status == "failed"
    assert not paths.outcome.exists() and not paths.tasks("7").exists() and not paths.timeline("7").exists()
    assert Path(step_file(paths.tasks("7"), 0)).is_dir() and Path(step_file(paths.timeline("7"), 0)).exists()
    (restart,) = [e for e in chain.ledger.events() if e["event"] == "restart"]
    assert restart["step"] == 1 and restart["exclude"] == ["node1"] and restart["checkpoint_iteration"] == 20
    # the next step avoids the node that failed, where the allocation has another
    assert step_nodes(chain, "7", 1) == ["node2"]


def test_the_records_name_a_whole_save_the_tracker_never_reached(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    """Rank 1 killed in save 15's last barrier, after every file was written (CI): Megatron never moved the
    tracker from 10, the next step resumes from 15, and the restart and the segment's end say 15, not 10."""
    from tests.unit.test_runtime_resume import dist_checkpoint

    paths, chain = _chain(tmp_path)
    dist_checkpoint(paths, 10)
    chain.begin("7")
    assert step_nodes(chain, "7", 0) == ["node1"]
    dist_checkpoint(paths, 15)
    atomic_write_text(paths.tracker, "10\n")
    _fail(paths)
    assert step_end(chain, "7", 0, 137).restart
    (restart,) = [e for e in chain.ledger.events() if e["event"] == "restart"]
    assert restart["checkpoint_iteration"] == 15 and restart["new_checkpoint"] is True, restart
    _fail(paths)
    chain.end("7", 1)
    (ended,) = [e for e in chain.ledger.events() if e["event"] == "ended"]
    assert ended["checkpoint_iteration"] == 15 and ended["new_checkpoint"] is True, ended
    # and the tracker names it now, for `status`, `convert` and evaluation of a chain that stops here
    assert paths.read_tracker() == 15
    (moved,) = [e for e in chain.ledger.events() if e["event"] == "tracker_moved"]
    assert (moved["from"], moved["to"], moved["job_id"]) == (10, 15, "7"), moved


def test_a_failed_node_without_a_spare_is_used_again_and_the_records_say_so(
        tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    env.setenv("SLURM_JOB_NODELIST", "node1")  # the only node of the allocation
    paths, chain = _chain(tmp_path)
    chain.begin("7")
    assert step_nodes(chain, "7", 0) == ["node1"]
    _fail(paths)
    paths.tasks("7").mkdir(parents=True)
    (paths.tasks("7") / "rank-00000.json").write_text('{"rank": 0, "signal": "SIGKILL", "node": "node1"}')
    assert step_end(chain, "7", 0, 137).restart
    (restart,) = [e for e in chain.ledger.events() if e["event"] == "restart"]
    assert restart["exclude"] == [] and "no spare node" in restart["kept"]["node1"], restart
    assert step_nodes(chain, "7", 1) == ["node1"]
    text = format_run_status(run_status(paths))
    assert "kept off" not in text and "node1 used again (no spare node" in text, text


@pytest.mark.parametrize("status", ["config_error", "storage_full", "exited", "aborted", "finished", "saved"])
def test_what_no_restart_fixes_is_never_restarted(tmp_path: Path, env: pytest.MonkeyPatch, status: str) -> None:
    paths, chain = _chain(tmp_path)
    chain.begin("7")
    step_nodes(chain, "7", 0)
    _fail(paths, status)
    assert not step_end(chain, "7", 0, 1).restart
    assert paths.outcome.exists()  # `job end` judges it
    assert not [e for e in chain.ledger.events() if e["event"] in ("restart", "restart_refused")]


def test_the_budget_the_guard_the_time_left_and_a_pending_exit_refuse(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, chain = _chain(tmp_path, "chain.restarts_per_segment=1")
    chain.begin("7")
    for step in (0, 1):
        step_nodes(chain, "7", step)
        _fail(paths)
        end = step_end(chain, "7", step, 1)
        assert end.restart == (step == 0), end
    assert "used its 1 restart" in end.reason
    # the crash-loop guard counts restarted steps: 2 failed steps + this one = the budget of 3
    paths2, chain2 = _chain(tmp_path / "b", "chain.restarts_per_segment=5")
    chain2.begin("7")
    reasons = []
    for step in range(3):
        step_nodes(chain2, "7", step)
        _fail(paths2)
        reasons.append(step_end(chain2, "7", step, 1))
    assert [r.restart for r in reasons] == [True, True, False] and "crash-loop guard" in reasons[-1].reason
    # too little time left for a start-up + min_train_time_s + the lead
    paths3, chain3 = _chain(tmp_path / "c")
    chain3.begin("7")
    step_nodes(chain3, "7", 0)
    _fail(paths3)
    env.setenv("MEGALAUNCH_DEADLINE", str(time.time() + 100))
    end = step_end(chain3, "7", 0, 1)
    assert not end.restart and "s left in the allocation" in end.reason
    # a pending exit trigger: the segment ends, `job begin` of the next one acts on it
    env.setenv("MEGALAUNCH_DEADLINE", str(time.time() + 3600))
    TriggerBox(paths3).write("exit", "test")
    assert "exit trigger is pending" in step_end(chain3, "7", 0, 1).reason


def test_an_unhealthy_node_restarts_only_where_a_spare_can_replace_it(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    env.setenv("SLURM_JOB_NODELIST", "node1")
    paths, chain = _chain(tmp_path)
    chain.begin("7")
    step_nodes(chain, "7", 0)
    _fail(paths, "unhealthy_node", health_check={"unhealthy_nodes": ["node1"], "ranks": []})
    end = step_end(chain, "7", 0, 0)
    assert not end.restart and "no healthy node left" in end.reason
    env.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    assert step_end(chain, "7", 0, 0).restart
    assert step_nodes(chain, "7", 1) == ["node2"]


def test_goodput_has_a_restart_part_and_status_shows_the_restart(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, chain = _chain(tmp_path)
    chain.begin("7")
    t0 = time.time()
    step_nodes(chain, "7", 0)
    _timeline(paths, {"phases": {"process_start": t0 + 1, "setup_done": t0 + 2,
                                                       "model_build_start": t0 + 3, "load_start": t0 + 4,
                                                       "load_end": t0 + 5, "data_end": t0 + 6,
                                                       "first_iteration_end": t0 + 7, "last_iteration_end": t0 + 9}})
    _fail(paths)
    assert step_end(chain, "7", 0, 1).restart
    step_nodes(chain, "7", 1)
    _timeline(paths, {"phases": {"process_start": time.time() + 0.5, "data_end": time.time() + 1}})
    g = chain_goodput(paths, time.time() + 2)
    (seg,) = g["segments"]
    assert g["totals"]["restart"] > 0 and abs(seg["wall"] - (time.time() + 2 - seg["start"])) < 0.5
    assert startup_estimate(paths) == pytest.approx(6 * 1.25 + 5, abs=0.01)  # the archived step's timeline
    st = format_run_status(run_status(paths))
    assert "in-job restart: job 7 started step 1 after failed (test: failed)" in st, st


def test_archive_keeps_another_jobs_outcome(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    paths, _ = _chain(tmp_path)
    env.setenv("MEGALAUNCH_JOB_ID", "6")
    _fail(paths)
    archive_step(paths, "7", 0)
    assert json.loads(paths.outcome.read_text())["job_id"] == "6"


@pytest.mark.parametrize("value", ["-1", "101"])
def test_restart_and_spare_fields_are_checked(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="restarts_per_segment"):
        load_recipe("tiny", [f"run.root={tmp_path}", f"chain.restarts_per_segment={value}"])
    with pytest.raises(ConfigError, match="spare_nodes"):
        load_recipe("tiny", [f"run.root={tmp_path}", "cluster.spare_nodes=-1"])
    with pytest.raises(ConfigError, match="spare_nodes needs backend: slurm"):
        load_recipe("tiny", [f"run.root={tmp_path}", "cluster.backend=local", "cluster.spare_nodes=1"])


def test_a_restart_is_told_with_on_every_segment_and_only_then(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    from tests.unit.test_notify import Hook

    hook = Hook()
    try:
        for every, told in (("false", 0), ("true", 1)):
            paths, chain = _chain(tmp_path / every, f"chain.notify.webhooks=['{hook.url}']",
                                  f"chain.notify.on_every_segment={every}")
            chain.begin("7")
            step_nodes(chain, "7", 0)
            _fail(paths)
            assert step_end(chain, "7", 0, 1).restart
            assert len(hook.messages()) == told
        (msg,) = hook.messages()
        assert (msg["outcome"], msg["segment"], msg["needs_person"]) == ("restarted", "failed", False)
        assert msg["reason"].startswith("step 1 started in the same job after failed"), msg
    finally:
        hook.close()


def test_status_reuses_the_segments_the_last_job_end_cut(tmp_path: Path, env: pytest.MonkeyPatch) -> None:
    """A chain of thousands of segments: `status` takes an ended segment's cut from state/goodput.json
    (written at every `job end`) instead of re-reading its timeline; a segment whose end changed since,
    or a cut of another version, is cut again."""
    from megalaunch.launcher.accounting.goodput import write_chain_goodput

    paths, chain = _chain(tmp_path)
    paths.timeline("7").parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time() - 1000
    for i, jid in enumerate(["7", "8"]):
        start = t0 + 300 * i
        chain.ledger.append("started", job_id=jid, checkpoint_iteration=None, time=start)
        atomic_write_json(paths.timeline(jid), {"phases": {"process_start": start + 1, "first_iteration_end": start + 20,
                                                           "last_iteration_end": start + 200, "exit": start + 210}})
        chain.ledger.append("ended", job_id=jid, outcome="saved", time=start + 211)
    write_chain_goodput(paths)
    before = chain_goodput(paths, time.time())
    for jid in ("7", "8"):
        paths.timeline(jid).unlink()  # not read again
    after = chain_goodput(paths, time.time())
    assert after["segments"] == before["segments"] and after["totals"] == before["totals"]
    assert before["totals"]["productive"] > 2 * 180  # training between the first and last iteration, at least
    # an older cut's version: recomputed (no timeline now: the whole segment is untracked)
    data = json.loads(paths.goodput.read_text())
    atomic_write_json(paths.goodput, {**data, "cut_version": 0})
    assert chain_goodput(paths, time.time())["totals"]["productive"] == 0
