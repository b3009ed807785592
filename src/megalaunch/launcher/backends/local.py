"""The local backend: the same run directory, chain, triggers and outcomes on one machine without
Slurm. Segments run one after another in this process; a timer plays the time limit: the stop
signal at LEAD before it, SIGTERM at the limit, SIGKILL a grace period later. Like Slurm, which
signals every process of a job step, each signal goes to the whole process group of each task
(the task supervisor, the trainer and everything the trainer started).

The hang watcher's decision (runtime/hangwatch.py) runs in the same loop: rank 0's heartbeat silent for
chain.startup_timeout_s before the first iteration (a little more than chain.hang_timeout_s after) ->
SIGURG to every task (Python stacks under RUN/debug/), outcome `hung`, SIGKILL, and the chain goes on."""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megalaunch.config.loader import load_run_recipe
from megalaunch.config.preflight import signal_lead_s
from megalaunch.config.schema import Recipe
from megalaunch.launcher.chain.backend import Echo, Live, Started, record_cancel, resumed_event, unfinished
from megalaunch.launcher.chain.chain import Chain, Verdict
from megalaunch.launcher.chain.notify import StopKind
from megalaunch.launcher.prepare.job_inputs import job_command, max_connections, task_supervisor
from megalaunch.launcher.prepare.prepare import PreparedRun
from megalaunch.launcher.prepare.signal_lead import record_lead, safe_plan
from megalaunch.launcher.prepare.write import write_run
from megalaunch.rundir.evals import queued
from megalaunch.rundir.ledger import Ledger, Segment
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.registry import register
from megalaunch.runtime.hangwatch import (
    STACKS_WAIT_S,
    HangWatch,
    Limits,
    read_beat,
    record_hang,
    record_limits,
)
from megalaunch.runtime.health.watchdog import STACKS_SIGNAL
from megalaunch.runtime.rank.dist_env import free_port
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.stop.signals import resolve_signal
from megalaunch.runtime.stop.stop_window import DEADLINE_ENV

KILL_WAIT_S = 10.0
POLL_S = 0.2


