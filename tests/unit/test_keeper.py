"""The keeper's decision (launcher/backends/keeper.py) over Slurm's answers, and its record in the run
(chain.Chain.batch_host_lost). The real thing, a batch host killed on the scale cluster, is in
tests/slurm/test_scale_slurm.py."""

from __future__ import annotations

import os

import pytest
from tests.unit.test_nodes import events, slurm_chain

from megalaunch.launcher.backends.keeper import batch_host_gone, keep
from megalaunch.launcher.backends.slurm import JobInfo


def _info(state: str, nodes: str) -> JobInfo:
    return JobInfo(job_id="7", name="x", state=state, reason="", nodes=nodes, batch_host="snode1")


def test_the_batch_host_is_gone_only_when_a_running_job_no_longer_lists_it() -> None:
    assert not batch_host_gone(_info("RUNNING", "snode[1-4]"), "snode1")
    assert batch_host_gone(_info("RUNNING", "snode[2-4]"), "snode1")
    assert not batch_host_gone(_info("COMPLETED", "snode[2-4]"), "snode1")  # over: nothing to end
    assert not batch_host_gone(_info("COMPLETING", "snode[2-4]"), "snode1")  # its script ended: nodes leave
    assert not batch_host_gone(_info("RUNNING", "(null)"), "snode1")
    assert not batch_host_gone(None, "snode1")  # Slurm did not answer


def test_keep_polls_through_silence_and_ends_the_job_when_its_host_is_gone() -> None:
    answers = [_info("RUNNING", "snode[1-4]"), RuntimeError("scontrol timed out"), None,
               _info("RUNNING", "snode[2-4]")]
    done: list[str] = []
    sleeps: list[float] = []

    def ask(job: str) -> JobInfo | None:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    got = keep("7", "snode1", ask=ask, on_lost=lambda why: done.append("recorded"),
               cancel=lambda j: done.append(f"scancel {j}"), poll_s=3, sleep=sleeps.append)
    assert got == "lost" and done == ["recorded", "scancel 7"] and sleeps == [3, 3, 3]


def test_keep_cancels_even_when_the_record_fails_and_stops_when_the_job_ends() -> None:
    cancelled: list[str] = []

    def broken(why: str | None) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        keep("7", "snode1", ask=lambda j: _info("RUNNING", "snode2"), on_lost=broken, cancel=cancelled.append,
             sleep=lambda s: None)
    assert cancelled == ["7"]
    assert keep("7", "snode1", ask=lambda j: _info("CANCELLED", "snode[1-2]"), on_lost=lambda why: None,
                cancel=cancelled.append, sleep=lambda s: None) == "ended" and cancelled == ["7"]


def test_a_lost_batch_host_ends_the_segment_in_the_ledger_and_is_a_suspect(tmp_path, monkeypatch) -> None:
    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 2, "node[1-2]")
    sched.nodes = ["node1", "node2", "node3"]
    assert chain.begin("11").proceed
    chain.batch_host_lost("11", "node1", "node2")
    (ended,) = events(paths, "ended")
    assert ended["lost_nodes"] == ["node1"] and ended["outcome"] == "killed" and "batch host node1" in ended["reason"]
    assert ended["accounted_by"] == "11's keeper on node2"
    assert [e["node"] for e in events(paths, "node_suspected")] == ["node1"]
    (successor,) = chain.pending_successors("11")  # queued at `job begin`, before the host died: kept off it
    assert sched.excluded == {successor: ["node1"]}
    assert [e["excluded"] for e in events(paths, "exclusion") if e["job_id"] == successor] == [["node1"]]
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[2-3]")
    sched.states["11"] = "CANCELLED"
    assert chain.begin("100").proceed  # the successor: the segment is already accounted for
    assert len(events(paths, "ended")) == 1 and sched.excluded == {successor: ["node1"], "101": ["node1"]}
    chain.batch_host_lost("11", "node1", "node2")  # once ended (by `job end` or a keeper), never again
    assert len(events(paths, "ended")) == 1


def test_the_queued_successor_is_kept_off_a_lost_batch_host_through_scontrol(tmp_path, monkeypatch) -> None:
    """At the subprocess boundary: Slurm's own `scontrol update JobId=S ExcNodeList=...` for the successor."""
    from megalaunch.launcher.backends.slurm_backend import SlurmBackend
    from megalaunch.launcher.chain.chain import Chain

    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 2, "node[1-2]")
    assert chain.begin("11").proceed
    (successor,) = chain.pending_successors("11")
    bindir, calls = tmp_path / "bin", tmp_path / "calls"
    bindir.mkdir()
    for name, body in (("scontrol", f'echo "scontrol $*" >> {calls}'), ("sinfo", "echo 'node[1-3]'")):
        (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bindir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    Chain(paths, SlurmBackend()).batch_host_lost("11", "node1", "node2")
    assert calls.read_text().splitlines() == [f"scontrol update JobId={successor} ExcNodeList=node1"]
    (ended,) = events(paths, "ended")
    assert ended["lost_nodes"] == ["node1"]


def test_detach_writes_the_keepers_own_log_and_ignores_the_signals_that_are_not_its_own(tmp_path) -> None:
    """In a child process (it changes fds 1 and 2): the warning signal, SIGHUP and output through the step's
    streams must not end or block it; SIGTERM, the job's end, still does."""
    import signal
    import subprocess
    import sys

    log = tmp_path / "keeper.out"
    code = ("import os, signal, sys, time\n"
            "from megalaunch.launcher.backends.keeper import detach\n"
            f"detach({str(log)!r})\n"
            "print('keeper up', flush=True)\n"
            "for s in (signal.SIGUSR2, signal.SIGUSR1, signal.SIGHUP): os.kill(os.getpid(), s)\n"
            "print('survived', flush=True); print('on stderr', file=sys.stderr, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print('not reached', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr)
    assert proc.stdout == "" and proc.stderr == ""  # nothing through the step's streams
    assert log.read_text().splitlines() == ["keeper up", "survived", "on stderr"]
