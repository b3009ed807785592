"""The stand-in trainer (MEGALAUNCH_TEST_STAND_IN=1, runtime/standin.py): 4 ranks of
`python -m megalaunch.runtime.task -- python -m megalaunch.runtime.train RUN` on this machine, each in a
process group of its own as Slurm starts tasks, with torch and Megatron made unimportable (a module of
either name on PYTHONPATH ends the process): stop signal, resume, a rank killed, a save trigger, the
health check's hooks. Every wait is on a file or a process exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.launcher.accounting.evidence import PEER_LOST, abnormal_ends, rank_errors
from megalaunch.launcher.accounting.goodput import segment_time
from megalaunch.launcher.chain.restart import STARTUP_GUESS_S, startup_estimate
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.triggers import TriggerBox
from megalaunch.runtime.checkpoint.completeness import incomplete_reason
from megalaunch.runtime.checkpoint.resume import iter_dir
from megalaunch.runtime.rank.dist_env import free_port

SRC = Path(__file__).resolve().parents[2] / "src"
WORLD = 4
GBS = 8  # the tiny recipe's global batch size
DECISION = re.compile(r"\[megalaunch rank (\d+)\] decision (\w+) at iteration (\d+)")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \|")


def make_run(root: Path, *sets: str) -> RunPaths:
    loaded = load_recipe("tiny", ["training.train_iters=40", "training.log_interval=1", "checkpoint.save_interval=1000",
                                  "chain.hang_timeout_s=60", 'cluster.env={MEGALAUNCH_TEST_STAND_IN: "1"}', *sets],
                         name="standin")
    return write_run(prepare_run(loaded, root=root))


def no_torch(tmp: Path) -> Path:
    """A directory that, first on PYTHONPATH, ends any process that imports torch or Megatron."""
    shim = tmp / "no-torch"
    (shim / "megatron").mkdir(parents=True, exist_ok=True)
    for module in (shim / "torch.py", shim / "megatron" / "__init__.py"):
        module.write_text("raise SystemExit('the stand-in imported ' + __name__)\n")
    return shim


class Ranks:
    """One segment's ranks, as the harness's Trainer (tests/megatron/harness.py) starts them: rank r on
    node `node{r // 2 + 1}` (SLURMD_NODENAME), two ranks per node."""

    def __init__(self, paths: RunPaths, tmp: Path, *, job_id: str, env: dict[str, str] | None = None) -> None:
        self.paths, self.job_id = paths, job_id
        port = free_port()
        self.logs = [tmp / f"job{job_id}-rank{r}.log" for r in range(WORLD)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(WORLD):
            e = {**os.environ, "PYTHONPATH": f"{no_torch(tmp)}{os.pathsep}{SRC}", "MEGALAUNCH_RUN_DIR": str(paths.root),
                 "MEGALAUNCH_JOB_ID": job_id, "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": str(WORLD),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "SLURMD_NODENAME": f"node{rank // 2 + 1}",
                 "MEGALAUNCH_TEST_STAND_IN": "1", "MEGALAUNCH_TEST_STEP_SLEEP_S": "0.1", **(env or {})}
            e.pop("WANDB_API_KEY", None)
            with open(self.logs[rank], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "megalaunch.runtime.task", "--signal", "SIGUSR2", "--",
                     sys.executable, "-m", "megalaunch.runtime.train", str(paths.root)],
                    env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def signal(self, sig: int = signal.SIGUSR2, ranks: range = range(WORLD)) -> None:
        for r in ranks:
            if self.procs[r].poll() is None:
                os.killpg(self.procs[r].pid, sig)

    def wait(self, timeout: float = 20) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            self.signal(signal.SIGKILL)
            for p in self.procs:
                p.wait()

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.log(r)[-2500:]}" for r in range(WORLD))

    def decisions(self, kind: str) -> dict[int, list[int]]:
        """Rank -> the iterations at which it logged acting on `kind`."""
        return {r: [int(m[3]) for m in DECISION.finditer(self.log(r)) if m[2] == kind] for r in range(WORLD)}


def wait_for(predicate: Callable[[], Any], ranks: Ranks, what: str, timeout: float = 15) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        if any(p.poll() is not None for p in ranks.procs):
            raise AssertionError(f"a rank exited before {what}:\n{ranks.all_logs()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}:\n{ranks.all_logs()}")


def progress(paths: RunPaths) -> int:
    data = read_json(paths.progress)
    return int(data["iteration"]) if isinstance(data, dict) and data.get("job_id") else 0


def events(paths: RunPaths, name: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(paths.ledger) if e.get("event") == name]


def test_a_stop_signal_saves_on_every_rank_at_one_iteration_and_the_next_segment_resumes_there(tmp_path: Path) -> None:
    paths = make_run(tmp_path / "runs")
    first = Ranks(paths, tmp_path, job_id="1")
    wait_for(lambda: progress(paths) >= 5, first, "5 iterations")
    first.signal()
    assert first.wait() == [0] * WORLD, first.all_logs()
    acted = first.decisions("signal")
    stop = acted[0][0]
    assert all(acted[r] == [stop] for r in range(WORLD)), acted
    outcome = read_json(paths.outcome)
    assert outcome["status"] == "saved" and outcome["iteration"] == stop and outcome["job_id"] == "1", outcome
    assert outcome["reason"] == f"SIGUSR2 at iteration {stop}"
    assert paths.read_tracker() == stop and incomplete_reason(iter_dir(paths, stop)) is None  # the full check
    assert sorted(p.name for p in iter_dir(paths, stop).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(WORLD)]
    assert [e["iteration"] for e in events(paths, "decision")] == [stop]
    records = sorted(paths.tasks("1").glob("rank-*.json"))
    assert [read_json(r)["exit_code"] for r in records] == [0] * WORLD
    assert "stand-in trainer" in first.log(0) and "the stand-in imported" not in first.all_logs()
    # the timeline and heartbeat as the chain reads a trainer's
    timeline = read_json(paths.timeline("1"))
    phases = timeline["phases"]
    for phase in ("process_start", "setup_done", "model_build_start", "load_start", "load_end", "data_end",
                  "first_iteration_end", "last_iteration_end", "signal_received", "decision", "exit"):
        assert phase in phases, (phase, sorted(phases))
    assert timeline["saves"] and timeline["saves"][-1][0] == stop and timeline["world"] == WORLD
    assert startup_estimate(paths) < STARTUP_GUESS_S
    assert read_json(paths.heartbeat("1"))["phase"] == "exit"
    seg = segment_time("1", {"time": phases["process_start"] - 1}, {"time": phases["exit"] + 1, "outcome": "saved"},
                       timeline, read_jsonl(paths.metrics), time.time())
    assert seg.parts["productive"] > 0 and seg.parts["checkpoint_save"] > 0 and seg.last_iteration == stop, seg.parts

    second = Ranks(paths, tmp_path, job_id="2")
    assert second.wait() == [0] * WORLD, second.all_logs()
    outcome = read_json(paths.outcome)
    assert outcome["status"] == "finished" and outcome["iteration"] == 40 and outcome["resumed_from"] == stop, outcome
    assert [(e["iteration"], e["consumed_samples"]) for e in events(paths, "resumed")] == [(stop, stop * GBS)]
    lines = [(int(m[1]), int(m[3])) for m in ITERATION.finditer(second.log(WORLD - 1))]  # Megatron's: the last rank's
    assert lines[0] == (stop + 1, (stop + 1) * GBS) and lines[-1] == (40, 40 * GBS), lines
    assert paths.read_tracker() == 40 and incomplete_reason(iter_dir(paths, 40)) is None  # the final save
    assert "the stand-in imported" not in second.all_logs()


def test_c_a_rank_killed_fails_every_other_rank_within_seconds(tmp_path: Path) -> None:
    paths = make_run(tmp_path / "runs")
    ranks = Ranks(paths, tmp_path, job_id="5")
    wait_for(lambda: progress(paths) >= 3, ranks, "3 iterations")
    killed = time.monotonic()
    ranks.signal(signal.SIGKILL, range(2, 3))  # rank 2's supervisor and trainer: a node lost
    codes = ranks.wait(timeout=10)
    took = time.monotonic() - killed
    assert codes[2] == -signal.SIGKILL and all(codes[r] == 1 for r in (0, 1, 3)), (codes, ranks.all_logs())
    assert took < 5, took
    outcome = read_json(paths.outcome)
    assert outcome["status"] == "failed" and PEER_LOST.search(outcome["reason"]), outcome
    assert "rank 2 on node2" in outcome["reason"], outcome
    errors = rank_errors(paths, "5")
    assert sorted(int(e["rank"]) for e in errors) == [0, 1, 3], errors
    assert all(PEER_LOST.search(str(e["reason"])) and not e["config"] for e in errors), errors
    assert {e.rank for e in abnormal_ends(paths, "5")} == {0, 1, 3}  # rank 2's supervisor died with it


def test_d_a_save_trigger_then_an_exit_trigger_are_acted_on_by_every_rank_at_one_iteration(tmp_path: Path) -> None:
    paths = make_run(tmp_path / "runs")
    ranks = Ranks(paths, tmp_path, job_id="7")
    wait_for(lambda: progress(paths) >= 3, ranks, "3 iterations")
    box = TriggerBox(paths)  # what `megalaunch trigger save|exit RUN` writes
    box.write("save", "test: a checkpoint now")
    wait_for(lambda: events(paths, "decision"), ranks, "the save decision")
    box.write("exit", "test: stop the chain")
    assert ranks.wait() == [0] * WORLD, ranks.all_logs()
    saved, left = ranks.decisions("save"), ranks.decisions("exit")
    at, out = saved[0][0], left[0][0]
    assert all(saved[r] == [at] and left[r] == [out] for r in range(WORLD)) and at < out, (saved, left)
    assert incomplete_reason(iter_dir(paths, at)) is None and incomplete_reason(iter_dir(paths, out)) is None
    assert [(e["decision"], e["iteration"], e["triggers"]) for e in events(paths, "decision")] == [
        ("save", at, ["save"]), ("exit", out, ["exit"])]
    assert sorted((c["consumed_iteration"], c["verb"]) for c in box.consumed()) == [(at, "save"), (out, "exit")]
    outcome = read_json(paths.outcome)
    assert (outcome["status"], outcome["iteration"], outcome["reason"]) == ("exited", out, f"exit trigger at iteration {out}")
    assert paths.read_tracker() == out


@pytest.mark.parametrize("hook", ["MEGALAUNCH_TEST_HEALTH_FAIL", "MEGALAUNCH_TEST_SLOW_NODE"])
def test_e_the_health_check_hooks_end_every_rank_unhealthy_naming_the_node(tmp_path: Path, hook: str) -> None:
    paths = make_run(tmp_path / "runs", "cluster.health_check=on")
    ranks = Ranks(paths, tmp_path, job_id="9", env={hook: "node2"})
    assert ranks.wait() == [0] * WORLD, ranks.all_logs()
    outcome = read_json(paths.outcome)
    assert outcome["status"] == "unhealthy_node" and "node2" in outcome["reason"], outcome
    check = outcome["health_check"]
    assert check["unhealthy_nodes"] == ["node2"] and not check["healthy"], check
    assert sorted((r["rank"], r["node"]) for r in check["ranks"]) == [(r, f"node{r // 2 + 1}") for r in range(WORLD)]
    assert [e["unhealthy_nodes"] for e in events(paths, "health_check")] == [["node2"]]
    for r in range(WORLD):
        assert "outcome unhealthy_node: health check: node2" in ranks.log(r), ranks.log(r)
    assert "iteration" not in json.dumps(read_json(paths.timeline("9"))["phases"])  # nothing trained