def pid_alive(pid: int) -> bool:
    """A process with this id runs on this host (signal 0 checks without sending anything); a zombie,
    ended but not yet reaped by its parent, does not count."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc here: trust the signal check
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] != b"Z"




def run_segment(paths: RunPaths, recipe: Recipe, job_id: str, chain_name: str,
                echo: Callable[[str], None] = print, lead: int | None = None) -> int:
    """Start one process per task, play the time limit, return the exit status (max over ranks).
    `lead`: the stop signal this long before the limit (default: the rendered lead)."""
    log_path = paths.logs / f"{chain_name}-{job_id}.out"
    procs, start = _start_tasks(paths, recipe, job_id, log_path)
    limit = recipe.cluster.time_limit_s
    step = _JobStep(procs, paths, job_id, echo, limit=limit, lead=signal_lead_s(recipe) if lead is None else lead,
                    stop_sig=resolve_signal(recipe.chain.stop_signal),
                    hang=HangWatch(Limits.for_run(paths, job_id), start))
    echo(f"segment {job_id}: {len(procs)} task(s), limit {limit} s, {step.stop_sig.name} at {limit - step.lead} s; "
         f"log {log_path}")
    while any(p.poll() is None for p in procs):
        elapsed = time.monotonic() - start
        step.kill_on_bad_exit()
        step.cancel_if_requested(elapsed)
        step.play_time_limit(elapsed)
        step.watch_for_hang(elapsed)
        time.sleep(POLL_S)
    codes = [p.returncode for p in procs]
    return max((c if c >= 0 else 128 - c) for c in codes)


def _start_tasks(paths: RunPaths, recipe: Recipe, job_id: str,
                 log_path: Path) -> tuple[list[subprocess.Popen[bytes]], float]:
    """One process per task, each in a session of its own, all appending to the segment's log, as srun
    starts a job step; and the moment the timer counts from (the deadline the tasks get is the same)."""
    cl = recipe.cluster
    world = cl.ntasks_per_node
    base_env = dict(os.environ)
    base_env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", max_connections(recipe))
    base_env.update({k: v for k, v in cl.env.items()})
    port = free_port()
    command = [*task_supervisor(recipe), *job_command(recipe, paths)]
    if cl.python == "python3":  # the interpreter megalaunch runs in
        command = [sys.executable if arg == cl.python else arg for arg in command]
    procs: list[subprocess.Popen[bytes]] = []
    start = time.monotonic()  # the timer counts from here, and the deadline the tasks get is the same moment
    base_env[DEADLINE_ENV] = f"{time.time() + cl.time_limit_s:.3f}"  # the signal window (runtime/stop/stop_window.py)
    with open(log_path, "ab") as log:
        for rank in range(world):
            env = dict(base_env, MEGALAUNCH_RUN_DIR=str(paths.root), MEGALAUNCH_JOB_ID=job_id,
                       RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
    return procs, start


@dataclass
class _JobStep:
    """One segment's tasks as Slurm treats a job step, checked once per poll: each method plays one of
    Slurm's behaviours, from the seconds `elapsed` since the tasks started."""

    procs: list[subprocess.Popen[bytes]]
    paths: RunPaths
    job_id: str
    echo: Callable[[str], None]
    limit: int
    lead: int
    stop_sig: signal.Signals
    hang: HangWatch
    signalled: bool = False  # the stop signal (or a cancel's SIGTERM) was sent
    killed: bool = False  # SIGKILL sent for a bad exit or a hang
    kill_at: float | None = None  # SIGTERM sent: SIGKILL at this time
    hang_kill_at: float | None = None  # stacks asked for: outcome hung and SIGKILL at this time

    def kill_on_bad_exit(self) -> None:
        """As `srun --kill-on-bad-exit=1`: one task failed, the others would wait for it forever."""
        if not self.killed and any(p.returncode not in (None, 0) for p in self.procs):
            bad = next(i for i, p in enumerate(self.procs) if p.returncode not in (None, 0))
            _send(self.procs, signal.SIGKILL)
            self.killed = True
            self.echo(f"segment {self.job_id}: task {bad} exited with status {self.procs[bad].returncode}; "
                      "killed the others")

    def cancel_if_requested(self, elapsed: float) -> None:
        """`megalaunch cancel` from another shell, as scancel: SIGTERM now, SIGKILL a grace period later, no save."""
        if self.kill_at is None and self.paths.cancel_requested.exists():
            _send(self.procs, signal.SIGTERM)
            self.kill_at, self.signalled = elapsed + KILL_WAIT_S, True
            self.echo(f"segment {self.job_id}: cancel requested, sent SIGTERM")

    def play_time_limit(self, elapsed: float) -> None:
        """The stop signal `lead` seconds before the limit, SIGTERM at it, SIGKILL a grace period later."""
        if not self.signalled and elapsed >= self.limit - self.lead:
            _send(self.procs, self.stop_sig)
            self.signalled = True
            self.echo(f"segment {self.job_id}: time-limit warning, sent {self.stop_sig.name}")
        if self.kill_at is None and elapsed >= self.limit:
            _send(self.procs, signal.SIGTERM)
            self.kill_at = self.limit + KILL_WAIT_S
            self.echo(f"segment {self.job_id}: time limit reached, sent SIGTERM")
            Ledger(self.paths).append("time_limit_reached", job_id=self.job_id)  # what ends it now is no node's fault
        if self.kill_at is not None and elapsed >= self.kill_at:
            _send(self.procs, signal.SIGKILL)

    def watch_for_hang(self, elapsed: float) -> None:
        """The hang watcher's decision (runtime/hangwatch.py): rank 0's heartbeat silent too long -> every
        task's stacks, then outcome hung and SIGKILL a little later."""
        if self.hang_kill_at is None and not self.killed:
            self.hang.observe(time.monotonic(), read_beat(self.paths.heartbeat(self.job_id)))
            if (change := self.hang.limit_change()) is not None:
                record_limits(self.paths, self.job_id, change)
            if self.hang.decide(time.monotonic(), "RUNNING") == "fire":
                reason = self.hang.reason(time.monotonic())
                _send(self.procs, STACKS_SIGNAL)  # faulthandler in each trainer dumps every thread's stack
                self.hang_kill_at = elapsed + STACKS_WAIT_S
                self.echo(f"segment {self.job_id}: HUNG: {reason}; asked every task for its stacks")
        elif self.hang_kill_at is not None and not self.killed and elapsed >= self.hang_kill_at:
            record_hang(self.paths, self.job_id, self.hang.reason(time.monotonic()), self.hang)
            _send(self.procs, signal.SIGKILL)
            self.killed = True
            self.echo(f"segment {self.job_id}: killed the hung tasks; outcome hung")


