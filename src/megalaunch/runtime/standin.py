"""A stand-in for the trainer, for tests of the many-node machinery (issue 33): with
MEGALAUNCH_TEST_STAND_IN=1 (a recipe sets it through `cluster.env`), `python -m megalaunch.runtime.train
RUN` runs this instead of Megatron, so the rendered job script, `job begin/step-nodes/step-end/end/watch`,
spare nodes, exclusion and restarts run on an emulated cluster of 32-64 nodes. It imports neither torch
nor Megatron (both are made unimportable: a reused function that would import them fails at once).

Every boundary the chain reads is the trainer's own code: the settings, the stop signal's flag, the rank
environment, the `Session` and its rooms (decisions and triggers, the checkpoint choice and fallback,
retention, the space check before a save, the signal window, timeline, heartbeat, the health check's
judgement and records, the test hooks of runtime/rank/fault_hooks.py), the watchdog, the outcome. Not the
trainer's: the process group (runtime/standin_group.py: the runtime's collectives and the health check's
measurement run over it, and each iteration has its own, so a dead peer fails every rank within one); an
iteration (a sleep of MEGALAUNCH_TEST_STEP_SLEEP_S, default 0.5 s, and Megatron's log line); a checkpoint
(`iter_NNNNNNN/`: a tiny shard per rank, `.metadata` listing them, a pickle of standard-library objects, and
`metadata.json`, then the tracker, atomically: complete for runtime/checkpoint/completeness.py); the health
check's figure (a constant, divided by MEGALAUNCH_TEST_SLOW_NODE's factor). Not emulated: stragglers, W&B,
evaluations, the read-ahead, asynchronous saves, Megatron's learning-rate schedule."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
import traceback
import types
from datetime import datetime
from pathlib import Path
from typing import Any

from megalaunch.rundir.files import append_jsonl, atomic_write_json, atomic_write_text, read_args_file
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import write_outcome, write_progress
from megalaunch.rundir.triggers import Decision
from megalaunch.runtime.checkpoint import resume
from megalaunch.runtime.health.hang_limit import configured_s
from megalaunch.runtime.health.health import UnhealthyNode, node_name
from megalaunch.runtime.health.watchdog import EXIT_HUNG, Watchdog, backstop_after_s
from megalaunch.runtime.rank.dist_env import export_rank_env
from megalaunch.runtime.rank.failures import ConfigFailure, classify, record_rank_error
from megalaunch.runtime.rank.fault_hooks import STEP_SLEEP_ENV, maybe_skip_rendezvous
from megalaunch.runtime.rank.hooks import SaveKind
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.rank.storage import STORAGE_FIX, SaveDoesNotFit
from megalaunch.runtime.session import Session
from megalaunch.runtime.standin_group import DEVICE, Group, install
from megalaunch.runtime.stop.decisions import at_boundary
from megalaunch.runtime.stop.signals import SignalFlag, resolve_signal

METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1, "megalaunch_stand_in": True}


def _arg(argv: list[str], flag: str, default: float) -> float:
    try:
        return float(argv[argv.index(flag) + 1])
    except (ValueError, IndexError):
        return default


def _now() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def _loss(iteration: int) -> float:
    return 2.0 + 9.0 * 0.98**iteration  # a function of the iteration: a resumed run's losses equal an uninterrupted one's


class StandIn:
    """One rank of a segment, driving the trainer's Session as Megatron's loop and the seams do."""

    def __init__(self, paths: RunPaths, settings: RuntimeSettings, flag: SignalFlag, resume_from: int | None) -> None:
        env = export_rank_env()
        self.settings, self.flag, self.addr, self.port = settings, flag, env.master_addr, env.master_port
        self.session = Session(paths, settings, flag, rank=env.rank, world=env.world_size, resume_from=resume_from)
        self.ctx = self.session.ctx
        hang = configured_s(settings.hang_timeout_s)  # a silent peer: the watchdog acts first, as on the real trainer
        self.group = Group(env.rank, env.world_size, backstop_after_s(hang) + 30 if hang > 0 else 1800.0)
        try:
            self.argv = read_args_file(paths.megatron_args)
        except OSError:
            self.argv = []
        self.batch = int(_arg(self.argv, "--global-batch-size", 1))
        self.seq, self.lr = int(_arg(self.argv, "--seq-length", 1)), _arg(self.argv, "--lr", 1e-4)
        self.step_s = float(os.environ.get(STEP_SLEEP_ENV) or 0.5)
        self.consumed, self.saved_at, self.window = 0, -1, (time.monotonic(), 0)
        self.watchdog: Watchdog | None = None

    def run(self) -> int:
        ctx, session, s = self.ctx, self.session, self.settings

        def on_hang(reason: str) -> None:
            if ctx.is_zero:
                write_outcome(ctx.paths, "hung", iteration=session.iteration, reason=reason)
                ctx.ledger("hung", iteration=session.iteration, reason=reason)

        self.watchdog = session.observe.watchdog = Watchdog(
            ctx.paths.debug, rank=ctx.rank, job_id=ctx.job_id, timeout_s=s.hang_timeout_s, on_hang=on_hang,
            save_estimate_s=s.save_time_estimate_s).start(stacks_file=ctx.paths.step_stacks(ctx.job_id or "nojob", ctx.rank))
        reason: str | None = "did not start"
        status, fix, code, figures = "failed", None, 1, {}
        try:
            self._start()
            self._load()
            (status, reason), code = session.verdict(exited_early=self._loop()), 0
        except UnhealthyNode as e:  # every rank took the same decision: a clean exit
            status, reason, code = "unhealthy_node", str(e), 0
        except SaveDoesNotFit as e:
            status, reason, fix, code = "storage_full", f"storage full: {e.reason}", STORAGE_FIX, 0
        except BaseException as e:
            status, reason, fix = self._failed(e)
        finally:
            self.watchdog.stop()
        code = 1 if status == "failed" else code
        if status == "failed" and (hang := self.watchdog.hang_reported()):
            status, reason, code = "hung", hang, EXIT_HUNG
        if status == "storage_full" and ctx.is_zero:
            try:
                figures = session.checkpoints.ended_full()  # the unfinished save removed first
                figures.pop("where", None)
            except OSError as e:
                ctx.log(f"storage full: the figures could not be gathered: {e}")
        return self._conclude(status, reason, fix, code, figures)

    def _failed(self, error: BaseException) -> tuple[str, str, str | None]:
        """As the trainer's: the failure classified, recorded next to this rank's task record."""
        if not isinstance(error, ConfigFailure):
            traceback.print_exc()
        failure = classify(error, started=self.session.observe.steps > 0)
        record_rank_error(self.ctx, failure, iteration=self.session.iteration, steps=self.session.observe.steps)
        return ("config_error" if failure.config else "storage_full" if failure.storage else "failed",
                failure.reason, failure.fix)

    def _start(self) -> None:
        """The trainer's set-up, Megatron's initialisation: blend check, rendezvous, health check."""
        ctx, session, s = self.ctx, self.session, self.settings
        try:
            resume.check_blend(ctx.paths, allow_change=s.allow_blend_change, write=ctx.is_zero, job_id=ctx.job_id)
        except resume.BlendChanged as e:
            raise ConfigFailure(str(e)) from e
        if ctx.is_zero:
            print("------------------------ arguments ------------------------\n  " + " ".join(self.argv)
                  + "\n-------------------- end of arguments ---------------------", flush=True)
        session.observe.timeline.mark("setup_done", gpu=None, attention=DEVICE, kernels=DEVICE)
        maybe_skip_rendezvous(ctx)  # test hook: that rank never joins
        began = time.monotonic()
        step = f"{ctx.job_id}.{os.environ.get('MEGALAUNCH_STEP', 0)}"  # a rank of another job or step is turned away
        self.group.join(self.addr, self.port, host=node_name(), job=step, within_s=configured_s(s.startup_timeout_s))
        install(self.group)
        if ctx.is_zero:
            ctx.log(f"stand-in trainer ({DEVICE}, no Megatron): {ctx.world} rank(s) on "
                    f"{len(set(self.group.hosts))} node(s) joined in {time.monotonic() - began:.1f} s")
        session.distributed_ready()  # the timeline's phase and the health check
        session.phase("first_collective")

    def _load(self) -> None:
        """Megatron's model build and checkpoint load, through the seam's choice and fallback."""
        session, ctx = self.session, self.ctx
        session.phase("model_build_start")
        session.phase("model_build_end")
        chosen = session.choose_checkpoint()
        for attempt in (1, 2):
            error: BaseException | None = None
            try:
                iteration, self.consumed = _read_checkpoint(ctx.paths, chosen)
            except Exception as e:
                error = e
            if not self.group.any_rank(error is not None):
                if ctx.is_zero and chosen is not None:
                    print(f"  successfully loaded checkpoint from {ctx.paths.checkpoints} [ t 1/1, p 1/1 ] "
                          f"at iteration {iteration}", flush=True)
                session.loaded(iteration, self.consumed)
                session.phase("data_start")
                session.phase("data_end")
                self.window = (time.monotonic(), iteration)
                return
            failure = error or RuntimeError(f"loading checkpoint {chosen} failed on another rank")
            older = session.load_failed(chosen, failure) if chosen is not None and attempt == 1 else None
            if older is None:
                raise failure
            chosen = older

    def _loop(self) -> bool:
        """Megatron's training loop; True when it left early (a decision), False at train_iters."""
        session, s = self.session, self.settings
        while session.iteration < s.train_iters:
            session.maybe_hang()  # test hook
            session.forward_begin()
            time.sleep(self.step_s)
            session.forward_end()
            self.group.all_reduce_max(int(self.flag.received))  # the step's collective: the gradients' all-reduce
            iteration = session.iteration + 1
            self.consumed += self.batch
            session.on_log(iteration, _loss(iteration), self.lr, None)
            session.observe.iteration_ended(iteration)
            self._report(iteration)
            session.observe.beat(f"iteration {iteration}")
            if self._boundary(Decision(session.decide(iteration)), iteration):
                return True
        if session.observe.steps and s.save_interval and session.iteration % s.save_interval:
            self._save(session.iteration, "final")  # Megatron's save after its loop
        return False

    def _boundary(self, decision: Decision, iteration: int) -> bool:
        """runtime/loop/megatron_seams.py's checkpoint_and_decide_exit around Megatron's own."""
        session, interval = self.session, self.settings.save_interval
        step = at_boundary(decision, iteration, interval)
        if step.abort:
            session.acted(decision, iteration)
            return True
        if step.save_now:
            self._save(iteration, step.save_kind)
        if step.leave or (interval and iteration % interval == 0):
            self._save(iteration, step.save_kind)
        if decision != Decision.CONTINUE:
            session.acted(decision, iteration)
        if step.leave or self.saved_at != iteration:
            return step.leave
        again = Decision(session.decide(iteration, force=True))  # a stop that came during the save leaves with it
        if again != Decision.CONTINUE:
            session.acted(again, iteration, after_save=True)
        return again >= Decision.SIGNAL

    def _save(self, iteration: int, kind: SaveKind) -> None:
        """One checkpoint, every rank its shard; rank 0 the metadata, then the tracker (atomically)."""
        session, ctx, paths = self.session, self.ctx, self.ctx.paths
        if not session.before_save(iteration, kind):  # the space check, the signal window, the save's start
            return
        if ctx.is_zero:
            print(f"[{_now()}] saving checkpoint at iteration {iteration:7d} to {paths.checkpoints} in torch_dist "
                  "format", flush=True)
        directory = resume.iter_dir(paths, iteration)
        directory.mkdir(parents=True, exist_ok=True)
        shard = json.dumps({"iteration": iteration, "consumed_samples": self.consumed, "rank": ctx.rank,
                            "world": ctx.world}).encode()
        (directory / f"__{ctx.rank}_0.distcp").write_bytes(shard)
        sizes = self.group.exchange("gather", len(shard))  # every shard written: torch_dist's coordinator waits so
        if ctx.is_zero:
            items = {r: types.SimpleNamespace(relative_path=f"__{r}_0.distcp", offset=0, length=int(n))
                     for r, n in enumerate(sizes)}
            (directory / ".metadata").write_bytes(pickle.dumps(types.SimpleNamespace(storage_data=items)))
            atomic_write_json(directory / "metadata.json", METADATA)
            atomic_write_text(paths.tracker, f"{iteration}\n")
            print(f"  [{_now()}] successfully saved checkpoint from iteration {iteration:7d} to {paths.checkpoints} "
                  "[ t 1/1, p 1/1 ]", flush=True)
        self.group.all_reduce_max(0)  # Megatron's barrier after the tracker
        self.saved_at = iteration
        session.after_save(iteration, complete=True)

    def _report(self, iteration: int) -> None:
        """Every log interval: Megatron's line (its last rank), progress and metrics (rank 0)."""
        ctx, s, observe = self.ctx, self.settings, self.session.observe
        if iteration % max(1, s.log_interval):
            return
        (t0, i0), now = self.window, time.monotonic()
        self.window, per_iteration = (now, iteration), (now - t0) / max(1, iteration - i0)
        tokens_per_s = self.batch * self.seq / max(per_iteration, 1e-9)
        if ctx.rank == ctx.world - 1:
            print(f" [{_now()}] iteration {iteration:8d}/{s.train_iters:8d} | consumed samples: {self.consumed:12d} | "
                  f"elapsed time per iteration (ms): {per_iteration * 1e3:.1f} | learning rate: {self.lr:.6E} | "
                  f"global batch size: {self.batch:5d} | lm loss: {_loss(iteration):.6E} | loss scale: 1.0 | "
                  "number of skipped iterations:   0 | number of nan iterations:   0 |", flush=True)
        if not ctx.is_zero:
            return
        write_progress(ctx.paths, iteration=iteration, consumed_samples=self.consumed, loss=observe.loss,
                       tokens_per_s=tokens_per_s, tflops_per_gpu=None, lr=observe.lr, grad_norm=None,
                       train_iters=s.train_iters)
        try:
            append_jsonl(ctx.paths.metrics, {"job_id": ctx.job_id, "iteration": iteration, "time": time.time(),
                                             "loss": observe.loss, "lr": observe.lr, "grad_norm": None,
                                             "tokens_per_s": tokens_per_s, "tflops_per_gpu": None,
                                             "consumed_samples": self.consumed})
        except OSError as e:
            ctx.log(f"could not append to {ctx.paths.metrics}: {e}")

    def _conclude(self, status: str, reason: str | None, fix: str | None, code: int, figures: dict[str, Any]) -> int:
        """As the trainer's: the log line, the timeline's exit, outcome.json (rank 0)."""
        ctx, session, checkpoints = self.ctx, self.session, self.session.checkpoints
        if status == "config_error":
            ctx.log(f"configuration error: no retry can fix this: {reason}" + (f"; fix: {fix}" if fix else ""))
        session.decisions.mark_signal()
        session.observe.timeline.mark("exit", outcome=status)
        ctx.log(f"outcome {status}" + (f": {reason}" if reason else "") + f" (iteration {session.iteration})")
        if ctx.is_zero:
            try:
                write_outcome(ctx.paths, status, iteration=session.iteration, reason=reason, fix=fix,
                              kind="config" if status == "config_error" else None,
                              resumed_from=checkpoints.resumed_from,
                              save_times_s=[round(t, 3) for t in checkpoints.save_times],
                              **session.observe.figures(), **figures)
            except OSError as e:
                ctx.log(f"outcome not written: {e}")
        return code


