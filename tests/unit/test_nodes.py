"""Bad nodes (launcher/accounting/nodes.py): attribution of a failed segment, the team's node-health ledger, and
the successor's exclusion, over the real Chain and the real task supervisor's exit records. The
scheduler is a recorder (the Slurm side, sinfo and scontrol update, is tested on the CI cluster)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tests.unit.test_chain import RecordingScheduler, _outcome

from megalaunch.config.loader import load_recipe
from megalaunch.launcher.accounting.nodes import (
    NodeHealth,
    Suspect,
    attribute,
    plan_exclusion,
)
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import append_jsonl
from megalaunch.rundir.hostlist import expand_hostlist
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.settings import RuntimeSettings

REPO = Path(__file__).resolve().parents[2]


def make_run(tmp_path: Path, *sets: str) -> RunPaths:
    loaded = load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "training.train_iters=100", *sets])
    return write_run(prepare_run(loaded))


def task(paths: RunPaths, job: str, rank: int, node: str, code: str) -> None:
    """One rank through the real task supervisor, as srun runs it on `node`."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MEGALAUNCH_RUN_DIR": str(paths.root),
           "MEGALAUNCH_JOB_ID": job, "RANK": str(rank), "SLURMD_NODENAME": node}
    subprocess.run([sys.executable, "-m", "megalaunch.runtime.task", "--", sys.executable, "-c", code],
                   env=env, timeout=60, capture_output=True)


def started(paths: RunPaths, job: str, nodes: str) -> None:
    append_jsonl(paths.ledger, {"event": "started", "job_id": job, "nodes": nodes, "checkpoint_iteration": None,
                                "time": 1.0})


def events(paths: RunPaths, name: str) -> list[dict]:
    return [json.loads(x) for x in paths.ledger.read_text().splitlines() if json.loads(x)["event"] == name]


def slurm_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: int,
                nodelist: str) -> tuple[RunPaths, RecordingScheduler, Chain]:
    """A Slurm run of `nodes` node(s) on a cluster of node1 and node2, its segment running on `nodelist`."""
    paths = make_run(tmp_path, "cluster.backend=slurm", f"cluster.nodes={nodes}")
    sched = RecordingScheduler()
    sched.nodes = ["node1", "node2"]
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    return paths, sched, Chain(paths, sched)


def test_a_failed_segment_names_the_first_node_to_fail_and_its_successor_excludes_it(tmp_path, monkeypatch) -> None:
    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 1, "node2")
    assert chain.begin("11").proceed and sched.submitted == ["100"] and sched.excluded == {}
    task(paths, "11", 0, "node2", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    task(paths, "11", 1, "node2", "raise SystemExit(1)")
    chain.end("11", 1)
    (sus,) = events(paths, "node_suspected")
    assert sus["node"] == "node2" and "rank 0 on node2 was killed by SIGSEGV" in sus["reason"]
    assert any("SIGSEGV" in e for e in sus["evidence"])
    health = NodeHealth(RuntimeSettings.load(paths).node_health_dir or "")
    assert set(health.active()) == {"node2"}
    assert stat.S_IMODE(health.file.stat().st_mode) & 0o060 == 0o060  # the group can read and write it
    assert stat.S_IMODE(health.directory.stat().st_mode) & 0o070 == 0o070
    assert sched.excluded == {"100": ["node2"]}  # the queued successor, updated
    (exc,) = events(paths, "exclusion")
    assert exc["job_id"] == "100" and exc["excluded"] == ["node2"] and exc["kept"] == {}
    # the next segment (on node1) queues its own successor already excluding node2
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node1")
    assert chain.begin("100").proceed
    assert sched.excluded["101"] == ["node2"]


def test_exclusion_never_makes_the_job_unschedulable(tmp_path, monkeypatch) -> None:
    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 2, "node[1-2]")
    assert chain.begin("21").proceed
    started(paths, "21", "node[1-2]")
    task(paths, "21", 1, "node2", "raise SystemExit(3)")
    chain.end("21", 1)
    assert [e["node"] for e in events(paths, "node_suspected")] == ["node2"]
    assert sched.excluded == {}
    (exc,) = events(paths, "exclusion")
    assert exc["excluded"] == [] and "fewer than the job's 2 node(s) of the 2" in exc["kept"]["node2"]