def _send(procs: list[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    """To every process of each live task, as Slurm signals every process of a job step."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)


EXIT_ERROR = 1  # the chain ended on an error: config_error, failed, hung, storage_full, the guard, a first stage
EXIT_STOPPED_UNSAVED = 3  # a person stopped it without a save: an abort trigger or `megalaunch cancel`


def exit_status(kind: StopKind | None, reason: str, needs_person: bool, last_outcome: str | None) -> int:
    """The waiting command's exit status for how the chain ended: 0 when it reached its target or an exit
    trigger saved and stopped it; EXIT_STOPPED_UNSAVED for an abort trigger or a cancel; EXIT_ERROR for
    anything that needs a person. `kind`: how `Chain.stop` stopped it, None when it stopped without
    (one segment only, auto-requeue off: then the segment's outcome decides)."""
    if kind == "finished":
        return 0
    if kind == "by_user":
        return 0 if reason.startswith("exit trigger") else EXIT_STOPPED_UNSAVED
    if kind is not None or needs_person:
        return EXIT_ERROR
    if last_outcome in ("finished", "saved", "exited"):
        return 0
    return EXIT_STOPPED_UNSAVED if last_outcome in ("aborted", "cancelled") else EXIT_ERROR


@dataclass(frozen=True)
class ChainEnd(Verdict):
    """The local chain's last verdict, with the exit status of the command that waited for it."""

    exit_code: int = 0


class _LocalChain(Chain):
    """The chain as everywhere, remembering how `stop` ended it (the kind that chain.notify gets)."""

    stop_kind: StopKind | None = None

    def stop(self, job_id: str | None, reason: str, *, fix: str | None = None,
             kind: StopKind = "needs_person") -> Verdict:
        self.stop_kind = kind
        return super().stop(job_id, reason, fix=fix, kind=kind)

    def ended(self, job_id: str, verdict: Verdict) -> ChainEnd:
        outcome = next((s.outcome for s in self.ledger.segments() if s.job_id == job_id), None)
        code = exit_status(self.stop_kind, verdict.reason, verdict.needs_person, outcome)
        return ChainEnd(verdict.proceed, verdict.reason, verdict.needs_person, exit_code=code)


def run_local_chain(paths: RunPaths, recipe: Recipe, chain_name: str,
                    echo: Callable[[str], None] = print) -> ChainEnd:
    old = os.umask(0o027)  # everything the segments write stays group-private, as under Slurm
    try:
        return _run_local_chain(paths, recipe, chain_name, echo)
    finally:
        os.umask(old)  # the caller's process (a test's, a notebook's) keeps its own


def _run_local_chain(paths: RunPaths, recipe: Recipe, chain_name: str, echo: Callable[[str], None]) -> ChainEnd:
    chain = _LocalChain(paths, LocalBackend(), RuntimeSettings.load(paths))
    n = sum(1 for s in chain.ledger.segments() if s.job_id.startswith("local-")) + 1
    while True:
        job_id = f"local-{n}"
        chain.ledger.append("submitted", job_id=job_id, by="local backend", pid=os.getpid())
        verdict = chain.begin(job_id)
        if not verdict.proceed:
            echo(f"chain stopped: {verdict.reason}")
            return chain.ended(job_id, verdict)
        lead = safe_plan(paths, chain.settings, echo)  # this segment's timer, from the saves measured so far
        if lead is not None and lead.raised:
            record_lead(chain.ledger, job_id, lead, echo)
        code = run_segment(paths, recipe, job_id, chain_name, echo, lead=lead.lead if lead is not None else None)
        start_eval_worker(paths, echo)
        verdict = chain.end(job_id, code)
        echo(f"segment {job_id} done (exit status {code}): {verdict.reason}")
        if not verdict.proceed:
            return chain.ended(job_id, verdict)
        n += 1


def start_eval_worker(paths: RunPaths, echo: Callable[[str], None] = print) -> int | None:
    """After a segment: the evals it queued run in a background worker (`megalaunch eval run-queued`:
    one at a time, nice 19, a session of its own), so the next segment starts at once and a failed
    eval touches nothing of the chain."""
    if not queued(paths):
        return None
    paths.evals.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(paths.evals / "local-worker.log", "ab") as log:
        p = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "megalaunch.cli.main", "eval", "run-queued",
                              str(paths.root)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
    echo(f"evals of iterations {queued(paths)} run in the background (pid {p.pid}): megalaunch eval status {paths.root}")
    return p.pid


def _started(paths: RunPaths, verdict: Verdict) -> Started:
    code = verdict.exit_code if isinstance(verdict, ChainEnd) else (EXIT_ERROR if verdict.needs_person else 0)
    return Started(paths, None, verdict.reason, exit_code=code)


class LocalBackend:
    """This machine: the chain runs in the foreground process, segment after segment."""

    name = "local"

    def start(self, prepared: PreparedRun, echo: Echo) -> Started:
        paths = write_run(prepared)
        register(paths.root)
        echo(f"run directory: {paths.root}")
        echo("running the chain on this machine (Ctrl-C stops it; `megalaunch resume` continues it)")
        return _started(paths, run_local_chain(paths, prepared.recipe, prepared.chain_name, echo=echo))

    def resume(self, paths: RunPaths, echo: Echo, from_iteration: int | None = None) -> Started:
        with contextlib.suppress(FileNotFoundError):
            paths.cancel_requested.unlink()
        Ledger(paths).append("chain_resumed", **resumed_event(from_iteration))
        return _started(paths, run_local_chain(paths, load_run_recipe(paths), paths.root.name, echo=echo))

    def cancel(self, paths: RunPaths, timeout_s: float = 60.0) -> list[str]:
        """Ask the chain's process to stop: it kills its running segment and starts no other."""
        running = [s for s in unfinished(Ledger(paths).segments()) if s.pid is not None and pid_alive(s.pid)]
        paths.cancel_requested.write_text(f"{getpass.getuser()} {time.time()}\n")
        deadline = time.monotonic() + timeout_s
        while any(pid_alive(s.pid) for s in running if s.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        for s in running:  # a chain process that did not stop in time
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                os.kill(s.pid, signal.SIGTERM)  # type: ignore[arg-type]
        targets = [s.job_id for s in running]
        record_cancel(paths, targets)
        return targets

    def live(self, segments: list[Segment]) -> tuple[dict[str, Live], str | None]:
        out = {}
        for s in unfinished(segments):
            if s.pid is not None and pid_alive(s.pid):
                out[s.job_id] = Live("RUNNING" if s.started else "PENDING")
        return out, None

    def submit_successor(self, paths: RunPaths, exclude: list[str] | None = None,
                         signal_lead_s: int | None = None) -> str | None:
        return None  # the chain's process runs the next segment itself (and sets its timer's lead)

    def known_nodes(self, partition: str | None) -> list[str] | None:
        return None  # one machine: nothing to exclude

    def exclude(self, job_ids: list[str], nodes: list[str]) -> None:
        return None

    def cancel_jobs(self, job_ids: list[str]) -> None:
        return None

    def state(self, job_id: str) -> str | None:
        return None

    def batch_host(self, job_id: str) -> str | None:
        return None
