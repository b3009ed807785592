"""The run directory's trust boundary (rundir/trust.py, rundir/untrusted.py, docs/security.md), with real
files, links and FIFOs: what members plant in triggers/ is refused without being read or blocking, the
job refuses files that differ from what the owner recorded, and nothing another user could rename is
trusted. The same attacks by a real other user on the Slurm cluster: tests/slurm/test_team_security_slurm.py."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.errors import RunDirError
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import append_team_jsonl, read_team_jsonl
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import Decision, TriggerBox, decide
from megalaunch.rundir.trust import check_ancestors, check_path, tighten, verify_trusted
from megalaunch.rundir.untrusted import MAX_TRIGGER_BYTES

SECRET = "s3cr3t-docker-auth-token-0123456789"


class Scheduler:
    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit_successor(self, paths, exclude=None):
        self.submitted.append(str(100 + len(self.submitted)))
        return self.submitted[-1]

    def known_nodes(self, partition):
        return None

    def exclude(self, job_ids, nodes):
        return None

    def cancel_jobs(self, job_ids):
        return None

    def state(self, job_id):
        return None


@pytest.fixture()
def paths(tmp_path: Path) -> RunPaths:
    loaded = load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", "training.train_iters=100"])
    return write_run(prepare_run(loaded))


@pytest.fixture()
def private(tmp_path: Path) -> Path:
    """The owner's private file, the shape of ~/.docker/config.json."""
    d = tmp_path / "home" / ".docker"
    d.mkdir(parents=True)
    d.chmod(0o700)
    f = d / "config.json"
    f.write_text(json.dumps({"verb": "save", "reason": SECRET, "auths": {"x": SECRET}}))
    f.chmod(0o600)
    return f


def _everything_under(root: Path) -> str:
    out = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            out.append(p.read_bytes().decode("utf-8", "replace"))
    return "\n".join(out)


def test_run_directory_modes(paths: RunPaths) -> None:
    assert stat.S_IMODE(paths.root.stat().st_mode) == 0o2750  # the owner writes, the group reads
    assert stat.S_IMODE(paths.triggers.stat().st_mode) == 0o3770  # members create, sticky
    assert stat.S_IMODE(paths.consumed_triggers.stat().st_mode) & 0o022 == 0  # the owner's record
    assert stat.S_IMODE(paths.ledger.stat().st_mode) == 0o640
    for rel in ("job.sbatch", "megatron.args", "runtime.json", "run.yaml", "manifest.json"):
        if (paths.root / rel).exists():
            assert stat.S_IMODE((paths.root / rel).stat().st_mode) & 0o022 == 0, rel
    manifest = json.loads(paths.manifest.read_text())
    assert set(manifest["trusted_sha256"]) >= {"megatron.args", "runtime.json", "run.yaml"}


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "directory", "oversized", "binary", "malformed"])
def test_a_planted_trigger_is_refused_recorded_and_never_read(paths: RunPaths, private: Path, kind: str) -> None:
    target = paths.trigger("save")
    if kind == "symlink":
        target.symlink_to(private)
    elif kind == "hardlink":
        os.link(private, target)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
        (target / "x").write_text(SECRET)
    elif kind == "oversized":
        target.write_text(json.dumps({"reason": "x" * (MAX_TRIGGER_BYTES * 4)}))
    elif kind == "binary":
        target.write_bytes(b"\xff\xfe\x00" + SECRET.encode())
    else:
        target.write_text('{"reason": "' + SECRET)
    result: list[Decision] = []
    t = threading.Thread(target=lambda: result.append(decide(TriggerBox(paths), False)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), f"a {kind} trigger blocked the decision"
    assert result == [Decision.CONTINUE]  # never acted on: training goes on
    (refused,) = [e for e in Ledger(paths).events() if e["event"] == "trigger_refused"]
    assert refused["kind"] == kind and refused["name"] == "save" and refused["planted_by"], refused
    assert refused["removed"] is (kind != "directory")  # a member's non-empty directory stays, ignored
    if kind != "directory":
        assert not os.path.lexists(target)
    decide(TriggerBox(paths), False)  # looked at again: recorded once
    assert len([e for e in Ledger(paths).events() if e["event"] == "trigger_refused"]) == 1
    assert private.read_text().count(SECRET) == 2  # the owner's file is untouched
    if kind != "directory":
        assert SECRET not in _everything_under(paths.root)  # no byte of it reached the run


def test_a_valid_trigger_still_works_beside_refused_ones(paths: RunPaths) -> None:
    os.mkfifo(paths.trigger("abort"))
    TriggerBox(paths).write("exit", "done\x1b[31m for now\n")
    box = TriggerBox(paths)
    assert decide(box, False) == Decision.EXIT
    (record,) = box.consume_for(Decision.EXIT, 7, "job-1")
    assert record["verb"] == "exit" and record["consumed_iteration"] == 7
    assert record["reason"] == "done [31m for now"  # control characters never reach records or terminals
    assert record["user"] and set(record) == {"verb", "user", "uid", "time", "host", "reason", "consumed_at",
                                              "consumed_iteration", "consumed_by_job", "consumed_on"}
    assert TriggerBox(paths).consumed()[0]["verb"] == "exit"


def test_consume_never_removes_a_trigger_swapped_in_after_the_look(paths: RunPaths) -> None:
    TriggerBox(paths).write("save", "first")
    box = TriggerBox(paths)
    assert decide(box, False) == Decision.SAVE
    os.unlink(paths.trigger("save"))
    TriggerBox(paths).write("save", "second")  # a new request between the look and the consume
    assert box.consume_for(Decision.SAVE, 3) == []
    assert TriggerBox(paths).read("save")["reason"] == "second"  # left for the next look


def test_the_job_refuses_a_changed_file_and_queues_nothing(paths: RunPaths) -> None:
    sched = Scheduler()
    assert Chain(paths, sched).begin("1").proceed
    assert sched.submitted == ["100"]
    args = paths.megatron_args
    args.chmod(0o640)
    args.write_text(args.read_text() + "--canary\n")
    verdict = Chain(paths, sched).begin("2")
    assert not verdict.proceed and "megatron.args differs from what the run's owner recorded" in verdict.reason
    assert sched.submitted == ["100"]  # no successor from a changed run
    stop = Ledger(paths).stopped()
    assert stop is not None and stop["reason"].startswith("untrusted run directory")


def test_a_resume_set_records_new_hashes(paths: RunPaths) -> None:
    from megalaunch.launcher.prepare.resume_check import apply_change, prepare_change

    apply_change(paths, prepare_change(paths, ["training.train_iters=200"]))
    assert "--train-iters\n200" in paths.megatron_args.read_text()
    verify_trusted(paths)  # the recorded change is trusted


def test_a_run_under_a_directory_others_can_rename_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 65534, 65534)  # another user's directory, writable by all, not sticky
    shared.chmod(0o777)
    with pytest.raises(RunDirError, match="writable by other users and not sticky"):
        check_ancestors(shared / "runs" / "x")
    loaded = load_recipe("tiny", [f"run.root={shared / 'runs'}"])
    with pytest.raises(RunDirError, match="chmod \\+t"):
        write_run(prepare_run(loaded))
    assert list(shared.iterdir()) == []  # nothing written
    shared.chmod(0o1777)  # sticky, like /tmp: nobody renames another's entries
    check_path(write_run(prepare_run(loaded)).root)


