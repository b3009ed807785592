"""A node of the step lost: the decision (runtime/health/node_loss.py) over the ranks known to have ended,
their reading from exit records and srun's lines, `job watch` ending the step with the line `job step-end`
reads, and that reading (launcher/accounting/evidence.py). The real thing, a node killed on the scale
cluster: tests/slurm/test_scale_slurm.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.unit.test_hangwatch import LIMITS, FakeClock, FakeSlurm, _paths

from megalaunch.launcher.accounting.evidence import NODE_LOST, abnormal_ends, lost_nodes
from megalaunch.rundir.files import atomic_write_json
from megalaunch.runtime.hangwatch import SlurmStep, watch
from megalaunch.runtime.health.heartbeat import Heartbeat
from megalaunch.runtime.health.node_loss import LOST_LINE, RESTART_MARKER, EndedRanks, NodeLoss, StepNodes

NODES = ["n1", "n2", "n3"]


def test_a_node_none_of_whose_ranks_ended_is_lost_once_the_others_ended_and_the_grace_passed() -> None:
    d = NodeLoss(NODES, tasks_per_node=2, grace_s=5)
    ended = {"n1": {0, 1}, "n3": {4, 5}}
    assert d.lost(100.0, ended, failed=True) == []  # first seen: the grace starts
    assert d.lost(104.9, ended, failed=True) == []
    assert d.lost(105.0, ended, failed=True) == ["n2"]


def test_no_loss_while_a_rank_of_another_node_runs_or_nothing_failed_or_every_node_is_silent() -> None:
    d = NodeLoss(NODES, tasks_per_node=2, grace_s=5)
    assert d.lost(100.0, {"n1": {0}, "n3": {4, 5}}, failed=True) == []  # rank 1 on n1 still runs
    assert d.lost(200.0, {"n1": {0}, "n3": {4, 5}}, failed=True) == []
    assert d.lost(300.0, {"n1": {0, 1}, "n3": {4, 5}}, failed=False) == []  # the step ending well
    assert d.lost(400.0, {}, failed=True) == []  # nothing ended anywhere: the hang watcher's business
    # the picture changed (n3's ranks ended later than n1's): the grace counts from the new one
    assert d.lost(500.0, {"n1": {0, 1}}, failed=True) == []  # n2, n3 silent
    assert d.lost(503.0, {"n1": {0, 1}, "n3": {4, 5}}, failed=True) == []
    assert d.lost(507.0, {"n1": {0, 1}, "n3": {4, 5}}, failed=True) == []
    assert d.lost(508.0, {"n1": {0, 1}, "n3": {4, 5}}, failed=True) == ["n2"]


def _record(tasks: Path, rank: int, node: str, **how: object) -> None:
    tasks.mkdir(parents=True, exist_ok=True)
    atomic_write_json(tasks / f"rank-{rank}.json", {"rank": rank, "node": node, **how})


def test_ended_ranks_come_from_records_and_from_srun_lines_of_this_step_only(tmp_path: Path) -> None:
    tasks, log = tmp_path / "tasks", tmp_path / "seg.out"
    log.write_text("srun: error: n2: tasks 2-3: Killed\n"  # the step before the restart: not this one's
                   f"{RESTART_MARKER} step 1 of segment 7 after failed\n")
    ranks = EndedRanks(tasks, log)
    ranks.update()
    assert ranks.ended == {} and not ranks.failed
    _record(tasks, 0, "n1", exit_code=1)
    with open(log, "a") as f:
        f.write("srun: error: n1: task 1: Killed\nsrun: error: n3: tasks 4")  # the last line is not whole yet
    ranks.update()
    assert ranks.ended == {"n1": {0, 1}} and ranks.failed
    with open(log, "a") as f:
        f.write("-5: Killed\n")
    ranks.update()
    assert ranks.ended == {"n1": {0, 1}, "n3": {4, 5}}


def test_step_nodes_from_the_job_scripts_environment(tmp_path: Path) -> None:
    assert StepNodes.from_env(tmp_path, tmp_path / "log", {"MEGALAUNCH_STEP_NODES": "n1", "WORLD_SIZE": "4"}) is None
    assert StepNodes.from_env(tmp_path, tmp_path / "log", {"WORLD_SIZE": "4"}) is None
    s = StepNodes.from_env(tmp_path, tmp_path / "log", {"MEGALAUNCH_STEP_NODES": "n1,n2", "WORLD_SIZE": "8"})
    assert s is not None and s.decision.nodes == ["n1", "n2"] and s.decision.tasks_per_node == 4


def test_job_watch_ends_the_step_and_job_step_end_blames_the_lost_node(tmp_path: Path, monkeypatch, capsys) -> None:
    paths = _paths(tmp_path)
    monkeypatch.setenv("MEGALAUNCH_JOB_ID", "42")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    Heartbeat(paths, "42", enabled=True).beat("iteration")
    log = paths.segment_log("42")
    log.parent.mkdir(parents=True, exist_ok=True)
    # n2 died: n1's ranks lost their peer and exited, Slurm killed n3's; n2's never end
    _record(paths.tasks("42"), 0, "n1", exit_code=1, ended=1.0)
    _record(paths.tasks("42"), 1, "n1", exit_code=1, ended=1.1)
    log.write_text("srun: error: n3: tasks 4-5: Killed\n")
    slurm, clock = FakeSlurm(answer=True), FakeClock()
    loss = StepNodes(NODES, 2, paths.tasks("42"), log, grace_s=5)
    started = clock()
    how = watch(paths, "42", LIMITS, SlurmStep("42", os.getpid(), run=slurm), clock=clock, sleep=clock.sleep, loss=loss)
    assert how.startswith("cancelled step 42.0") and 5 <= clock() - started <= 7  # the grace and a tick
    assert [c for c in slurm.calls if c[0] == "scancel"] == [["scancel", "42.0"]]  # cancelled, not signalled
    lines = capsys.readouterr().err
    assert LOST_LINE.format(node="n2", grace=5) in lines, lines
    events = [json.loads(line) for line in paths.ledger.read_text().splitlines()]
    # (the watcher also records the hang limits in force: runtime/hangwatch.record_limits)
    assert [(e["event"], e["nodes"]) for e in events if e["event"] != "hang_limit"] == [("step_nodes_lost", ["n2"])]
    # the job script's output holds the watcher's line: the step's judgement reads it as srun's `Node failure`
    with open(log, "a") as f:
        f.write(lines)
    ends = abnormal_ends(paths, "42", log)
    assert ends[0].rank == NODE_LOST and ends[0].node == "n2" and "watcher" in ends[0].how, ends
    assert lost_nodes(log) == ["n2"]


def test_the_keepers_step_is_never_the_one_the_watcher_ends() -> None:
    """The keeper (launcher/backends/keeper.py) is a step of the job too, started before the training step:
    a watcher that cancelled 'every step' ended it (found on the scale cluster)."""
    import subprocess

    from megalaunch.runtime.health.slurm_step import KEEPER_STEP

    def squeue(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, f"42.0 {KEEPER_STEP}\n42.1 python\n42.batch batch\n", "")

    assert SlurmStep("42", os.getpid(), run=squeue).step_ids() == ["42.1"]
