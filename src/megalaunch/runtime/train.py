"""The training entry: `python -m megalaunch.runtime.train RUN [--resume-from ITER]`.

One process per GPU (srun task, or the local backend's processes), with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment. It runs Megatron's own loop
(`megatron.training.pretrain`) on the arguments in RUN/megatron.args, a GPT/Llama model
(runtime/model/model.py) and GPTDataset over RUN/data_blend.txt (or Megatron's mock data; runtime/loop/step.py),
and adds what the chain needs (docs/training.md) through a `Session` (runtime/session.py) of rooms:

- decisions (runtime/stop/decisions.py): the stop signal and the trigger files folded into one decision per
  check, the same on every rank (one all-reduce MAX); every rank logs the iteration at which it acted;
- checkpoints (runtime/checkpoint/checkpoints.py): resume from the newest complete checkpoint, falling back to an
  older one (runtime/checkpoint/resume.py); the hooks around every save; retention of the last N plus milestones;
- observation (runtime/observation/observe.py): state/progress.json every log interval, the timeline and heartbeat,
  the health check at segment start (runtime/health/health.py), the per-rank step-time spread
  (runtime/health/stragglers.py), one W&B run for the whole experiment (runtime/observation/wandb_run.py).

This module does the rest: the data-blend check, the set-up before Megatron starts, the hang watchdog
(runtime/health/watchdog.py), and state/outcome.json at exit, whatever happens.

Test hooks (environment; docs/training.md, "Tests"): MEGALAUNCH_TEST_STAND_IN=1 (runtime/standin.py: a
stand-in without torch or Megatron, for many-node tests), MEGALAUNCH_LOSS_LOG (runtime/observation/observe.py),
MEGALAUNCH_TEST_HANG, MEGALAUNCH_TEST_STEP_SLEEP_S, MEGALAUNCH_TEST_SLOW_FORWARD, MEGALAUNCH_TEST_RENDEZVOUS_HANG
(runtime/rank/fault_hooks.py), MEGALAUNCH_TEST_SLOW_NODE and MEGALAUNCH_TEST_HEALTH_FAIL (runtime/health/health.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import write_outcome
from megalaunch.runtime.checkpoint import resume
from megalaunch.runtime.health.health import UnhealthyNode
from megalaunch.runtime.loop.step import megatron_argv, run_pretrain
from megalaunch.runtime.model import wgrad_fusion
from megalaunch.runtime.model.fp8 import Fp8Choice, node_fp8
from megalaunch.runtime.model.kernels import KernelChoice, node_kernels
from megalaunch.runtime.observation.startup_profile import StartupProfile
from megalaunch.runtime.rank.dist_env import export_rank_env
from megalaunch.runtime.rank.failures import (
    ConfigFailure,
    Failure,
    check_kernels,
    classify,
    exit_failure,
    recipe_field_fix,
    record_rank_error,
    resolve_attention,
)
from megalaunch.runtime.rank.fault_hooks import maybe_skip_rendezvous
from megalaunch.runtime.rank.settings import RuntimeSettings
from megalaunch.runtime.rank.storage import STORAGE_FIX, SaveDoesNotFit
from megalaunch.runtime.session import Session
from megalaunch.runtime.stop.signals import SignalFlag, resolve_signal

FAST_EXIT_ENV = "MEGALAUNCH_FAST_EXIT"
STAND_IN_ENV = "MEGALAUNCH_TEST_STAND_IN"


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(STAND_IN_ENV) == "1":  # test hook, first: nothing heavy is imported yet (runtime/standin.py)
        from megalaunch.runtime.standin import main as stand_in
        return stand_in(argv)
    parser = argparse.ArgumentParser(prog="python -m megalaunch.runtime.train",
                                     description="Train with Megatron's loop inside a megalaunch run directory.")
    parser.add_argument("run_dir", nargs="?", default=os.environ.get("MEGALAUNCH_RUN_DIR"))
    parser.add_argument("--resume-from", type=int, default=None,
                        help="resume from this checkpoint iteration instead of the newest (newer ones are moved aside)")
    opts = parser.parse_args(argv)
    if not opts.run_dir:
        parser.error("give the run directory (or set MEGALAUNCH_RUN_DIR)")
    profiler = StartupProfile.start()
    paths = RunPaths(Path(opts.run_dir).absolute())
    from megalaunch.runtime.bytecode import enable_cache

    bytecode = enable_cache(paths.state / "pycache")  # before torch and Megatron are imported
    settings = RuntimeSettings.load(paths)
    # First thing after knowing which signal: before the handler exists, SIGUSR2 would kill us.
    flag = SignalFlag(resolve_signal(settings.stop_signal))
    env = export_rank_env()  # Megatron reads RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address
    rank, world = env.rank, env.world_size
    os.environ["MEGALAUNCH_RUN_DIR"] = str(paths.root)
    # No environment variable for this: a successor submitted from inside the job would inherit it
    # and resume from the same iteration again. `megalaunch resume RUN --from ITER` writes a
    # one-shot request instead (rundir/resume_request.py).
    resume_from = opts.resume_from if opts.resume_from is not None and opts.resume_from >= 0 else None
    session = Session(paths, settings, flag, rank=rank, world=world, resume_from=resume_from)
    session.observe.profiler = profiler
    _start_readahead(session, env.local_rank, resume_from)
    if bytecode and rank == 0:
        session.ctx.log(bytecode)
    if rank == 0 and settings.eval_interval > 0:
        from megalaunch.runtime.observation.eval_queue import EvalQueue

        session.checkpoints.evals = EvalQueue(paths, interval=settings.eval_interval, submit=settings.eval_submit,
                                              job_id=session.ctx.job_id, log=session.ctx.log)
    return run_session(session, settings)


def _start_readahead(session: Session, local_rank: int, resume_from: int | None) -> None:
    """The checkpoint this segment will likely load, read into the page cache while Python imports
    (runtime/checkpoint/readahead.py); its figures are logged once the load is done (Session.loaded)."""
    from megalaunch.runtime.checkpoint import readahead

    paths = session.ctx.paths
    iteration = resume_from if resume_from is not None else paths.read_tracker()
    nodes = int(os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES") or 1)
    try:
        reader, why = readahead.start(resume.iter_dir(paths, iteration) if iteration is not None else None,
                                      local_rank=local_rank, nodes=nodes)
    except OSError as e:  # never a reason not to train
        reader, why = None, f"not started: {e}"
    session.readahead = reader
    if reader is not None or local_rank == 0:
        session.ctx.log(f"checkpoint read-ahead: {why}")


def _setup(session: Session, settings: RuntimeSettings) -> tuple[list[str], str, KernelChoice, Fp8Choice]:
    """Everything before Megatron starts: blend check, CPU mode, seams, W&B."""
    ctx, observe = session.ctx, session.observe
    try:
        resume.check_blend(ctx.paths, allow_change=settings.allow_blend_change, write=ctx.is_zero, job_id=ctx.job_id)
    except resume.BlendChanged as e:
        raise ConfigFailure(str(e)) from e
    if settings.cpu:  # the recipe asked for no GPU: hide any there is (before torch initialises CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if settings.cpu or not torch.cuda.is_available():
        torch.set_flush_denormal(True)  # before Megatron's import starts torch's worker threads, which copy it
    observe.phase("torch_imported")
    from megalaunch.runtime.health.stragglers import StepTimer

    observe.step_timer = StepTimer(cuda=not settings.cpu and torch.cuda.is_available())
    cpu = settings.cpu or not torch.cuda.is_available()
    if cpu:
        from megalaunch.runtime.model import cpu_compat

        cpu_compat.enable()
        ctx.log("no GPU: running on the CPU (gloo, cpu_compat)")
    argv = megatron_argv(ctx.paths)
    attention, why = resolve_attention(settings.attention, argv, cpu=cpu)
    ctx.log(f"attention: {attention} ({why})")
    ctx.ledger("attention", requested=settings.attention, chosen=attention, why=why)
    for note in check_kernels(argv, attention):  # a missing library: config_error, now
        ctx.log(note)
        ctx.ledger("kernel", note=note)
    kernels = node_kernels(settings.kernels, argv, cpu=cpu, flow=settings.flow, paths=ctx.paths,
                           fits_with=settings.fits_with)  # no library, or none the layout's fit needs: config_error
    if kernels.wgrad_on:
        argv = wgrad_fusion.enable(argv)
    ctx.log(f"kernels: {kernels.library} ({kernels.why})" + "".join(
        f"; {op}: Megatron's ({why})" for op, why in kernels.fallbacks.items() if kernels.library == "liger")
        + (f"; gradient-accumulation fusion {kernels.wgrad_fusion}" if kernels.wgrad_fusion else ""))
    ctx.ledger("kernels", **kernels.ledger())
    fp8 = node_fp8(settings.fp8, argv, cpu=cpu)  # asked for and impossible here: config_error, now
    if fp8.recipe is not None:
        ctx.log(f"fp8: {fp8.recipe} through {fp8.path} ({fp8.why})")
        ctx.ledger("fp8", **fp8.ledger())
    from megalaunch.runtime.loop import megatron_seams

    megatron_seams.install(session)
    from megalaunch.runtime.loop import parallel_load, save_staging

    ctx.log(f"checkpoint staging: {save_staging.install(settings.checkpoint_bytes, ctx.world, settings.tasks_per_node)}"
            f"; checkpoint load: {parallel_load.install()}")
    observe.phase("megatron_imported")
    if ctx.is_zero and settings.wandb_project:
        observe.open_wandb()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not settings.cpu else None
    observe.timeline.mark("setup_done", gpu=gpu, attention=attention, kernels=kernels.library)
    maybe_skip_rendezvous(ctx)
    return argv, attention, kernels, fp8


def _fp8_report(session: Session) -> Any:
    """What the model provider tells of the FP8 layers: a log line and the ledger's `fp8_layers`."""
    ctx = session.ctx

    def report(done: list[str], kept: dict[str, str]) -> None:
        ctx.log(f"fp8: {len(done)} linear layers take FP8 GEMMs" + "".join(f"; {k}: {v}" for k, v in kept.items()))
        ctx.ledger("fp8_layers", fp8=len(done), kept=kept)

    return report


