"""A fork server for the Megatron tests' trainer ranks (issue 36: CI time on a 2-core machine).

Every rank that tests/megatron/harness.Trainer starts is `python -m megalaunch.runtime.task -- python -m
megalaunch.runtime.train RUN`: a fresh interpreter that imports torch and Megatron (~5.6 of a 3-iteration
rank's ~10 s here; bench/fork_trainer.py). This module runs one server per test process that has
imported what the trainer imports, once, and forks each rank from it:

- the server's child is the rank's task supervisor (runtime/task.py, unchanged: stop signal blocked,
  child subreaper, the rank record, leaving the way the trainer left), in a session of its own as
  `start_new_session=True` gives a fresh process, with the rank's environment, working directory and
  output file;
- the supervisor starts the trainer by forking (`runtime.train.main` with the same arguments) instead of
  exec'ing a new interpreter; the trainer gets Python's own signal dispositions back (a fresh
  interpreter's), not the supervisor's handlers, which a fork would otherwise pass on.

What is not the path users take, and stays with fresh processes (`Trainer(fresh=True)`, or
MEGALAUNCH_TEST_FORK=0 for all): start-up itself (import phases, import noise, deferred compilation),
and anything inside Slurm, where the step's processes are Slurm's. The protocol is JSON lines: the
client writes {"env", "cwd", "log", "argv"}, the server answers {"pid"} and, when a supervisor ends,
{"exit": pid, "status": wait status, "cpu": seconds (the supervisor's and the trainer's)}."""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
ENABLED_ENV = "MEGALAUNCH_TEST_FORK"
TRAIN = ["-m", "megalaunch.runtime.train"]
# What a tiny CPU rank imports after Megatron (traced: sys.modules after a segment less before it): W&B
# and what it brings (pandas) on rank 0, TorchDynamo (Adam's step imports it), Megatron's datasets,
# tokenizers and checkpoint reader, megalaunch's runtime. A module missing here costs time, not truth.
WARM = ("megalaunch.runtime.task", "megalaunch.runtime.train", "megalaunch.runtime.loop.megatron_seams",
        "megalaunch.runtime.loop.parallel_load", "megalaunch.runtime.model.model", "megalaunch.runtime.model.cpu_compat",
        "megalaunch.runtime.observation.wandb_run", "megalaunch.runtime.rank.collectives",
        "megalaunch.runtime.health.stragglers", "megalaunch.runtime.health.watchdog", "megalaunch.rundir.ledger",
        "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.datasets.gpt_dataset",
        "megatron.core.tokenizers.text.models.gpt_tokenizer", "megatron.core.models.mimo",
        "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
        "megalaunch.conversion.model", "megatron.core.dist_checkpointing", "torch._dynamo", "numpy.random", "numpy.fft", "numpy.ma", "wandb", "pandas")


# ---------------------------------------------------------------- the server (its own process)

def _trainer_start(command: list[str], *, hold: bool, rank: int, preexec_fn: Any = None, **popen: Any) -> Any:
    """runtime/task.py's way of starting the command, forking the trainer instead of exec'ing it."""
    from megalaunch.runtime.observation import rank_output

    if hold or command[1:3] != TRAIN:
        return rank_output.start(command, hold=hold, rank=rank, preexec_fn=preexec_fn, **popen)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if preexec_fn is not None:
                preexec_fn()
            # a fresh interpreter's dispositions (the supervisor's no-op handlers are not the trainer's)
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.argv = [command[0], *command[3:]]
            from megalaunch.runtime import train

            code = train.main(command[3:]) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return _Forked(pid), None


class _Forked:
    """What runtime/task.run needs of the started command: its pid and a settable returncode."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


def _run(request: dict[str, Any]) -> int:
    """In the server's child: become the rank's task supervisor, as the harness would have started it,
    or call the function asked for (`call`: "module:function", `args`: pickled, base64)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as a fresh interpreter has it
    if "call" in request:
        module, name = request["call"].split(":")
        getattr(importlib.import_module(module), name)(*pickle.loads(base64.b64decode(request["args"])))
        return 0
    from megalaunch.runtime import task

    task.rank_output_start = _trainer_start  # type: ignore[assignment]
    sys.argv = ["megalaunch.runtime.task", *request["argv"]]
    return task.main(request["argv"])


def _spawn(request: dict[str, Any]) -> int:
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _run(request)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _reap(out: IO[str]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        # the supervisor's CPU with the trainer's it reaped (tests/conftest.py's CPU log counts it)
        out.write(json.dumps({"exit": pid, "status": status, "cpu": usage.ru_utime + usage.ru_stime}) + "\n")
        out.flush()


def serve() -> int:
    """Import what the trainer imports, then fork a rank per request until stdin closes."""
    from megalaunch.runtime.model.megatron_import import import_megatron

    import_megatron()
    for name in WARM:
        importlib.import_module(name)

    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    buffer = b""
    stdin = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        _reap(out)
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            return 0  # the client went away; its ranks are theirs to end
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            pid = _spawn(json.loads(line))
            out.write(json.dumps({"pid": pid}) + "\n")
            out.flush()


# ---------------------------------------------------------------- the client (the test process)

def enabled() -> bool:
    return os.environ.get(ENABLED_ENV, "1") != "0"


class Rank:
    """A forked rank's supervisor, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, server: Server, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            status = self.server.status(self.pid, timeout=0)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = self.server.status(self.pid, timeout=timeout)
            if status is None:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Server:
    """One server per test process, started on first use, ended with the process."""

    _instance: Server | None = None
    cpu_s = 0.0  # CPU seconds of the ranks that ended so far, in this test process

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()})")
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.pids: list[int] = []
        self.statuses: dict[int, int] = {}
        self.reader = threading.Thread(target=self._read, daemon=True, name="forkserver-reader")
        self.reader.start()

    @classmethod
    def get(cls) -> Server:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = Server()
        return cls._instance

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "pid" in message:
                    self.pids.append(message["pid"])
                else:
                    self.statuses[message["exit"]] = message["status"]
                    Server.cpu_s += message["cpu"]
                self.changed.notify_all()

    def start(self, argv: list[str], *, env: dict[str, str], log: Path, cwd: Path | None = None) -> Rank:
        """Fork a rank: `argv` is the task supervisor's (`--signal SIG -- python -m megalaunch.runtime.train
        RUN ...`)."""
        return self._request({"argv": argv, "env": env, "log": str(log), "cwd": str(cwd or Path.cwd())})

    def _request(self, request: dict[str, Any]) -> Rank:
        assert self.proc.stdin is not None
        with self.changed:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if not self.changed.wait_for(lambda: self.pids or self.proc.poll() is not None, timeout=60) or not self.pids:
                raise RuntimeError("the fork server did not answer")
            return Rank(self, self.pids.pop(0))

    def call(self, function: str, args: tuple[Any, ...], *, log: Path, env: dict[str, str] | None = None) -> Rank:
        """Fork a process that calls `function` ("module:name", importable with the repository on the path)
        with `args`, its output to `log`; exit status 0 when it returned."""
        return self._request({"call": function, "args": base64.b64encode(pickle.dumps(args)).decode(),
                              "env": env or dict(os.environ), "log": str(log), "cwd": str(Path.cwd())})

    def status(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.statuses, timeout=timeout)
            return self.statuses.get(pid)


if __name__ == "__main__":
    sys.exit(serve())
