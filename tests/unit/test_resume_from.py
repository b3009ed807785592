"""`megalaunch resume RUN --from ITER` without a trainer: the login node's checks and refusals (the CLI in a
subprocess, also with torch made unimportable, as on a login node with the core install), the one-shot
request (written, applied once by `plan_resume`, refused, withdrawn), `job begin` seeing the request,
the `chain_resumed` ledger record and the status lines. The real trainer: tests/megatron/test_resume_from.py."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tests.unit.helpers import cli

from megalaunch.config.loader import load_recipe
from megalaunch.errors import RunDirError, SlurmError
from megalaunch.launcher.chain.backend import Live, Started
from megalaunch.launcher.chain.chain import Chain
from megalaunch.launcher.chain.resume_from import check_resume_from, resume_chain
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.launcher.status import run_status
from megalaunch.launcher.status_format import format_run_status
from megalaunch.launcher.status_history import format_resume
from megalaunch.rundir.files import read_jsonl
from megalaunch.rundir.ledger import Ledger, Segment
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.resume_request import read_resume_request, requested_iteration, write_resume_request
from megalaunch.runtime.checkpoint import completeness, resume

TRAIN_ITERS = 40


@pytest.fixture
def run(tmp_path: Path) -> RunPaths:
    """A run of the tiny recipe (local backend) with fabricated torch_dist checkpoints 10, 20 and 30."""
    loaded = load_recipe("tiny", [f"run.root={tmp_path / 'runs'}", f"training.train_iters={TRAIN_ITERS}"])
    paths = write_run(prepare_run(loaded))
    for it in (10, 20, 30):
        fake_checkpoint(paths, it)
    paths.tracker.write_text("30\n")
    Ledger(paths).append("chain_stopped", job_id="local-1", reason="exit trigger")
    return paths


def fake_checkpoint(paths: RunPaths, iteration: int, shards: tuple[str, ...] = ("__0_0.distcp", "__1_0.distcp")) -> Path:
    """What torch_dist leaves on disk, without torch: metadata.json, a `.metadata` pickle naming the shard
    files (with the attributes torch's classes have, so that the job's full check reads it too) and the shards."""
    d = resume.iter_dir(paths, iteration)
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    storage = {f"key{i}": SimpleNamespace(relative_path=s, offset=0, length=8) for i, s in enumerate(shards)}
    (d / ".metadata").write_bytes(pickle.dumps(SimpleNamespace(storage_data=storage)))
    for s in shards:
        (d / s).write_bytes(b"x" * 8)
    return d


def snapshot(paths: RunPaths) -> dict[str, Any]:
    """What a refused command must leave alone."""
    return {"ledger": paths.ledger.read_text() if paths.ledger.exists() else "",
            "state": sorted(p.name for p in paths.state.iterdir()),
            "checkpoints": sorted(p.name for p in paths.checkpoints.iterdir()),
            "tracker": paths.tracker.read_text()}


@pytest.fixture
def no_torch(tmp_path: Path) -> dict[str, str]:
    """An environment in which `import torch` fails, as on a login node with only the core install."""
    fake = tmp_path / "no-torch"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('no torch on this login node (test)')\n")
    return {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}


# --- the login node's refusals: one line, non-zero, nothing written -------------------------------------

REFUSALS = [
    ("no checkpoint", lambda p: None, "15", ["iteration 15 does not exist", "complete checkpoints: 10, 20, 30"]),
    ("moved aside", lambda p: os.replace(resume.iter_dir(p, 20), p.checkpoints / "iter_0000020.abandoned-local-3"),
     "20", ["was moved aside (iter_0000020.abandoned-local-3)", "complete checkpoints: 10, 30"]),
    ("no .metadata", lambda p: (resume.iter_dir(p, 20) / ".metadata").unlink(), "20",
     ["iteration 20 is incomplete (missing .metadata)", "complete checkpoints: 10, 30"]),
    ("missing shard", lambda p: (resume.iter_dir(p, 20) / "__1_0.distcp").unlink(), "20",
     ["incomplete (missing shard __1_0.distcp)"]),
    ("empty shard", lambda p: (resume.iter_dir(p, 20) / "__0_0.distcp").write_bytes(b""), "20",
     ["incomplete (empty shard __0_0.distcp)"]),
    ("garbled metadata.json", lambda p: (resume.iter_dir(p, 20) / "metadata.json").write_text("{"), "20",
     ["incomplete (unreadable metadata.json"]),
    ("at the target", lambda p: fake_checkpoint(p, TRAIN_ITERS), str(TRAIN_ITERS),
     [f"iteration {TRAIN_ITERS} is already at the target (training.train_iters {TRAIN_ITERS})"]),
    ("negative", lambda p: None, "-3", ["iteration -3 does not exist"]),
]


@pytest.mark.parametrize(("case", "damage", "iteration", "expected"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refused_without_torch(run: RunPaths, no_torch: dict[str, str], case: str, damage: Any, iteration: str,
                               expected: list[str]) -> None:
    damage(run)
    before = snapshot(run)
    proc = cli("resume", str(run.root), "--from", iteration, env=no_torch)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megalaunch: error: --from: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    assert snapshot(run) == before and not run.resume_request.exists()


def test_refused_while_a_segment_is_running_or_queued(run: RunPaths) -> None:
    chain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # plays the chain's process
    try:
        Ledger(run).append("chain_resumed")
        Ledger(run).append("submitted", job_id="local-2", by="local backend", pid=chain.pid)
        before = snapshot(run)
        for args in (["--from", "10"], []):  # plain resume too: a live chain would get a second line of segments
            proc = cli("resume", str(run.root), *args)
            assert proc.returncode == 2, proc.stdout
            (line,) = proc.stderr.strip().splitlines()
            assert "still has a segment running or queued: local-2 (pending)" in line
            assert f"megalaunch trigger exit {run.root}" in line and f"megalaunch cancel {run.root}" in line
            assert snapshot(run) == before and not run.resume_request.exists()
    finally:
        chain.kill()
        chain.wait()


class FakeBackend:
    """A backend that answers `live` as told and records `resume`."""

    name = "fake"

    def __init__(self, live: dict[str, Live] | None = None, error: str | None = None, fail: bool = False) -> None:
        self._live, self._error, self.fail = live or {}, error, fail
        self.resumed: list[tuple[int | None, dict[str, Any] | None]] = []

    def live(self, segments: list[Segment]) -> tuple[dict[str, Live], str | None]:
        return self._live, self._error

    def resume(self, paths: RunPaths, echo: Any, from_iteration: int | None = None) -> Started:
        self.resumed.append((from_iteration, read_resume_request(paths)))
        if self.fail:
            raise SlurmError("sbatch: error: Batch job submission failed")
        return Started(paths, "123")


def test_refused_when_the_scheduler_does_not_answer_or_a_job_is_queued(run: RunPaths) -> None:
    with pytest.raises(RunDirError, match=r"cannot tell whether a segment .* \(slurm_load_jobs error\)"):
        check_resume_from(run, FakeBackend(error="slurm_load_jobs error"), 10, TRAIN_ITERS)  # type: ignore[arg-type]
    with pytest.raises(RunDirError, match=r"running or queued: 77 \(pending\)"):
        check_resume_from(run, FakeBackend({"77": Live("PENDING")}), 10, TRAIN_ITERS)  # type: ignore[arg-type]
    assert not run.resume_request.exists()


def test_refused_outside_the_runs_group(run: RunPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == run.state else real(p, mode))
    with pytest.raises(RunDirError, match=r"cannot write .*/state: only members of the run's group '\w+' can"):
        check_resume_from(run, FakeBackend(), 10, TRAIN_ITERS)  # type: ignore[arg-type]
    assert not run.resume_request.exists()


# --- what is written, and what the backend gets --------------------------------------------------------

def test_resume_chain_writes_the_request_and_says_what_will_happen(run: RunPaths) -> None:
    said: list[str] = []
    backend = FakeBackend()
    started = resume_chain(run, backend, said.append, from_iteration=10, train_iters=TRAIN_ITERS)  # type: ignore[arg-type]
    assert started.job_id == "123"
    assert said == ["resuming from iteration 10; checkpoints 20, 30 will be moved aside "
                    "(kept as iter_NNNNNNN.abandoned-<job id>)"]
    ((iteration, request),) = backend.resumed
    assert iteration == 10 and request is not None and request["iteration"] == 10 and request["user"]
    assert sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000010", "iter_0000020", "iter_0000030"]  # the job moves them, not the login node
    said.clear()
    resume_chain(run, FakeBackend(), said.append, from_iteration=30, train_iters=TRAIN_ITERS)  # type: ignore[arg-type]
    assert said == ["replacing the pending request to resume from iteration 10",
                    "resuming from iteration 30 (the newest checkpoint: none is moved aside)"]
    # a plain resume takes back a request no segment applied: it means "from the newest"
    said.clear()
    resume_chain(run, FakeBackend(), said.append, train_iters=TRAIN_ITERS)  # type: ignore[arg-type]
    assert said == ["withdrew the pending request to resume from iteration 30 (no segment had applied it)"]
    assert not run.resume_request.exists() and Ledger(run).last("resume_request_withdrawn")["iteration"] == 30


def test_a_failed_submission_leaves_no_request(run: RunPaths) -> None:
    with pytest.raises(SlurmError):
        resume_chain(run, FakeBackend(fail=True), lambda s: None, from_iteration=20, train_iters=TRAIN_ITERS)  # type: ignore[arg-type]
    assert not run.resume_request.exists()


def test_local_backend_records_from_iteration_and_user(run: RunPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    import getpass

    from megalaunch.launcher.backends import local
    from megalaunch.launcher.chain.chain import Verdict

    monkeypatch.setattr(local, "run_local_chain", lambda *a, **k: Verdict(False, "stand-in"))
    local.LocalBackend().resume(run, print, from_iteration=20)
    local.LocalBackend().resume(run, print)
    first, second = [e for e in read_jsonl(run.ledger) if e["event"] == "chain_resumed"]
    assert first["from_iteration"] == 20 and first["user"] == getpass.getuser()
    assert "from_iteration" not in second


# --- the job's side: applied once, refused, and `job begin` -------------------------------------------

def test_plan_resume_applies_a_request_once(run: RunPaths) -> None:
    write_resume_request(run, 10)
    plan = resume.plan_resume(run, job_id="local-2")
    assert plan.iteration == 10 and run.read_tracker() == 10
    assert sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000010", "iter_0000020.abandoned-local-2", "iter_0000030.abandoned-local-2"]
    (event,) = [e for e in read_jsonl(run.ledger) if e["event"] == "resume_from"]
    assert event["abandoned"] == [20, 30] and event["requested_by"] and event["job_id"] == "local-2"
    assert not run.resume_request.exists()
    assert json.loads(run.settled_resume_request("done", "local-2").read_text())["iteration"] == 10
    fake_checkpoint(run, 15)  # the next segment saved; the one after it resumes from its newest
    assert resume.plan_resume(run, job_id="local-3").iteration == 15
    assert len([e for e in read_jsonl(run.ledger) if e["event"] == "resume_from"]) == 1


def test_plan_resume_refuses_an_unusable_request_and_consumes_it(run: RunPaths) -> None:
    write_resume_request(run, 20)
    (resume.iter_dir(run, 20) / "__1_0.distcp").unlink()  # broken after the CLI's check
    with pytest.raises(ValueError, match=r"megalaunch resume --from 20 \(by \w+\): checkpoint 20 is not usable "
                                         r"\(missing shard __1_0.distcp\); complete ones: \[10, 30\]"):
        resume.plan_resume(run, job_id="local-2")
    assert not run.resume_request.exists() and run.settled_resume_request("refused", "local-2").exists()
    assert run.read_tracker() == 30 and resume.iter_dir(run, 30).is_dir()  # nothing moved
    (event,) = [e for e in read_jsonl(run.ledger) if e["event"] == "resume_refused"]
    assert event["iteration"] == 20 and event["complete"] == [10, 30]
    assert resume.plan_resume(run, job_id="local-3").iteration == 30  # a plain resume afterwards works
    run.resume_request.write_text("not json")
    with pytest.raises(ValueError, match="is not a resume request"):
        resume.plan_resume(run, job_id="local-4")
    assert not run.resume_request.exists()


def test_explicit_resume_from_leaves_the_request_alone(run: RunPaths) -> None:
    write_resume_request(run, 10)
    assert resume.plan_resume(run, job_id="7", requested=20).iteration == 20
    assert requested_iteration(run) == 10


def test_job_begin_starts_at_the_requested_iteration(run: RunPaths) -> None:
    class Scheduler:
        def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None) -> str | None:
            return None

        def known_nodes(self, partition: str | None) -> list[str] | None:
            return None

        def exclude(self, job_ids: list[str], nodes: list[str]) -> None: ...

        def cancel_jobs(self, job_ids: list[str]) -> None: ...

        def state(self, job_id: str) -> str | None:
            return None

    fake_checkpoint(run, TRAIN_ITERS)
    run.tracker.write_text(f"{TRAIN_ITERS}\n")  # finished: without the request the chain would not start
    Ledger(run).append("chain_resumed", from_iteration=20)
    write_resume_request(run, 20)
    assert Chain(run, Scheduler()).begin("local-2").proceed
    started = Ledger(run).last("started")
    assert started["resume_from"] == 20 and started["checkpoint_iteration"] == TRAIN_ITERS


def test_status_shows_the_resume(run: RunPaths) -> None:
    write_resume_request(run, 10)
    text = format_run_status(run_status(run))
    assert "resume request pending: iteration 10 (by" in text
    resume.plan_resume(run, job_id="local-2")
    st = run_status(run)
    assert st["resume"]["last"]["abandoned"] == [20, 30] and st["resume"]["pending"] is None
    assert ("  resumed from iteration 10 (asked by" in format_run_status(st)
            and "by job local-2; moved aside: 20, 30 (checkpoints/iter_NNNNNNN.abandoned-local-2)"
            in format_run_status(st))
    assert format_resume({"last": {"event": "resume_refused", "iteration": 20, "job_id": "9", "reason": "missing"},
                          "pending": None}) == ["  resume from iteration 20 refused by job 9: missing"]


# --- the light check against what torch.distributed.checkpoint really writes ----------------------------

def test_light_check_reads_the_shard_names_of_a_real_checkpoint(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "iter_0000010"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(16)}, checkpoint_id=str(d), no_dist=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    assert completeness._dcp_shard_names(d / ".metadata") == set(completeness._dcp_extents(d / ".metadata")) != set()
    assert resume.incomplete_reason(d, full=False) is None and resume.incomplete_reason(d) is None
    shard = next(d.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    assert resume.incomplete_reason(d, full=False) is None  # the job's full check sees it
    assert "truncated shard" in (resume.incomplete_reason(d) or "")
    shard.unlink()
    assert resume.incomplete_reason(d, full=False) == f"missing shard {shard.name}"