@dataclass
class Ending:
    """How the segment ended on this rank, before it is written down."""

    status: str = "failed"
    reason: str | None = "did not start"
    code: int = 1
    failure: Failure | None = None
    fix: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)  # storage_full: filesystem, free and needed bytes


def run_session(session: Session, settings: RuntimeSettings) -> int:
    from megalaunch.runtime.health.watchdog import Watchdog

    ctx = session.ctx

    def on_hang(reason: str) -> None:
        if ctx.is_zero:
            write_outcome(ctx.paths, "hung", iteration=session.iteration, reason=reason)
            ctx.ledger("hung", iteration=session.iteration, reason=reason)

    session.observe.watchdog = Watchdog(ctx.paths.debug, rank=ctx.rank, job_id=ctx.job_id,
                                        timeout_s=settings.hang_timeout_s, on_hang=on_hang,
                                        save_estimate_s=settings.save_time_estimate_s,
                                        ).start(stacks_file=ctx.paths.step_stacks(ctx.job_id or "nojob", ctx.rank))
    try:
        end = _train(session, settings)
    finally:
        session.observe.watchdog.stop()
    return _conclude(session, _judge(session, end))


def _train(session: Session, settings: RuntimeSettings) -> Ending:
    """Set up, run Megatron's loop, and tell how it ended: whatever it raises becomes the Ending."""
    end = Ending()
    try:
        argv, attention, kernels, fp8 = _setup(session, settings)
        run_pretrain(argv, attention=attention, session=session, data_format=settings.data_format,
                     flow=settings.flow, liger_ops=kernels.liger_ops, fp8=fp8 if fp8.ours else None,
                     on_fp8=_fp8_report(session), experts=kernels.experts, post_training=settings.post_training)
        (end.status, end.reason), end.code = session.verdict(exited_early=False), 0
        session.observe.gather_stragglers("end")
    except SystemExit as e:  # Megatron leaves its loop with sys.exit() after a signal or trigger
        if e.code in (0, None):
            (end.status, end.reason), end.code = session.verdict(exited_early=True), 0
            session.observe.gather_stragglers("end")  # every rank left at the same decision
        else:
            end.failure = exit_failure(e.code, started=session.observe.steps > 0)
    except UnhealthyNode as e:  # every rank took the same decision: no training, a clean exit
        end.status, end.reason, end.code = "unhealthy_node", str(e), 0
    except SaveDoesNotFit as e:  # every rank: the stop save was not started (the check before it)
        end.status, end.reason, end.fix, end.code = "storage_full", f"storage full: {e.reason}", STORAGE_FIX, 0
    except BaseException as e:
        if not isinstance(e, ConfigFailure):
            import traceback

            traceback.print_exc()
        end.failure = classify(e, started=session.observe.steps > 0)
    return end


