"""The core launcher on a real Slurm cluster: the time-limit signal chain, team triggers across users,
the crash-loop guard, 2-node rank environment, cancel."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from cluster import queue_ids, start_slurmctld, stop_slurmctld, wait_for, wait_job_done
from launch import RANKINFO, counter_recipe, ledger, megalaunch, run_dir_of, submitted_ids


def _status(run: Path, user: str | None = None) -> dict:
    proc = megalaunch(user, "status", str(run), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _chain_done(run: Path) -> bool:
    return any(e["event"] == "chain_stopped" for e in ledger(run)) and not queue_ids(name=run.name)


@pytest.mark.slow
def test_time_limit_signal_chain_resumes_and_ends_at_target(slurm_tmp: Path) -> None:
    # each 3-min segment gets USR2 61-91 s before its limit: ~90-120 s x 20 it/s; 2600 needs 2 segments
    recipe = counter_recipe(slurm_tmp, "sigchain", training={"train_iters": 2600})
    proc = megalaunch(None, "submit", str(recipe), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    assert "megalaunch status" in proc.stdout
    run = run_dir_of(slurm_tmp)
    # one runs, one waits: the successor is queued by the first segment at its start
    wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor to be queued")
    wait_for(lambda: _chain_done(run), 480, interval=2, what="the chain to finish")
    events = ledger(run)
    ended = [e for e in events if e["event"] == "ended"]
    started = [e for e in events if e["event"] == "started"]
    assert len(ended) >= 2
    assert [e["outcome"] for e in ended] == ["saved"] * (len(ended) - 1) + ["finished"]
    for prev, nxt in zip(ended, started[1:], strict=False):
        assert nxt["checkpoint_iteration"] == prev["checkpoint_iteration"]  # resumes where it stopped
    first_log = next((run / "logs").glob(f"*-{ended[0]['job_id']}.out")).read_text()
    assert "stop signal: saved and exiting" in first_log  # Slurm's own --signal warning, not a kill
    for e in ended[:-1]:
        assert wait_job_done(e["job_id"], 60) == "COMPLETED"  # it exited before the limit
    state = json.loads((run / "checkpoints" / "iter_0002600" / "state.json").read_text())
    assert state["total"] == sum(range(1, 2601))  # no step lost or repeated
    assert queue_ids(name=run.name) == []
    st = _status(run)
    assert st["chain_state"] == "stopped" and st["last_checkpoint"] == 2600


def _wait_iteration(run: Path, at_least: int, timeout: float = 90) -> None:
    def ok() -> bool:
        try:
            return json.loads((run / "state" / "progress.json").read_text())["iteration"] >= at_least
        except (FileNotFoundError, json.JSONDecodeError, PermissionError):
            return False

    wait_for(ok, timeout, what=f"iteration {at_least}")


def test_team_triggers_across_users(slurm_tmp: Path) -> None:
    """mlalice runs the chain; mlbob (same group) saves and then stops it; mleve (outside) is refused."""
    recipe = counter_recipe(slurm_tmp, "team", group="mlteam", user="mlalice", training={"train_iters": 1000000},
                            cluster={"time": "00:10:00"})
    proc = megalaunch("mlalice", "submit", str(recipe), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    assert oct(run.stat().st_mode & 0o7777) == "0o2750"  # the owner writes, the group reads
    assert oct((run / "triggers").stat().st_mode & 0o7777) == "0o3770"  # members write triggers only
    assert run.stat().st_gid == __import__("grp").getgrnam("mlteam").gr_gid
    _wait_iteration(run, 20)
    wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor to be queued")
    first, successor = submitted_ids(run)[:2]

    refused = megalaunch("mleve", "trigger", "exit", str(run), cwd=slurm_tmp)
    assert refused.returncode != 0
    assert "megalaunch: error:" in refused.stderr and "group 'mlteam'" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr

    saved = megalaunch("mlbob", "trigger", "save", str(run), "--reason", "eval", cwd=slurm_tmp)
    assert saved.returncode == 0, saved.stderr
    wait_for(lambda: not (run / "triggers" / "save").exists(), 60, what="save trigger consumed")
    assert queue_ids(name=run.name)  # still running after a save
    ex = megalaunch("mlbob", "trigger", "exit", str(run), "--reason", "done for now", cwd=slurm_tmp)
    assert ex.returncode == 0, ex.stderr
    assert wait_job_done(first, 90) == "COMPLETED"
    wait_for(lambda: not queue_ids(name=run.name), 60, what="the successor to be cancelled")
    assert wait_job_done(successor, 30) == "CANCELLED"
    outcome = json.loads((run / "state" / "outcome.json").read_text())
    assert outcome["status"] == "exited"
    consumed = [json.loads(p.read_text()) for p in sorted((run / "triggers" / "consumed").glob("*.json"))]
    assert sorted(c["verb"] for c in consumed) == ["exit", "save"]
    assert all(c["user"] == "mlbob" and c["consumed_iteration"] is not None for c in consumed)
    save = next(c for c in consumed if c["verb"] == "save")
    assert (run / "checkpoints" / f"iter_{save['consumed_iteration']:07d}").is_dir()
    stop = [e for e in ledger(run) if e["event"] == "chain_stopped"][-1]
    assert stop["reason"] == 'exit trigger by mlbob ("done for now"): saved and stopped', stop
    assert stop["cancelled"] == [successor]
    st = _status(run, "mlbob")  # a team member can read the status: who stopped it, what became of the successor
    assert st["chain_state"] == "stopped" and st["stop_reason"] == stop["reason"]
    rows = {r["job_id"]: r for r in st["segments"]}
    assert rows[successor]["state"] == "CANCELLED" and rows[successor]["reason"].startswith("by the chain: exit trigger")
    # mlbob named the run directory once (trigger, status): their listing now shows the team's runs there
    listing = megalaunch("mlbob", "status", "--json", cwd=slurm_tmp)
    assert listing.returncode == 0, listing.stderr
    assert [(r["chain_name"], r["owner"], r["state"]) for r in json.loads(listing.stdout)] == [
        (run.name, "mlalice", "stopped")]
    outsider = megalaunch("mleve", "status", "--json", cwd=slurm_tmp, )
    assert outsider.returncode == 0 and json.loads(outsider.stdout) == [], outsider.stdout


def test_abort_trigger_stops_without_saving(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "abort", training={"train_iters": 1000000},
                            checkpoint={"save_interval": 1000000}, cluster={"time": "00:10:00"})
    assert megalaunch(None, "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    _wait_iteration(run, 10)
    wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor to be queued")
    assert megalaunch(None, "trigger", "abort", str(run)).returncode == 0
    wait_for(lambda: _chain_done(run), 90, what="the chain to stop")
    assert json.loads((run / "state" / "outcome.json").read_text())["status"] == "aborted"
    assert not (run / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
    assert wait_job_done(submitted_ids(run)[1], 30) == "CANCELLED"


def test_failing_workload_stops_after_k_segments(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "crash", chain={"max_segments_without_progress": 2},
                            cluster={"env": {"COUNTER_FAIL": "start"}})
    assert megalaunch(None, "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: _chain_done(run), 120, what="the guard to stop the chain")
    ended = [e for e in ledger(run) if e["event"] == "ended"]
    assert len(ended) == 2 and all(e["outcome"] == "failed" for e in ended)
    st = _status(run)
    assert "2 consecutive segments without a new checkpoint" in st["stop_reason"]
    assert st["last_guard"]["decision"] == "stop"
    assert queue_ids(name=run.name) == []


def test_two_node_job_has_consistent_rank_environment(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "ranks", workload=RANKINFO,
                            cluster={"nodes": 2, "gpus_per_node": 2, "tasks_per_node": None},
                            training={"global_batch_size": 8})
    assert megalaunch(None, "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: _chain_done(run), 120, what="the job to finish")
    infos = [json.loads(p.read_text()) for p in sorted((run / "debug").glob("rank-*.json"))]
    assert sorted(i["rank"] for i in infos) == [0, 1, 2, 3]
    assert {i["world_size"] for i in infos} == {4}
    assert len({i["master_addr"] for i in infos}) == 1
    assert {i["node"] for i in infos} == {"node1", "node2"}
    by_node: dict[str, list[int]] = {}
    for i in infos:
        by_node.setdefault(i["node"], []).append(i["local_rank"])
        assert i["cuda_visible_devices"] is not None and len(i["cuda_visible_devices"].split(",")) == 2
    assert all(sorted(v) == [0, 1] for v in by_node.values())
    master = next(i for i in infos if i["rank"] == 0)
    assert master["master_addr"] == master["node"]  # the first host of the allocation


def test_cancel_leaves_nothing_queued_or_running(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "cancelme", training={"train_iters": 1000000},
                            cluster={"time": "00:10:00"})
    assert megalaunch(None, "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor to be queued")
    proc = megalaunch(None, "cancel", str(run))
    assert proc.returncode == 0, proc.stderr
    assert queue_ids(name=run.name) == []
    for jid in submitted_ids(run):
        assert wait_job_done(jid, 60) == "CANCELLED"
    assert queue_ids(name=run.name) == []  # and the chain queued nothing new meanwhile
    assert _status(run)["chain_state"] == "stopped"


def test_status_of_all_my_runs_uses_one_query(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "listed", training={"train_iters": 1000000}, cluster={"time": "00:10:00"})
    assert megalaunch(None, "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    try:
        wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor")
        proc = megalaunch(None, "status", "--json", cwd=slurm_tmp)
        rows = json.loads(proc.stdout)
        row = next(r for r in rows if r["chain_name"] == run.name)
        assert row["state"] == "running" and len(row["jobs"]) == 2
    finally:
        megalaunch(None, "cancel", str(run))


# --- the controller stops answering ------------------------------------------------------------------

def _timed(*args: str, cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.monotonic()
    proc = megalaunch(None, *args, cwd=cwd, timeout=60)
    return time.monotonic() - t0, proc


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.private_cluster("ctld")  # stops the controller: on a cluster of its own (tests/slurm/conftest.py)
def test_status_and_cancel_answer_quickly_with_slurmctld_down(slurm_tmp: Path) -> None:
    recipe = counter_recipe(slurm_tmp, "ctlddown", training={"train_iters": 1000000}, cluster={"time": "00:10:00"})
    assert megalaunch(None, "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor to be queued")
    _wait_iteration(run, 5)
    stop_slurmctld()
    try:
        took_all, listing = _timed("status", "--json", cwd=slurm_tmp)
        took_one, one = _timed("status", str(run), "--json", cwd=slurm_tmp)
        took_text, text = _timed("status", str(run), cwd=slurm_tmp)
        took_cancel, cancel = _timed("cancel", str(run), cwd=slurm_tmp)
    finally:
        start_slurmctld()
    print(f"slurmctld down: status {took_all:.1f} s, status RUN {took_one:.1f} s / {took_text:.1f} s, "
          f"cancel {took_cancel:.1f} s")
    assert max(took_all, took_one, took_text, took_cancel) < 15
    row = next(r for r in json.loads(listing.stdout) if r["chain_name"] == run.name)
    assert row["state"] == "unknown" and row["slurm_error"], row
    st = json.loads(one.stdout)
    assert st["chain_state"] == "unknown", st
    assert [s["state"] for s in st["segments"]] == ["UNKNOWN", "UNKNOWN"], st["segments"]
    assert "GONE" not in text.stdout and "idle" not in text.stdout and "slurm:" in text.stdout, text.stdout
    # cancel: one clear line, non-zero, nothing written, nothing cancelled
    assert cancel.returncode != 0 and "Traceback" not in cancel.stderr, cancel.stderr
    assert len(cancel.stderr.strip().splitlines()) == 1 and "megalaunch: error:" in cancel.stderr, cancel.stderr
    assert not (run / "state" / "cancel_requested").exists()
    assert not [e for e in ledger(run) if e["event"] in ("cancelled", "chain_stopped")]
    # the controller is back: the chain was untouched and cancels for real
    assert len(queue_ids(name=run.name)) == 2
    assert megalaunch(None, "cancel", str(run), cwd=slurm_tmp).returncode == 0
    assert queue_ids(name=run.name) == []
