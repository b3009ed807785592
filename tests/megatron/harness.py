"""Drive `python -m megalaunch.runtime.train RUN` processes from tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    from tests.support import forkserver
except ModuleNotFoundError:  # a script with only tests/megatron on its path: fresh ranks
    forkserver = None  # type: ignore[assignment]

from megalaunch.config.loader import load_recipe
from megalaunch.launcher.prepare.prepare import prepare_run
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.files import read_json, read_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.dist_env import free_port

SRC = Path(__file__).resolve().parents[2] / "src"
# One micro-batch of 2 x 64 tokens per rank and step keeps an iteration ~50 ms on a CPU.
FAST = ["training.micro_batch_size=2", "training.global_batch_size=2", "training.log_interval=1",
        "chain.hang_timeout_s=120"]


def make_run(root: Path, *sets: str, name: str = "tiny", recipe: str = "tiny") -> RunPaths:
    loaded = load_recipe(recipe, [*FAST, *sets], name=name)
    return write_run(prepare_run(loaded, root=root))




class Trainer:
    """The processes of one segment: `world` ranks of the training entry on this machine, each under
    the task supervisor in a process group of its own, so that `signal()` reaches every process of
    a rank (checkpoint writers, resource trackers) as Slurm's signal reaches every process of a step."""

    def __init__(self, paths: RunPaths, *, world: int = 1, job_id: str = "1", env: dict[str, str] | None = None,
                 args: tuple[str, ...] = (), fresh: bool = False) -> None:
        """`fresh`: start every rank as a new interpreter (for tests of start-up itself); otherwise each
        rank's supervisor and trainer are forked from a server that has imported torch and Megatron
        (tests/support/forkserver.py; MEGALAUNCH_TEST_FORK=0: fresh everywhere)."""
        self.paths = paths
        self.job_id = job_id
        port = free_port()
        self.logs = [paths.logs / f"test-{job_id}-rank{r}.log" for r in range(world)]
        self.procs: list[Any] = []  # subprocess.Popen, or forkserver.Rank (the same interface)
        server = forkserver.Server.get() if forkserver is not None and not fresh and forkserver.enabled() else None
        for rank in range(world):
            e = {**os.environ, "PYTHONPATH": str(SRC), "MEGALAUNCH_RUN_DIR": str(paths.root),
                 "MEGALAUNCH_JOB_ID": job_id, "RANK": str(rank), "LOCAL_RANK": str(rank),
                 "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}
            e.pop("WANDB_API_KEY", None)
            argv = ["-m", "megalaunch.runtime.task", "--signal", "SIGUSR2", "--",
                    sys.executable, "-m", "megalaunch.runtime.train", str(paths.root), *args]
            if server is not None:
                self.procs.append(server.start(argv, env=e, log=self.logs[rank]))
                continue
            with open(self.logs[rank], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, *argv],
                    env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def signal(self, sig: int = signal.SIGUSR2) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)

    def wait(self, timeout: float = 300) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")

    def outcome(self) -> dict[str, Any]:
        data = read_json(self.paths.outcome)
        assert isinstance(data, dict), f"no outcome; log:\n{self.log()[-3000:]}"
        return data


def wait_for(predicate: Callable[[], Any], timeout: float = 120, what: str = "condition",
             trainer: Trainer | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if trainer is not None and any(p.poll() is not None for p in trainer.procs):
            value = predicate()
            if value:
                return value
            raise AssertionError(f"trainer exited before {what}:\n{trainer.log()[-3000:]}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def run_segment(paths: RunPaths, job_id: str, loss_log: Path, stop_after: int | None) -> Trainer:
    """One segment of a chain on the local trainer: stopped by the signal `stop_after` iterations after
    where it resumed (None: it runs to its end); every rank must exit 0."""
    start = last_iteration(loss_log)
    t = Trainer(paths, job_id=job_id, env={"MEGALAUNCH_LOSS_LOG": str(loss_log)})
    if stop_after is not None:
        wait_for(lambda: last_iteration(loss_log) >= start + stop_after, what=f"{stop_after} iterations", trainer=t)
        t.signal()
    assert t.wait() == [0], t.log()[-3000:]
    return t


def losses(path: Path) -> dict[int, float]:
    """Iteration -> loss from a MEGALAUNCH_LOSS_LOG file (a repeated iteration keeps its last value)."""
    return {r["iteration"]: r["loss"] for r in read_jsonl(path)}


def last_iteration(path: Path) -> int:
    records = read_jsonl(path)
    return records[-1]["iteration"] if records else 0


def ledger(paths: RunPaths, event: str) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(paths.ledger) if r.get("event") == event]


def acted_iterations(log: str, decision: str) -> list[int]:
    """Iterations at which a rank logged that it acted on `decision`."""
    out = []
    for line in log.splitlines():
        marker = f"] decision {decision} at iteration "
        if marker in line:
            out.append(int(line.split(marker)[1].split(":")[0]))
    return out


def checkpoint_state(directory: Path) -> dict[str, Any]:
    """All tensors and the optimizer's common step of a torch_dist checkpoint, read without Megatron."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ckpt.pt"
        dcp_to_torch_save(str(directory), str(out))
        sd = torch.load(out, weights_only=False)
    state: dict[str, Any] = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    common = sd["common_state/shard_0_1"][0]
    if "state" in common["optimizer"]:  # non-distributed optimizer: one step for all parameters
        step = common["optimizer"]["state"].get("common_step")
    else:  # distributed optimizer: the step travels in the param groups
        groups = next(v for k, v in sd.items() if k.startswith(("optimizer.distributed.", "chained_0.optimizer.")) and
                      k.endswith(".optimizer/shard_0_1"))[0]["param_groups"]
        step = groups[0]["step"]
    state["optimizer.step"] = float(step)
    state["iteration"] = common["iteration"]
    return state


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data))