def test_suspects_expire_and_can_be_cleared(tmp_path) -> None:
    health = NodeHealth(tmp_path / "nh")
    health.suspect("node2", reason="r", evidence=["e"], run="x", job_id="1", ttl_s=60, now=1000.0)
    health.suspect("node3", reason="r", evidence=[], run="x", job_id="1", ttl_s=600, now=1000.0)
    assert set(health.active(now=1030.0)) == {"node2", "node3"}
    assert set(health.active(now=1061.0)) == {"node3"}  # node2's entry expired
    health.clear("node3", now=1100.0)
    assert health.active(now=1101.0) == {}
    health.suspect("node3", reason="again", evidence=[], run="y", job_id="2", ttl_s=600, now=1200.0)
    assert health.active(now=1201.0)["node3"].reason == "again"  # a later failure makes it suspect again
    with open(health.file, "a") as f:
        f.write('{"event": "suspect", "node": "node9", "tim')  # a writer that crashed mid-line
    assert set(health.active(now=1201.0)) == {"node3"}


def test_the_spares_count_in_what_exclusion_must_leave(tmp_path, monkeypatch) -> None:
    """A job of 1 node + 1 spare on a 3-node cluster asks Slurm for 2: excluding two suspects would make
    sbatch refuse the successor outright ("Requested node configuration is not available")."""
    paths = make_run(tmp_path, "cluster.backend=slurm", "cluster.nodes=1", "cluster.spare_nodes=1")
    sched = RecordingScheduler()
    sched.nodes = ["node1", "node2", "node3"]
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    chain = Chain(paths, sched)
    assert chain.begin("31").proceed
    chain.suspects.record_lost("31", ["node1", "node2"], "lost")
    chain.suspects.exclude_from(["100"])
    (exc,) = events(paths, "exclusion")
    assert len(exc["excluded"]) == 1 and len(exc["kept"]) == 1, exc
    assert "fewer than the job's 2 node(s)" in next(iter(exc["kept"].values()))


def test_plan_exclusion_keeps_unknown_nodes_and_the_minimum_and_prefers_recent_suspects() -> None:
    def s(node: str, t: float) -> Suspect:
        return Suspect(node=node, reason="r", evidence=[], run="x", job_id="1", time=t, expires=t + 1e9)

    suspects = {"n1": s("n1", 1), "n2": s("n2", 3), "gone": s("gone", 2)}
    plan = plan_exclusion(suspects, ["n1", "n2", "n3", "n4"], need=3)
    assert plan.exclude == ["n2"]  # the most recent suspect; one more would leave 2 nodes for a 3-node job
    assert "Slurm no longer knows it" in plan.kept["gone"] and "fewer than the job's 3" in plan.kept["n1"]
    assert plan_exclusion(suspects, None, 1).exclude == []  # Slurm did not answer: exclude nothing
    assert plan_exclusion({}, ["n1"], 1).exclude == []


def test_attribution_reads_hardware_signatures_that_name_a_node(tmp_path) -> None:
    log = tmp_path / "seg.out"
    log.write_text("iteration 10 loss 3.2\n"
                   "[node3] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus\n"
                   "srun: error: node1: task 0: Exited with exit code 1\n"
                   "node1 and node3 both mentioned: NCCL error\n")
    att = attribute([], log, ["node1", "node3"])
    assert set(att.suspects) == {"node3"} and "xid" in att.suspects["node3"][0]
    assert att.reason.startswith("xid on node3")


def test_local_backend_runs_record_suspects_but_exclude_nothing(tmp_path, monkeypatch) -> None:
    paths = make_run(tmp_path, "cluster.backend=local")
    sched = RecordingScheduler()  # nodes None: what the local backend answers
    chain = Chain(paths, sched)
    assert chain.begin("local-1").proceed
    task(paths, "local-1", 0, "vm", "raise SystemExit(1)")
    chain.end("local-1", 1)
    assert [e["node"] for e in events(paths, "node_suspected")] == ["vm"]
    assert sched.excluded == {}