def _judge(session: Session, end: Ending) -> Ending:
    """A failure's status, reason and fix (recorded next to this rank's task); a hang reported by
    another rank's watchdog wins over the failed collective it left behind."""
    failure = end.failure
    if failure is not None:
        status = "config_error" if failure.config else "storage_full" if failure.storage else "failed"
        end.status, end.reason, end.fix, end.code = status, failure.reason, failure.fix, 1
        if failure.config and end.fix is None:
            end.fix = _fix_from_recipe(session.ctx.paths, failure.reason)
            failure = end.failure = Failure(True, failure.reason, end.fix)
        record_rank_error(session.ctx, failure, iteration=session.iteration, steps=session.observe.steps)
    if end.status == "failed" and end.code == 0:
        end.code = 1
    if end.status == "failed" and (hang := session.observe.watchdog.hang_reported()):
        # Another rank's watchdog fired and exited; this rank's collective then failed.
        from megalaunch.runtime.health.watchdog import EXIT_HUNG

        end.status, end.reason, end.code = "hung", hang, EXIT_HUNG
    if end.status == "storage_full" and session.ctx.is_zero:
        try:
            end.figures = session.checkpoints.ended_full()  # the unfinished save removed first
        except OSError as e:
            session.ctx.log(f"storage full: the figures could not be gathered: {e}")
        where = end.figures.pop("where", None)
        if failure is not None and where:  # a save failed on the disk: what the disk says now
            end.reason = f"{end.reason}; now {where}"
    return end


