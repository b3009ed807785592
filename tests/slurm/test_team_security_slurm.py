"""The run directory's trust boundary with real other users on the real cluster (docs/security.md):
mlalice runs a chain for her group mlteam; mlbob (a member) tries to change what her job runs, plants
links, FIFOs and junk as triggers, and tries the owner's actions; mleve is outside. A canary proves that
a swapped job script never runs as the owner."""

from __future__ import annotations

import hashlib
import json
import pwd
import shlex
from pathlib import Path

import pytest
from cluster import queue_ids, run_as, wait_for
from launch import counter_recipe, ledger, megalaunch, run_dir_of, submitted_ids

SECRET = "alice-private-token-9f8e7d6c5b4a"


def _progress(run: Path) -> int:
    try:
        return json.loads((run / "state" / "progress.json").read_text())["iteration"]
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def _as_bob(script: str, cwd: Path):
    return run_as("mlbob", ["sh", "-c", script], cwd=cwd)


def _digest(run: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.iterdir()) if p.is_file()}


def _refused(run: Path) -> list[dict]:
    return [e for e in ledger(run) if e["event"] == "trigger_refused"]


def _alice_private(tmp: Path) -> Path:
    alice = pwd.getpwnam("mlalice")
    d = tmp / "alice-home" / ".docker"
    d.mkdir(parents=True)
    f = d / "config.json"
    f.write_text(json.dumps({"verb": "save", "reason": SECRET, "auths": {"registry": SECRET}}))
    for p, mode in ((d.parent, 0o700), (d, 0o700), (f, 0o600)):
        import os

        os.chown(p, alice.pw_uid, alice.pw_gid)
        p.chmod(mode)
    return f


@pytest.mark.slow
def test_a_member_cannot_run_code_as_the_owner_read_her_files_or_stall_her_job(slurm_tmp: Path) -> None:
    private = _alice_private(slurm_tmp)
    recipe = counter_recipe(slurm_tmp, "trust", group="mlteam", user="mlalice", training={"train_iters": 1000000},
                            chain={"trigger_interval": 5}, cluster={"time": "00:10:00"})
    proc = megalaunch("mlalice", "submit", str(recipe), cwd=slurm_tmp)
    assert proc.returncode == 0, proc.stderr
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: _progress(run) >= 10, 90, what="training to start")
    wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor to be queued")
    before = _digest(run)
    q = shlex.quote

    # 1. every file the job executes or reads as configuration: no member can replace, rename or add to it
    for attempt in (f"mv {q(str(run / 'job.sbatch'))} {q(str(run / 'job.old'))}",
                    f"printf 'id -un > /tmp/x\\n' > {q(str(run / 'job.sbatch'))}",
                    f"rm -f {q(str(run / 'megatron.args'))}",
                    f"ln -sf /tmp/evil {q(str(run / 'runtime.json'))}",
                    f"cp /dev/null {q(str(run / 'run.yaml'))}",
                    f"mv {q(str(run / 'manifest.json'))} {q(str(run / 'm'))}",
                    f"mv {q(str(run / 'checkpoints'))} {q(str(run / 'c'))}",
                    f"echo '{{\"event\": \"chain_stopped\"}}' >> {q(str(run / 'state' / 'ledger.jsonl'))}",
                    f"mv {q(str(run / 'triggers'))} {q(str(run / 't'))}",
                    f"mkdir {q(str(run / 'triggers' / 'consumed' / 'x'))}",
                    f"mv {q(str(run))} {q(str(run.parent / 'swapped'))}"):
        res = _as_bob(attempt, slurm_tmp)
        assert res.returncode != 0, f"a member could: {attempt}"
    assert _digest(run) == before

    # 2. planted triggers: each refused without blocking or reading, recorded with the planter, training goes on
    trig = run / "triggers"
    assert _as_bob(f"cat {q(str(private))}", slurm_tmp).returncode != 0  # only the owner's job could read it
    plants = [("symlink", f"ln -s {q(str(private))} {q(str(trig / 'save'))}"),
              ("fifo", f"mkfifo {q(str(trig / 'exit'))}"),
              # written beside, then renamed in: a file that appears empty and grows is an empty trigger first
              # (a trigger without details, which a member may plant: CI run of 12-02 aborted on it), not oversized
              ("oversized", f"head -c 1000000 /dev/zero | tr '\\0' x > {q(str(slurm_tmp / 'big'))} && "
                            f"mv {q(str(slurm_tmp / 'big'))} {q(str(trig / 'abort'))}"),
              ("hardlink", f"echo '{{}}' > {q(str(slurm_tmp / 'bob.json'))} && "
                           f"ln {q(str(slurm_tmp / 'bob.json'))} {q(str(trig / 'save'))}"),
              ("binary", f"printf '\\377\\376\\000' > {q(str(slurm_tmp / 'bin'))} && "
                         f"mv {q(str(slurm_tmp / 'bin'))} {q(str(trig / 'exit'))}"),
              ("directory", f"mkdir {q(str(trig / 'abort'))} && echo x > {q(str(trig / 'abort' / 'f'))}")]
    for n, (kind, plant) in enumerate(plants, 1):
        res = _as_bob(plant, slurm_tmp)
        assert res.returncode == 0, (kind, res.stderr)
        wait_for(lambda n=n: len(_refused(run)) >= n, 60, what=f"the {kind} trigger to be refused")
        event = _refused(run)[-1]
        assert (event["kind"], event["planted_by"]) == (kind, "mlbob"), event
    at = _progress(run)
    wait_for(lambda: _progress(run) >= at + 20, 60, what="training to go on")
    assert queue_ids(name=run.name)  # nothing stopped the chain
    assert not (run / "triggers" / "consumed").exists() or not list((run / "triggers" / "consumed").iterdir())

    # 3. a member's real trigger still works; the owner's actions stay the owner's; outsiders are refused
    saved = megalaunch("mlbob", "trigger", "save", str(run), "--reason", "eval", cwd=slurm_tmp)
    assert saved.returncode == 0, saved.stderr
    wait_for(lambda: not (trig / "save").exists(), 60, what="the save trigger to be consumed")
    (consumed,) = [json.loads(p.read_text()) for p in (trig / "consumed").glob("*.json")]
    assert consumed["user"] == "mlbob" and consumed["reason"] == "eval"
    for action in (["resume", str(run)], ["cancel", str(run)]):
        res = megalaunch("mlbob", *action, cwd=slurm_tmp)
        assert res.returncode != 0 and "only the run's owner (mlalice)" in res.stderr, res.stderr
        assert "megalaunch trigger" in res.stderr and "Traceback" not in res.stderr
    outsider = megalaunch("mleve", "trigger", "save", str(run), cwd=slurm_tmp)
    assert outsider.returncode != 0 and "group 'mlteam'" in outsider.stderr
    member_view = [megalaunch("mlbob", *cmd, cwd=slurm_tmp) for cmd in
                   (["status", str(run)], ["logs", str(run), "--tail", "200"])]
    assert all(r.returncode == 0 for r in member_view), [r.stderr for r in member_view]
    assert "refused trigger 'save' planted by mlbob" in member_view[0].stdout

    # no byte of the owner's private file reached the run directory or what the member sees
    for p in run.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert SECRET not in p.read_bytes().decode("utf-8", "replace"), p
    assert all(SECRET not in r.stdout + r.stderr for r in member_view)