def test_a_segment_killed_at_its_time_limit_blames_no_node(tmp_path, monkeypatch) -> None:
    """The local backend's timer killed the segment at the limit (a stop save slower than the lead, as
    measured on an H100 with a 17 GB checkpoint): `timeout`, with the fix, never a suspect node."""
    paths = make_run(tmp_path, "cluster.backend=local")
    chain = Chain(paths, RecordingScheduler())
    assert chain.begin("local-1").proceed
    task(paths, "local-1", 0, "vm", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    append_jsonl(paths.ledger, {"event": "time_limit_reached", "job_id": "local-1", "time": 2.0})
    chain.end("local-1", 1)
    (ended,) = events(paths, "ended")
    assert ended["outcome"] == "timeout" and "did not finish within the signal lead" in ended["reason"]
    assert "checkpoint.save_time_estimate_s" in ended["fix"]
    assert events(paths, "node_suspected") == []


@pytest.mark.parametrize(("text", "names"), [
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]), ("gpu07,cpu[01-02]", ["gpu07", "cpu01", "cpu02"]),
    ("node1", ["node1"]), ("", []), ("a[08-10]-ib", ["a08-ib", "a09-ib", "a10-ib"]),
])
def test_expand_hostlist(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


def test_the_nodes_command_lists_and_clears(tmp_path) -> None:
    from typer.testing import CliRunner

    from megalaunch.cli.main import app

    paths = make_run(tmp_path, "cluster.backend=slurm")
    health = NodeHealth(RuntimeSettings.load(paths).node_health_dir or "")
    health.suspect("node2", reason="first to fail: rank 1 on node2 was killed by SIGBUS", evidence=["rank 1 SIGBUS"],
                   run=paths.root.name, job_id="7", ttl_s=3600)
    runner = CliRunner()
    for where in ([str(paths.root)], [str(health.directory)]):  # a run, or the ledger's directory
        res = runner.invoke(app, ["nodes", "--run", *where])
        assert res.exit_code == 0, res.output
        assert "1 suspect node(s)" in res.output and "node2: first to fail" in res.output
        assert "rank 1 SIGBUS" in res.output and "expires in" in res.output
    res = runner.invoke(app, ["nodes", "--run", str(paths.root), "clear", "node2"])
    assert res.exit_code == 0 and "cleared node2" in res.output, res.output
    assert health.active() == {}
    assert runner.invoke(app, ["nodes", "--run", str(paths.root)]).output.startswith("no suspect nodes")
    assert health.events()[-1]["event"] == "cleared" and health.events()[-1]["user"]


def test_status_shows_the_suspect_and_the_exclusion(tmp_path, monkeypatch) -> None:
    from megalaunch.launcher.status import run_status
    from megalaunch.launcher.status_format import format_run_status

    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 1, "node2")
    chain.begin("31")
    task(paths, "31", 0, "node2", "raise SystemExit(2)")
    chain.end("31", 1)
    monkeypatch.setattr("megalaunch.launcher.status.backend_for", lambda name: _NoSlurm())  # no squeue here
    text = format_run_status(run_status(paths))
    assert "nodes: suspect node2 after job 31: first to fail: rank 0 on node2 exited with status 2" in text
    assert "nodes: job 100 excludes node2" in text


class _NoSlurm:
    def live(self, segments):  # type: ignore[no-untyped-def]
        return {}, None


class _FlakySlurm(RecordingScheduler):
    """sbatch fails (the controller is down) for the first `down` submissions."""

    def __init__(self, down: int) -> None:
        super().__init__()
        self.down = down

    def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None) -> str | None:
        from megalaunch.errors import SlurmError

        if self.down > 0:
            self.down -= 1
            raise SlurmError("'sbatch --parsable' did not answer within 60 s: the Slurm controller is slow or down")
        return super().submit_successor(paths, exclude)


def test_slurm_not_answering_at_segment_start_is_not_a_failure(tmp_path, monkeypatch) -> None:
    import megalaunch.launcher.chain.successor as successor_mod

    monkeypatch.setattr(successor_mod, "SUCCESSOR_RETRY_S", (0, 0))
    paths = make_run(tmp_path, "cluster.backend=slurm")
    sched = _FlakySlurm(down=2)  # begin's try and end's first try fail, end's first retry works
    chain = Chain(paths, sched)
    assert chain.begin("41").proceed  # trains anyway
    (miss,) = events(paths, "successor_not_queued")
    assert miss["when"] == "begin" and "did not answer" in miss["error"]
    paths.tracker.write_text("50\n")
    _outcome(monkeypatch, paths, "41", "saved", iteration=50)
    v = chain.end("41", 0)
    assert v.proceed and sched.submitted == ["100"]
    assert events(paths, "submitted")[-1]["by"].startswith("segment 41 (at its end")
    assert not events(paths, "chain_stopped")