def test_an_old_group_writable_run_is_tightened_by_its_first_segment(paths: RunPaths) -> None:
    paths.root.chmod(0o2770)
    paths.ledger.chmod(0o660)
    paths.triggers.chmod(0o2770)
    assert Chain(paths, Scheduler()).begin("1").proceed
    assert stat.S_IMODE(paths.root.stat().st_mode) == 0o2750
    assert stat.S_IMODE(paths.ledger.stat().st_mode) == 0o640
    assert stat.S_IMODE(paths.triggers.stat().st_mode) == 0o3770
    (event,) = [e for e in Ledger(paths).events() if e["event"] == "modes_tightened"]
    assert ". 2770->2750" in event["changed"]
    assert tighten(paths) == []


def test_team_jsonl_never_follows_a_planted_link_or_blocks(tmp_path: Path, private: Path) -> None:
    team = tmp_path / "node-health"
    team.mkdir()
    ledger = team / "suspects.jsonl"
    ledger.symlink_to(private)
    with pytest.raises(RunDirError, match="cannot be appended to safely"):
        append_team_jsonl(ledger, {"node": "n1"})
    assert read_team_jsonl(ledger) == []
    assert private.read_text().count(SECRET) == 2
    ledger.unlink()
    os.mkfifo(ledger)
    with pytest.raises(RunDirError):
        append_team_jsonl(ledger, {"node": "n1"})  # O_NONBLOCK: no reader, no hang
    assert read_team_jsonl(ledger) == []


def test_a_colleagues_run_with_a_planted_fifo_is_left_out_of_the_listing(tmp_path: Path, monkeypatch) -> None:
    from megalaunch.rundir.registry import ROOTS_ENV, known_runs

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = tmp_path / "runs"
    loaded = load_recipe("tiny", [f"run.root={root}"])
    mine = write_run(prepare_run(loaded)).root
    theirs = root / "theirs-1234"
    theirs.mkdir()
    (theirs / "run.yaml").write_text("name: theirs\n")
    (theirs / "manifest.json").write_text("{}")
    (theirs / "state").mkdir()
    os.mkfifo(theirs / "state" / "ledger.jsonl")
    os.chown(theirs, 65534, 65534)  # a colleague's run
    monkeypatch.setenv(ROOTS_ENV, str(root))
    assert known_runs() == [mine]