def _conclude(session: Session, end: Ending) -> int:
    """Say how the segment ended: log line, timeline, outcome.json (rank 0), W&B; then leave."""
    ctx, observe, checkpoints = session.ctx, session.observe, session.checkpoints
    status, reason, fix = end.status, end.reason, end.fix
    if status == "config_error":
        ctx.log(f"configuration error: no retry can fix this: {reason}" + (f"; fix: {fix}" if fix else ""))
    session.decisions.mark_signal()
    observe.timeline.mark("exit", outcome=status)
    ctx.log(f"outcome {status}" + (f": {reason}" if reason else "") + f" (iteration {session.iteration})")
    if ctx.is_zero:
        try:
            write_outcome(ctx.paths, status, iteration=session.iteration, reason=reason, fix=fix,
                          kind="config" if status == "config_error" else None, resumed_from=checkpoints.resumed_from,
                          save_times_s=[round(t, 3) for t in checkpoints.save_times], **observe.figures(),
                          **end.figures)
        except OSError as e:  # a full filesystem: `job end` finds the evidence without the outcome
            ctx.log(f"outcome not written: {e}")
    if checkpoints.evals is not None:
        checkpoints.evals.join()
    observe.close_wandb(status, end.code, checkpoints.save_times, reason=reason, figures=end.figures)
    if not fast_exit():
        _shutdown()
    return end.code


def fast_exit() -> bool:
    """Leave as soon as the outcome is written (on by default; MEGALAUNCH_FAST_EXIT=0: Python's
    own teardown, for the before/after benchmark). Nothing is lost by skipping the teardown: the
    checkpoint is complete (an asynchronous save is finalised before Megatron returns), the outcome,
    timeline and W&B are written, and the task supervisor reaps whatever is left (data-loader workers,
    the checkpoint writer). What is skipped is the process-group teardown, data-loader joins and
    the interpreter's shutdown, which cost seconds of allocated GPU time per segment (docs/goodput.md)."""
    return os.environ.get(FAST_EXIT_ENV, "1") != "0"


def leave(code: int) -> None:
    """Flush what this process printed and exit at once (os._exit skips atexit and finalizers)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _fix_from_recipe(paths: RunPaths, reason: str) -> str | None:
    import yaml

    try:
        recipe = yaml.safe_load(paths.run_yaml.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return recipe_field_fix(reason, recipe) if isinstance(recipe, dict) else None


def _shutdown() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    exit_code = main()
    if fast_exit():
        leave(exit_code)
    sys.exit(exit_code)