@pytest.mark.slow
def test_a_swapped_job_script_never_runs_as_the_owner(slurm_tmp: Path) -> None:
    """Worst case, a run made before the boundary (its directory group-writable): the member replaces
    job.sbatch with a canary. The next segment refuses the changed run; the canary never runs."""
    canary = slurm_tmp / "canary"
    recipe = counter_recipe(slurm_tmp, "canary", group="mlteam", user="mlalice", training={"train_iters": 1000000},
                            cluster={"time": "00:10:00"})
    assert megalaunch("mlalice", "submit", str(recipe), cwd=slurm_tmp).returncode == 0
    run = run_dir_of(slurm_tmp)
    wait_for(lambda: len(submitted_ids(run)) >= 2, 60, what="the successor to be queued")
    first, successor = submitted_ids(run)[:2]
    run.chmod(0o2770)  # as megalaunch < this change left it
    script = run / "job.sbatch"
    swap = (f"mv {shlex.quote(str(script))} {shlex.quote(str(run / 'job.old'))} && "
            f"printf '#!/bin/bash\\nid -un > {canary}\\n' > {shlex.quote(str(script))}")
    res = _as_bob(swap, slurm_tmp)
    assert res.returncode == 0, res.stderr
    run_as(None, ["scancel", first])  # the segment dies; the queued successor starts
    wait_for(lambda: any(e["event"] == "chain_stopped" for e in ledger(run)), 120,
             what="the successor to refuse the changed run")
    stop = [e for e in ledger(run) if e["event"] == "chain_stopped"][-1]
    assert stop["job_id"] == successor and stop["reason"].startswith("untrusted run directory"), stop
    assert "job.sbatch" in stop["reason"]
    wait_for(lambda: not queue_ids(name=run.name), 60, what="nothing left queued")
    assert not canary.exists()  # the member's script never ran, as the owner or at all
    assert oct(run.stat().st_mode & 0o7777) == "0o2750"  # and the old run got the current modes