def test_slurm_down_at_both_ends_pauses_the_chain_and_says_how_to_resume(tmp_path, monkeypatch) -> None:
    import megalaunch.launcher.chain.successor as successor_mod

    monkeypatch.setattr(successor_mod, "SUCCESSOR_RETRY_S", (0, 0))
    paths = make_run(tmp_path, "cluster.backend=slurm")
    sched = _FlakySlurm(down=10)
    chain = Chain(paths, sched)
    assert chain.begin("51").proceed
    paths.tracker.write_text("50\n")
    _outcome(monkeypatch, paths, "51", "saved", iteration=50)
    v = chain.end("51", 0)
    assert not v.proceed and f"megalaunch resume {paths.root}" in v.reason
    assert [e["when"] for e in events(paths, "successor_not_queued")] == ["begin", "end"]
    assert sched.submitted == [] and sched.down == 10 - 1 - 3  # begin's try, then end's try and 2 retries
    ended = [e for e in events(paths, "ended") if e["job_id"] == "51"]
    assert ended[0]["outcome"] == "saved"  # the segment itself is not counted as failed


def test_a_suspect_that_passes_the_health_check_is_cleared_and_one_that_fails_it_stays(tmp_path, monkeypatch) -> None:
    """A node that died and came back stays suspect (its successors exclude it) until it is cleared or, used
    again where the job could not do without it, passes the segment's health check."""
    paths, _sched, chain = slurm_chain(tmp_path, monkeypatch, 2, "node[1-2]")
    health = NodeHealth(RuntimeSettings.load(paths).node_health_dir or "")
    for node in ("node1", "node2", "node3"):
        health.suspect(node, reason="test", evidence=[], run="other", job_id="1", ttl_s=3600)
    assert chain.begin("31").proceed
    check = {"healthy": False, "unhealthy_nodes": ["node2"], "nodes": "node[1-2]",
             "ranks": [{"rank": 0, "node": "node1", "tflops": 1.0}, {"rank": 1, "node": "node2", "tflops": 0.1}]}
    _outcome(monkeypatch, paths, "31", "unhealthy_node", health_check=check)
    chain.end("31", 0)
    assert set(health.active()) == {"node2", "node3"}  # node3 was not checked
    (cleared,) = events(paths, "node_cleared")
    assert cleared["node"] == "node1" and cleared["reason"] == "passed the health check of job 31"
    assert [e["reason"] for e in health.events() if e["event"] == "cleared"] == ["passed the health check of job 31"]


def test_a_segment_that_ended_node_fail_without_a_word_blames_its_batch_host(tmp_path, monkeypatch) -> None:
    """The batch host died: srun and the job script with it, so no `job end` and no `Node failure on`
    line. The next segment finds the job NODE_FAIL, blames its batch host (Slurm's BatchHost), and its own
    successor excludes it."""
    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 2, "node[1-2]")
    sched.nodes = ["node1", "node2", "node3"]
    assert chain.begin("11").proceed
    sched.states["11"], sched.batch_hosts["11"] = "NODE_FAIL", "node1"
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[2-3]")
    assert chain.begin("100").proceed
    (ended,) = events(paths, "ended")
    assert ended["job_id"] == "11" and ended["slurm_state"] == "NODE_FAIL" and ended["lost_nodes"] == ["node1"]
    (sus,) = events(paths, "node_suspected")
    assert sus["node"] == "node1" and "batch host" in sus["reason"] and "NODE_FAIL" in sus["reason"]
    assert sched.excluded == {"101": ["node1"]}  # the successor queued by the segment that took over


def test_a_node_srun_reported_lost_is_blamed_not_the_batch_host(tmp_path, monkeypatch) -> None:
    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 2, "node[1-2]")
    sched.nodes = ["node1", "node2", "node3"]
    assert chain.begin("11").proceed
    paths.logs.mkdir(parents=True, exist_ok=True)
    with paths.segment_log("11").open("a") as f:
        f.write("srun: error: Node failure on node2\nsrun: error: Node failure on node2\n")
    sched.states["11"], sched.batch_hosts["11"] = "NODE_FAIL", "node1"
    assert chain.begin("100").proceed
    assert [e["node"] for e in events(paths, "node_suspected")] == ["node2"]
    assert events(paths, "ended")[0]["lost_nodes"] == ["node2"]


def test_a_segment_killed_otherwise_blames_no_node(tmp_path, monkeypatch) -> None:
    paths, sched, chain = slurm_chain(tmp_path, monkeypatch, 2, "node[1-2]")
    assert chain.begin("11").proceed
    sched.states["11"], sched.batch_hosts["11"] = "CANCELLED", "node1"
    assert chain.begin("100").proceed
    assert events(paths, "node_suspected") == [] and "lost_nodes" not in events(paths, "ended")[0]
