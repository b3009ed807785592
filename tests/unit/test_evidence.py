"""Which rank ended a segment first: supervisor records and Slurm's task-exit lines (parsing only;
tests/slurm kills a real rank), and what `job end` and `status` then say."""

from __future__ import annotations

from pathlib import Path

from megalaunch.launcher.accounting.evidence import TaskEnd, abnormal_ends, failure_reason
from megalaunch.rundir.files import atomic_write_json
from megalaunch.rundir.paths import RunPaths


def _record(paths: RunPaths, job: str, rank: int, node: str, ended: float, *, signal: str | None = None,
            code: int | None = 0) -> None:
    path = paths.task_record(job, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"rank": rank, "node": node, "ended": ended, "signal": signal,
                             "exit_code": None if signal else code})


def test_first_abnormal_end_by_time_then_slurm_lines(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    _record(paths, "9", 0, "node1", 105.0, code=1)
    _record(paths, "9", 1, "node2", 100.0, signal="SIGKILL")
    _record(paths, "9", 2, "node2", 99.0, code=0)  # a clean exit is no evidence
    log = tmp_path / "seg.out"
    log.write_text("iteration 5\nsrun: error: node2: task 1: Killed\n"
                   "srun: error: node3: tasks 3-4: Exited with exit code 1\nsrun: error: node1: task 5: Segmentation fault\n")
    ends = abnormal_ends(paths, "9", log)
    assert [(e.rank, e.node) for e in ends] == [(1, "node2"), (0, "node1"), (3, "node3"), (4, "node3"), (5, "node1")]
    assert ends[0].describe() == "rank 1 on node2 was killed by SIGKILL"
    assert ends[2].describe() == "rank 3 on node3 exited with status 1 (per Slurm)"
    assert ends[4].describe() == "rank 5 on node1 ended: Segmentation fault (per Slurm)"


def test_slurm_line_alone_names_the_rank(tmp_path: Path) -> None:
    log = tmp_path / "seg.out"
    log.write_text("srun: error: node2: task 1: Killed\nsrun: Terminating StepId=5.0\n")
    (first,) = abnormal_ends(RunPaths(tmp_path), "5", log)
    assert first.describe() == "rank 1 on node2 was killed (SIGKILL, per Slurm)"


def test_failure_reason_puts_the_cause_first() -> None:
    gloo = "RuntimeError: [gloo] Connection reset by peer"
    killed = TaskEnd(rank=1, node="node2", how="was killed by SIGKILL", time=1.0)
    assert failure_reason(killed, gloo, 137) == f"rank 1 on node2 was killed by SIGKILL first; rank 0 then: {gloo}"
    assert failure_reason(killed, None, 137) == "rank 1 on node2 was killed by SIGKILL first; no outcome written"
    own = TaskEnd(rank=0, node="node1", how="exited with status 1", time=1.0)
    assert failure_reason(own, "ValueError: bad", 1) == "ValueError: bad (rank 0 on node1)"
    assert failure_reason(None, None, 143) == "no outcome written (exit status 143)"


def _error(paths: RunPaths, job: str, rank: int, reason: str, when: float) -> None:
    path = paths.tasks(job) / f"error-rank-{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"rank": rank, "reason": reason, "time": when, "config": False})


def test_a_rank_whose_collective_lost_its_peer_is_not_the_first_failure(tmp_path: Path) -> None:
    """Seen on the CI cluster: rank 1 was killed with SIGKILL; rank 0's gloo all-reduce failed with
    "Connection reset by peer" and its supervisor recorded its exit 44 ms before rank 1's."""
    paths = RunPaths(tmp_path)
    _record(paths, "9", 0, "node1", 100.00, code=1)
    _record(paths, "9", 1, "node2", 100.04, signal="SIGKILL")
    _error(paths, "9", 0, "RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer.", 99.9)
    assert [e.rank for e in abnormal_ends(paths, "9")] == [1, 0]
    # a rank that crashed on its own stays first, even when another is killed right after
    other = RunPaths(tmp_path / "b")
    _record(other, "9", 0, "node1", 100.00, code=1)
    _record(other, "9", 1, "node2", 100.04, signal="SIGKILL")
    _error(other, "9", 0, "RuntimeError: CUDA error: an illegal memory access was encountered", 99.9)
    assert [e.rank for e in abnormal_ends(other, "9")] == [0, 1]
    # a peer lost long before anything else ended: nothing to put before it
    late = RunPaths(tmp_path / "c")
    _record(late, "9", 0, "node1", 100.0, code=1)
    _record(late, "9", 1, "node2", 160.0, signal="SIGKILL")
    _error(late, "9", 0, "RuntimeError: Connection reset by peer", 99.9)
    assert [e.rank for e in abnormal_ends(late, "9")] == [0, 1]


def test_only_the_srun_lines_after_the_last_in_job_restart_count(tmp_path: Path) -> None:
    from megalaunch.launcher.accounting.evidence import RESTART_MARKER

    log = tmp_path / "seg.out"
    log.write_text(f"srun: error: node2: task 1: Killed\n{RESTART_MARKER} step 1 of segment 5 after failed\n"
                   "srun: error: node1: task 0: Exited with exit code 3\n")
    assert [(e.rank, e.node) for e in abnormal_ends(RunPaths(tmp_path), "5", log)] == [(0, "node1")]


def test_a_hardware_signature_before_the_last_in_job_restart_is_not_held_against_the_next_step(tmp_path: Path) -> None:
    """The node an earlier step's Xid named was judged (and kept off) at that restart; the last step, which
    failed on its own, is attributed from its own lines only."""
    from megalaunch.launcher.accounting.evidence import RESTART_MARKER
    from megalaunch.launcher.accounting.nodes import attribute

    log = tmp_path / "seg.out"
    xid = "[node3] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus\n"
    log.write_text(f"{xid}{RESTART_MARKER} step 1 of segment 5 after failed\nsrun: error: node1: task 0: Killed\n")
    ends = abnormal_ends(RunPaths(tmp_path), "5", log)
    assert set(attribute(ends, log, ["node1", "node3"]).suspects) == {"node1"}
    log.write_text(xid + "srun: error: node1: task 0: Killed\n")  # one step: the Xid counts
    assert set(attribute(abnormal_ends(RunPaths(tmp_path), "5", log), log, ["node1", "node3"]).suspects) == {"node1", "node3"}


def test_a_node_that_died_is_the_cause_not_the_ranks_that_lost_it(tmp_path: Path) -> None:
    """Seen on the scale cluster (a node's slurmd, slurmstepd and tasks SIGKILLed): the survivors failed on
    their collective with it and exited 1 first; srun then said `Node failure on snode4`. The dead node's
    ranks left no record at all."""
    from megalaunch.launcher.accounting.evidence import NODE_LOST, RESTART_MARKER, failure_reason
    from megalaunch.launcher.accounting.nodes import attribute

    paths = RunPaths(tmp_path)
    _record(paths, "9", 0, "snode1", 100.0, code=1)
    _record(paths, "9", 1, "snode2", 100.1, code=1)
    _error(paths, "9", 0, "PeerLost: connection closed by peer: rank 3 on snode4", 99.9)
    _error(paths, "9", 1, "PeerLost: connection closed by peer: rank 0 on snode1", 99.95)
    log = tmp_path / "seg.out"
    log.write_text("srun: error: snode1: task 0: Exited with exit code 1\n"
                   "srun: error: snode2: task 1: Exited with exit code 1\nsrun: error: Node failure on snode4\n")
    ends = abnormal_ends(paths, "9", log)
    assert (ends[0].rank, ends[0].node) == (NODE_LOST, "snode4") and [e.rank for e in ends[1:]] == [0, 1]
    assert ends[0].describe() == "snode4 was lost (Slurm: node failure)"
    assert failure_reason(ends[0], "failed", 1).startswith("snode4 was lost (Slurm: node failure) first")
    assert set(attribute(ends, log, ["snode1", "snode2", "snode4"]).suspects) == {"snode4"}
    # a node failure of an earlier step was judged at its restart
    log.write_text(f"srun: error: Node failure on snode4\n{RESTART_MARKER} step 1\n"
                   "srun: error: snode1: task 0: Exited with exit code 1\n")
    assert "snode4" not in {e.node for e in abnormal_ends(paths, "9", log)}