def _read_checkpoint(paths: RunPaths, iteration: int | None) -> tuple[int, int]:
    """(iteration, consumed samples) of a stand-in checkpoint; (0, 0) from scratch."""
    if iteration is None:
        return 0, 0
    state = json.loads((resume.iter_dir(paths, iteration) / "__0_0.distcp").read_bytes())
    if state.get("iteration") != iteration:
        raise ValueError(f"checkpoint {iteration} holds iteration {state.get('iteration')}")
    return iteration, int(state["consumed_samples"])


def main(argv: list[str] | None = None) -> int:
    """`python -m megalaunch.runtime.train RUN [--resume-from ITER]` with MEGALAUNCH_TEST_STAND_IN=1."""
    for name in ("torch", "megatron"):  # what the trainer's code would import for them fails at once
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser(prog="python -m megalaunch.runtime.train",
                                     description="The stand-in trainer (MEGALAUNCH_TEST_STAND_IN=1).")
    parser.add_argument("run_dir", nargs="?", default=os.environ.get("MEGALAUNCH_RUN_DIR"))
    parser.add_argument("--resume-from", type=int, default=None)
    opts = parser.parse_args(argv)
    if not opts.run_dir:
        parser.error("give the run directory (or set MEGALAUNCH_RUN_DIR)")
    paths = RunPaths(Path(opts.run_dir).absolute())
    settings = RuntimeSettings.load(paths)
    flag = SignalFlag(resolve_signal(settings.stop_signal))  # first thing after knowing which signal
    os.environ["MEGALAUNCH_RUN_DIR"] = str(paths.root)
    resume_from = opts.resume_from if opts.resume_from is not None and opts.resume_from >= 0 else None
    return StandIn(paths, settings, flag, resume_from).run()


if __name__ == "__main__":
    sys.exit(main())
