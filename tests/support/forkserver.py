"""A fork server for the tests' Megatron processes (issue 36: CI time on a 2-core machine).

A trainer rank started fresh imports torch and Megatron (~5.6 of a 3-iteration rank's ~10 s here;
bench/fork_trainer.py). One server per test process imports what a rank imports, once, and forks:

- the harness's ranks (tests/megatron/harness.Trainer): the child is the rank's task supervisor
  (runtime/task.py, unchanged: stop signal blocked, child subreaper, the rank record, leaving the way the
  trainer left), in a session of its own as `start_new_session=True` gives a fresh process, with the rank's
  environment, working directory and output file; the supervisor starts the trainer by forking
  (`runtime.train.main`, same arguments) instead of exec'ing, and the trainer gets a fresh interpreter's
  signal dispositions back, not the supervisor's handlers, which a fork would otherwise pass on;
- `python ARGS` for the local backend's tasks through the shim (`python()`, tests/support/forkshim.py), over a
  Unix socket that also carries the shim's standard streams;
  The same shim serves root's Slurm jobs where a test asks for it (tests/slurm/launch.trainer_python: the
  triggers, the journey, evaluation jobs, the shrinking chain): srun starts the shim as the step's task;
- `python -c CODE` and `python FILE.py` (the model tests' scripts), through the shim too;
- a function call (`Server.call`: the conversion tests' logits workers).

Not forked (fresh processes): start-up itself (`Trainer(fresh=True)`: import phases, import noise, deferred
compilation), Triton's interpreter (TRITON_INTERPRET is read when Triton is imported), Slurm tests whose claim
is about the processes Slurm starts (the time-limit chain: SIGUSR2 to every process of the step; a rank
killed by its pid in the step's process tree), other users' jobs, a machine with NVIDIA GPUs, and everything
with MEGALAUNCH_TEST_FORK=0. The owner's protocol is JSON lines on the server's stdin/stdout:
requests {"argv" | "call", "env", "cwd", "log"}, answers {"pid", "serial"}, and for every child that ends
{"exit": pid, "serial": the request's serial (null for a shim's child), "status": wait status, "cpu": seconds
(the child's with what it reaped)}. Statuses are matched by serial, not pid: pids wrap (pid_max is 32768 on
the CI machine, and a CI run starts more processes than that), so an ended child's pid can be a new one's."""

from __future__ import annotations

import base64
import builtins
import contextlib
import importlib
import json
import os
import pickle
import runpy
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
SHIM = Path(__file__).resolve().parent / "forkshim.py"
ENABLED_ENV = "MEGALAUNCH_TEST_FORK"
TRAIN = ["-m", "megalaunch.runtime.train"]
# What a tiny CPU rank imports after Megatron (traced: sys.modules after a segment less before it): W&B
# on rank 0, TorchDynamo (Adam's step imports it), Megatron's datasets, tokenizers and checkpoint reader,
# megalaunch's runtime. A module missing here costs time, not truth. Not pandas (W&B's): importing it
# starts a native thread, and the server must stay one thread to fork safely (serve() checks).
WARM = ("megalaunch.runtime.task", "megalaunch.runtime.train", "megalaunch.runtime.loop.megatron_seams",
        "megalaunch.runtime.loop.parallel_load", "megalaunch.runtime.model.model", "megalaunch.runtime.model.cpu_compat",
        "megalaunch.runtime.observation.wandb_run", "megalaunch.runtime.rank.collectives",
        "megalaunch.runtime.health.stragglers", "megalaunch.runtime.health.watchdog", "megalaunch.rundir.ledger",
        "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.datasets.gpt_dataset",
        "megatron.core.tokenizers.text.models.gpt_tokenizer", "megatron.core.models.mimo",
        "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
        "megalaunch.conversion.model", "megatron.core.dist_checkpointing", "torch._dynamo", "numpy.random", "numpy.fft", "numpy.ma", "wandb")
# The light server's (cli_python(): the unit tests' `megalaunch ...` calls, tests/unit/helpers.cli, root's calls in
# the Slurm tests and their jobs' `megalaunch job ...`, tests/slurm/launch.py): what the CLI imports for its
# commands, no torch: a call costs ~0.05 CPU-s instead of a fresh interpreter's ~0.3-0.45.
LIGHT = ("megalaunch.cli.main", "megalaunch.config.loader", "megalaunch.launcher.prepare.prepare",
         "megalaunch.launcher.prepare.write", "jinja2", "yaml", "megalaunch.launcher.chain.chain",
         "megalaunch.launcher.chain.restart", "megalaunch.launcher.backends.registry", "megalaunch.runtime.hangwatch",
         "megalaunch.launcher.status")


