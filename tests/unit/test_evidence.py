"""Which rank ended a segment first: supervisor records and Slurm's task-exit lines (parsing only;
tests/slurm kills a real rank), and what `job end` and `status` then say."""

from __future__ import annotations

from pathlib import Path

from megalaunch.launcher.evidence import TaskEnd, abnormal_ends, failure_reason
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