# ---------------------------------------------------------------- the server (its own process)

def _trainer_start(command: list[str], *, hold: bool, rank: int, preexec_fn: Any = None, **popen: Any) -> Any:
    """runtime/task.py's way of starting the command, forking the trainer instead of exec'ing it."""
    from megalaunch.runtime.observation import rank_output

    if hold or command[1:3] != TRAIN:
        return rank_output.start(command, hold=hold, rank=rank, preexec_fn=preexec_fn, **popen)

    def trainer() -> int:
        if preexec_fn is not None:
            preexec_fn()
        # a fresh interpreter's dispositions (the supervisor's no-op handlers are not the trainer's)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [command[0], *command[3:]]
        from megalaunch.runtime import train

        return train.main(command[3:]) or 0

    pid = _fork(trainer)
    return _Forked(pid), None


class _Forked:
    """What runtime/task.run needs of the started command: its pid and a settable returncode."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _stdio(request: dict[str, Any]) -> None:
    """Standard input, output and error: the client's own (passed over the socket), or /dev/null and a log."""
    fds = request.get("fds") or [os.open(os.devnull, os.O_RDONLY),
                                 *[os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)] * 2]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)


def _run(request: dict[str, Any]) -> int:
    """In the server's child, in a session of its own with the client's environment and directory: call the
    function asked for (`call`: "module:function", `args`: pickled, base64), or be `python ARGV...`: the
    task supervisor (forking its trainer), another `-m` module, `-c CODE`, a script FILE.py, or anything else
    by exec'ing Python."""
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # the client's PYTHONPATH first, as a fresh interpreter would have it (the server's own stays behind)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    _stdio(request)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as a fresh interpreter has it
    if "call" in request:
        module, name = request["call"].split(":")
        getattr(importlib.import_module(module), name)(*pickle.loads(base64.b64decode(request["args"])))
        return 0
    argv = request["argv"]
    if argv[:2] == ["-m", "megalaunch.runtime.task"]:
        from megalaunch.runtime import task

        task.rank_output_start = _trainer_start  # type: ignore[assignment]
        sys.argv = ["megalaunch.runtime.task", *argv[2:]]
        return task.main(argv[2:])
    if argv[:1] == ["-m"] and len(argv) > 1:
        sys.path.insert(0, os.getcwd())  # as `python -m` puts the working directory first
        sys.argv = [argv[1], *argv[2:]]
        # a module the server imported runs again as __main__ (what it imports stays imported), as it would
        # in a fresh interpreter, without runpy's warning about finding it imported already
        sys.modules.pop(argv[1], None)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    if argv[:1] == ["-c"] and len(argv) > 1:
        sys.path.insert(0, "")  # as `python -c` puts the working directory first
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
        return 0
    if argv and argv[0].endswith(".py") and os.path.isfile(argv[0]):
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python FILE` puts its folder first
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    os.execv(sys.executable, [sys.executable, *argv])
    return 127  # not reached


def _fork(child: Callable[[], int]) -> int:
    """Fork; the child runs `child` and leaves with its code (a SystemExit's, or 1 on an exception, whose
    traceback goes to its standard error), never returning into the caller's code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:
            traceback.print_exc()
        finally:
            # what an interpreter's exit does that matters here: multiprocessing's exit hook shuts down the
            # child's managers and joins its processes (a checkpoint writer's Manager otherwise outlives it,
            # holding its output pipe open). The other exit handlers are the server's, not the child's.
            if "multiprocessing.util" in sys.modules:
                with contextlib.suppress(Exception):
                    sys.modules["multiprocessing.util"]._exit_function()
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    return pid


def _spawn(request: dict[str, Any], close: list[Any]) -> int:
    """Fork the child for `request`; `close`: the server's sockets, which the child must not hold open."""

    def child() -> int:
        for sock in close:
            sock.close()
        return _run(request)

    pid = _fork(child)
    for fd in request.get("fds") or []:
        os.close(fd)
    return pid


class _Loop:
    """The server's one thread: requests from the owning test process (stdin, JSON lines) and from shims
    (a SOCK_SEQPACKET socket: one request with the shim's stdin/stdout/stderr, then the exit status back;
    the shim's end closing while its child lives means the shim was killed, so the child's session is
    killed too, as SIGKILL to a process group would have)."""

    def __init__(self, out: IO[str], listener: socket.socket) -> None:
        self.out, self.listener = out, listener
        self.conns: dict[int, socket.socket] = {}  # fileno -> a shim's connection
        self.child_of: dict[int, int] = {}  # fileno -> the child started for it
        self.conn_of: dict[int, socket.socket] = {}  # child pid -> its shim's connection
        self.serial_of: dict[int, int] = {}  # child pid -> the owner's request it answers (1, 2, ...)
        self.serials = 0

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def sockets(self) -> list[Any]:
        return [self.listener, *self.conns.values()]

    def drop(self, conn: socket.socket) -> None:
        self.conns.pop(conn.fileno(), None)
        pid = self.child_of.pop(conn.fileno(), None)
        if pid is not None and self.conn_of.pop(pid, None) is not None:  # the shim died first
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        conn.close()

    def from_shim(self, conn: socket.socket) -> None:
        if conn.fileno() < 0:  # dropped earlier in this round (reap: its child ended); reading it would raise EBADF
            return
        if conn.fileno() in self.child_of:  # only its end closing can come after the request
            if not conn.recv(64):
                self.drop(conn)
            return
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not data:
            self.drop(conn)
            return
        pid = _spawn({**json.loads(data), "fds": fds}, self.sockets())
        self.child_of[conn.fileno()], self.conn_of[pid] = pid, conn
        conn.send(json.dumps({"pid": pid}).encode())

    def reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.conn_of.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"status": status}).encode())
                self.child_of.pop(conn.fileno(), None)
                self.drop(conn)
            # the child's CPU with what it reaped (tests/conftest.py's CPU log counts it)
            self.send({"exit": pid, "serial": self.serial_of.pop(pid, None), "status": status,
                       "cpu": usage.ru_utime + usage.ru_stime})

    def spawn_for_owner(self, request: dict[str, Any]) -> None:
        pid = _spawn(request, self.sockets())
        self.serials += 1
        self.serial_of[pid] = self.serials
        self.send({"pid": pid, "serial": self.serials})


def _ready(items: list[Any], timeout_s: float) -> list[Any]:
    """Those of `items` (sockets or file descriptors) with something to read, as select() would say, through
    poll(): select() refuses descriptors >= 1024, and a busy server can hold that many."""
    poller = select.poll()
    by_fd = {}
    for item in items:
        fd = item if isinstance(item, int) else item.fileno()
        by_fd[fd] = item
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(int(timeout_s * 1000))]


def serve(light: bool = False) -> int:
    """Import what the trainer imports (`light`: what the CLI imports), then fork a child per request until
    stdin closes."""
    if light:
        for name in LIGHT:
            importlib.import_module(name)
    else:
        from megalaunch.runtime.model.megatron_import import import_megatron

        import_megatron()
        for name in WARM:
            importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, f"the fork server must have one thread to fork safely, it has {threads} (see WARM)"
    home = Path(tempfile.mkdtemp(prefix="ml-forkserver-"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(home / "sock"))
    listener.listen(64)
    shim = home / "python"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I -S {shlex.quote(str(SHIM))} "
                    f"{shlex.quote(str(home / 'sock'))} {shlex.quote(sys.executable)} \"$@\"\n")
    shim.chmod(0o755)
    loop = _Loop(sys.stdout, listener)
    loop.send({"ready": os.getpid(), "python": str(shim)})
    buffer = b""
    stdin = sys.stdin.fileno()
    try:
        while True:
            ready = _ready([stdin, *loop.sockets()], 0.05)
            loop.reap()
            for item in ready:
                if item is listener:
                    conn, _ = listener.accept()
                    loop.conns[conn.fileno()] = conn
                elif isinstance(item, socket.socket):
                    loop.from_shim(item)
                else:
                    chunk = os.read(stdin, 1 << 16)
                    if not chunk:
                        return 0  # the test process went away; its ranks are its to end
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        loop.spawn_for_owner(json.loads(line))
    finally:
        shutil.rmtree(home, ignore_errors=True)


# ---------------------------------------------------------------- the client (the test process)

def enabled() -> bool:
    """On unless MEGALAUNCH_TEST_FORK=0, and never on a machine with NVIDIA GPUs (the device's tests and
    benchmarks measure the path users take, whose start-up is part of what they measure)."""
    return os.environ.get(ENABLED_ENV, "1") != "0" and not os.path.exists("/dev/nvidiactl")


def cli_python() -> str:
    """An interpreter for the tests' `python -m megalaunch.cli.main ...` calls: the light server's shim (the CLI
    forked from a process that has imported it, and no torch), or this Python when forking is off. The CLI
    reads its environment when it runs, not when it is imported (PATH, XDG_STATE_HOME, MEGALAUNCH_DEBUG), so
    a forked call sees the caller's; a call whose PYTHONPATH hides or replaces modules needs a fresh one."""
    return Server.get_light().python if enabled() else sys.executable


def python() -> str:
    """An interpreter for `cluster.python` in the tests' local-backend recipes: the server's shim (its tasks
    and trainers forked from the server, tests/support/forkshim.py), or this Python when forking is off."""
    return Server.get().python if enabled() else sys.executable


class Rank:
    """A forked rank's supervisor, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, server: Server, pid: int, serial: int) -> None:
        self.server = server
        self.pid = pid
        self.serial = serial  # what its exit is known by (its pid may be reused once it is reaped)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            status = self.server.status(self.serial, timeout=0)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            status = self.server.status(self.serial, timeout=timeout)
            if status is None:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Server:
    """One server per test process, started on first use, ended with the process."""

    _instance: Server | None = None
    _light: Server | None = None
    cpu_s = 0.0  # CPU seconds of the ranks that ended so far, in this test process

    def __init__(self, light: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
        # its own warnings (Megatron's import notes) in a file, not in every test's output
        self.log = Path(tempfile.mkstemp(prefix="ml-forkserver-", suffix=".log")[1])
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, *(["--light"] if light else [])],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, text=True, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()}): "
                               f"{self.log.read_text(errors='replace')[-3000:]}")
        self.python = json.loads(first)["python"]  # the shim: `python ARGS` forked from the server
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.started: list[tuple[int, int]] = []  # (pid, serial) answers not yet taken
        self.statuses: dict[int, int] = {}  # serial -> wait status
        self.reader = threading.Thread(target=self._read, daemon=True, name="forkserver-reader")
        self.reader.start()

    @classmethod
    def get(cls) -> Server:
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = Server()
        return cls._instance

    @classmethod
    def get_light(cls) -> Server:
        """The server without torch: the CLI's imports only."""
        if cls._light is None or cls._light.proc.poll() is not None:
            cls._light = Server(light=True)
        return cls._light

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "pid" in message:
                    self.started.append((message["pid"], message["serial"]))
                else:
                    if message["serial"] is not None:
                        self.statuses[message["serial"]] = message["status"]
                    Server.cpu_s += message["cpu"]
                self.changed.notify_all()

    def start(self, argv: list[str], *, env: dict[str, str], log: Path, cwd: Path | None = None) -> Rank:
        """Fork `python ARGV` (the harness: `-m megalaunch.runtime.task --signal SIG -- python -m
        megalaunch.runtime.train RUN ...`), its output to `log`."""
        return self._request({"argv": argv, "env": env, "log": str(log), "cwd": str(cwd or Path.cwd())})

    def _request(self, request: dict[str, Any]) -> Rank:
        assert self.proc.stdin is not None
        with self.changed:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            if not self.changed.wait_for(lambda: self.started or self.proc.poll() is not None, timeout=60) \
                    or not self.started:
                raise RuntimeError("the fork server did not answer")
            return Rank(self, *self.started.pop(0))

    def call(self, function: str, args: tuple[Any, ...], *, log: Path, env: dict[str, str] | None = None) -> Rank:
        """Fork a process that calls `function` ("module:name", importable with the repository on the path)
        with `args`, its output to `log`; exit status 0 when it returned."""
        return self._request({"call": function, "args": base64.b64encode(pickle.dumps(args)).decode(),
                              "env": env or dict(os.environ), "log": str(log), "cwd": str(Path.cwd())})

    def status(self, serial: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: serial in self.statuses, timeout=timeout)
            return self.statuses.get(serial)


if __name__ == "__main__":
    sys.exit(serve(light="--light" in sys.argv[1:]))
