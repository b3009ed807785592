"""The training entry: `python -m megalaunch.runtime.train RUN [--resume-from ITER]`.

One process per GPU (srun task, or the local backend's processes), with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment. It runs Megatron's own loop
(`megatron.training.pretrain`) on the arguments in RUN/megatron.args, a GPT/Llama model
(runtime/model.py) and GPTDataset over RUN/data_blend.txt (or Megatron's mock data; runtime/step.py),
and adds what the chain needs (docs/training.md):

- the stop signal and the trigger files folded into one decision per check, the same on every rank
  (`Session.decide`, one all-reduce MAX); every rank logs the iteration at which it acted;
- state/progress.json every log interval and state/outcome.json at exit, whatever happens;
- resume from the newest complete checkpoint, falling back to an older one (runtime/resume.py);
- retention of the last N checkpoints plus milestones; a data-blend check;
- one W&B run for the whole experiment (runtime/wandb_run.py); a hang watchdog (runtime/watchdog.py).

- the health check at segment start (runtime/health.py) and the per-rank step-time spread
  (runtime/stragglers.py).

Test hooks (environment; docs/training.md, "Tests"): MEGALAUNCH_LOSS_LOG, MEGALAUNCH_TEST_HANG,
MEGALAUNCH_TEST_STEP_SLEEP_S, MEGALAUNCH_TEST_SLOW_FORWARD (RANK:SECONDS, a sleep in that rank's forward
steps), MEGALAUNCH_TEST_SLOW_NODE and MEGALAUNCH_TEST_HEALTH_FAIL (runtime/health.py),
MEGALAUNCH_TEST_RENDEZVOUS_HANG."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from megalaunch.rundir.evals import pending_iterations
from megalaunch.rundir.files import append_jsonl
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.state import current_job_id, progress_at_save, write_outcome, write_progress
from megalaunch.rundir.triggers import Decision, TriggerBox, decide
from megalaunch.runtime import resume
from megalaunch.runtime.dist_env import export_rank_env
from megalaunch.runtime.failures import (
    ConfigFailure,
    Failure,
    check_kernels,
    classify,
    exit_failure,
    recipe_field_fix,
    resolve_attention,
)
from megalaunch.runtime.health import UnhealthyNode, node_name
from megalaunch.runtime.settings import RuntimeSettings
from megalaunch.runtime.signals import SignalFlag, resolve_signal
from megalaunch.runtime.step import megatron_argv, run_pretrain
from megalaunch.runtime.timeline import STARTUP_PHASES, Timeline

LOSS_LOG_ENV = "MEGALAUNCH_LOSS_LOG"
HANG_ENV = "MEGALAUNCH_TEST_HANG"
STEP_SLEEP_ENV = "MEGALAUNCH_TEST_STEP_SLEEP_S"
RENDEZVOUS_HANG_ENV = "MEGALAUNCH_TEST_RENDEZVOUS_HANG"
FAST_EXIT_ENV = "MEGALAUNCH_FAST_EXIT"
PROFILE_ENV = "MEGALAUNCH_PROFILE_STARTUP"
SLOW_FORWARD_ENV = "MEGALAUNCH_TEST_SLOW_FORWARD"


class Session:
    """One segment of training on one rank: the state the Megatron seams report into."""

    def __init__(self, paths: RunPaths, settings: RuntimeSettings, flag: SignalFlag, *,
                 rank: int, world: int, resume_from: int | None = None) -> None:
        self.paths = paths
        self.settings = settings
        self.flag = flag
        self.rank = rank
        self.world = world
        self.job_id = current_job_id()
        self.resume_from = resume_from
        self.iteration = 0
        self.steps = 0  # iterations run in this segment: a failure before the first is judged for config
        self.decision = Decision.CONTINUE
        self.decision_iteration: int | None = None
        self.resumed_from: int | None = None
        self.loss: float | None = None
        self.lr: float | None = None
        self.grad_norm: float | None = None
        self.save_times: list[float] = []
        self._save_started = 0.0
        self._save_started_at = 0.0
        self._window: tuple[float, int, float] | None = None  # (time, consumed samples, flops)
        self._saving_in_window = 0.0
        self._loss_log = os.environ.get(LOSS_LOG_ENV) if rank == 0 else None
        self._hang_at = _parse_hang(os.environ.get(HANG_ENV), rank)
        self._step_sleep_s = float(os.environ.get(STEP_SLEEP_ENV) or 0)
        self._slow_forward_s = _parse_slow_forward(os.environ.get(SLOW_FORWARD_ENV), rank)
        self.step_timer: Any = None  # stragglers.StepTimer, made when torch is imported
        self._forward_section: Any = None
        self.health: dict[str, Any] | None = None  # the health check's figures (runtime/health.py)
        self.stragglers: dict[str, Any] | None = None  # the latest step-time spread summary
        self.watchdog: Any = None
        self.wandb: Any = None
        self.evals: Any = None  # runtime/eval_queue.EvalQueue on rank 0 when evaluation is on
        self.profiler: StartupProfile | None = None
        self.timeline = Timeline(paths, self.job_id, write=rank == 0)
        self._wandb_started = False
        self.timeline.mark("runtime_start", world=world)

    # --- logging -------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        print(f"[megalaunch rank {self.rank}] {message}", flush=True)

    def ledger(self, event: str, **data: Any) -> None:
        if self.rank == 0:
            append_jsonl(self.paths.ledger, {"event": event, "time": time.time(), "job_id": self.job_id, **data})

    # --- hooks called from megatron_seams ---------------------------------------------------------
    def phase(self, name: str) -> None:
        self.timeline.mark(name)

    def distributed_ready(self) -> None:
        """torch.distributed is up, Megatron has not built anything yet: the health check (every rank)."""
        self.timeline.mark("distributed_ready")
        from megalaunch.runtime import stragglers

        if stragglers.nvrx_start():
            self.log("stragglers: nvidia-resiliency-ext's Detector is on")
        if not self.settings.health_check:
            return
        from megalaunch.runtime.health import Baselines, run_check

        s = self.settings
        baselines = Baselines(s.node_health_dir) if s.node_health_dir else None
        self.timeline.mark("health_check_start")
        if self.watchdog:
            self.watchdog.beat("health check started")
        verdict = run_check(rank=self.rank, margin=s.health_check_margin, baselines=baselines)
        self.health = verdict.summary()
        self.timeline.mark("health_check_end", health_check=self.health)
        if self.watchdog:
            self.watchdog.beat("health check done")
        mine = next(f for f in verdict.figures if f.rank == self.rank)
        tflops = "failed" if mine.error else f"{mine.tflops:.3g} TFLOP/s" if mine.tflops is not None else "no figure"
        gbps = f", all-reduce {mine.allreduce_gbps:.3g} GB/s" if mine.allreduce_gbps is not None else ""
        self.log(f"health check on {mine.node}: matmul {tflops}{gbps} in {mine.seconds:.1f} s; {verdict.reason}")
        self.ledger("health_check", **self.health)
        if not verdict.healthy:
            raise UnhealthyNode(verdict)
        if self.rank == 0 and baselines is not None and verdict.median_tflops is not None:
            try:  # only a healthy check's figure becomes the device's reference
                baselines.record(verdict.figures[0].device, verdict.median_tflops, run=s.run_name,
                                 job_id=self.job_id, nodes=sorted({f.node for f in verdict.figures}))
            except OSError as e:
                self.log(f"could not record the health check's figure in {baselines.file}: {e}")

    def forward_begin(self) -> None:
        if self.step_timer is not None:
            self.step_timer.forward_begin()
        from megalaunch.runtime.stragglers import nvrx_section

        self._forward_section = nvrx_section()
        self._forward_section.__enter__()
        if self._slow_forward_s > 0:  # test hook: this rank computes slower
            time.sleep(self._slow_forward_s)

    def forward_end(self) -> None:
        if self._forward_section is not None:
            self._forward_section.__exit__(None, None, None)
            self._forward_section = None
        if self.step_timer is not None:
            self.step_timer.forward_end()

    def gather_stragglers(self, at: str) -> None:
        """A collective at a point every rank reaches together (after a save, at the segment's end)."""
        if self.step_timer is None:
            return
        from megalaunch.runtime.stragglers import describe, gather

        try:
            summary = gather(self.step_timer, rank=self.rank, node=node_name(),
                             threshold=self.settings.straggler_threshold)
        except Exception as e:  # accounting must never take training down
            self.log(f"stragglers: no summary ({resume.one_line(e)})")
            return
        if summary is None:
            return
        self.stragglers = summary
        if self.rank == 0:
            self.ledger("stragglers", at=at, iteration=self.iteration, **summary)
            if summary["straggling"]:
                self.log(f"stragglers: {describe(summary)}")

    def decide(self, iteration: int) -> int:
        if iteration % max(1, self.settings.trigger_interval) != 0 and iteration < self.settings.train_iters:
            return Decision.CONTINUE
        import torch
        import torch.distributed as dist

        from megalaunch.runtime.megatron_seams import collective_device

        local = decide(TriggerBox(self.paths) if self.rank == 0 else None, self.flag.received)
        t = torch.tensor([int(local)], dtype=torch.int64, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def acted(self, decision: int, iteration: int) -> None:
        d = Decision(decision)
        self.decision = max(self.decision, d)
        self.decision_iteration = iteration
        if self.flag.received_at is not None:
            self.timeline.mark("signal_received", self.flag.received_at)
        if d != Decision.SAVE:
            self.timeline.mark("decision", decision=d.name.lower(), decision_iteration=iteration)
        what = {Decision.SAVE: "saved a checkpoint and continues", Decision.SIGNAL: "saved on the stop signal, exiting",
                Decision.EXIT: "saved on the exit trigger, exiting", Decision.ABORT: "aborting without a save"}[d]
        self.log(f"decision {d.name.lower()} at iteration {iteration}: {what}")
        if self.rank == 0:
            box = TriggerBox(self.paths)
            consumed = box.consume_for(d, iteration, self.job_id)
            if d == Decision.SIGNAL:  # the checkpoint just written also satisfies a pending `save`
                rec = box.consume("save", iteration, self.job_id)
                consumed += [rec] if rec else []
            self.ledger("decision", decision=d.name.lower(), iteration=iteration,
                        triggers=[c.get("verb") for c in consumed], signal=self.flag.received)

    def before_save(self, iteration: int) -> None:
        self._save_started = time.monotonic()
        self._save_started_at = time.time()
        self.timeline.save_started(iteration)
        if self.watchdog:
            self.watchdog.beat(f"save at iteration {iteration} started")

    def after_save(self, iteration: int) -> None:
        elapsed = time.monotonic() - self._save_started
        self.save_times.append(elapsed)
        self._saving_in_window += elapsed
        if self.watchdog:
            self.watchdog.beat(f"save at iteration {iteration} done")
        if self.rank == 0:
            self.log(f"checkpoint at iteration {iteration}: {elapsed:.2f} s blocking")
            progress_at_save(self.paths, iteration)  # status never shows progress behind the checkpoint
            protect = {self.resumed_from} if self.resumed_from else set()
            if self.evals is not None:
                try:
                    self.evals.after_save(iteration)
                except OSError as e:  # an eval never stops training
                    self.log(f"eval of iteration {iteration} not queued: {e}")
                protect |= pending_iterations(self.paths)  # an eval still to run keeps its checkpoint
            deleted = resume.prune(self.paths, keep_last=self.settings.keep_last,
                                   milestone_interval=self.settings.milestone_interval,
                                   protect=protect, job_id=self.job_id)
            if deleted:
                self.log(f"retention: deleted checkpoints {deleted}")
        # the save's interval on the timeline includes retention: deleting an old checkpoint blocks too
        self.timeline.save(iteration, self._save_started_at,
                           self._save_started_at + time.monotonic() - self._save_started)
        self.gather_stragglers("save")  # every rank saves at the same iteration

    def on_log(self, iteration: int, loss: Any, lr: Any, grad_norm: Any) -> None:
        """Every iteration; values are converted (a device sync for the loss) only when used."""
        if not (self._loss_log or iteration % self.settings.log_interval == 0):
            return
        from megalaunch.runtime.megatron_seams import as_float

        self.loss, self.lr, self.grad_norm = as_float(loss), as_float(lr), as_float(grad_norm)
        if self._loss_log and self.loss is not None:
            with open(self._loss_log, "a") as f:
                f.write(json.dumps({"iteration": iteration, "loss": self.loss}) + "\n")

    def on_iteration(self, iteration: int, flops_so_far: float) -> None:
        self.iteration = iteration
        self.steps += 1
        if self.step_timer is not None:
            self.step_timer.iteration()
        self.timeline.iteration(iteration, flush=iteration % self.settings.log_interval == 0)
        if self.steps == 1 and self.profiler is not None:
            self.profiler.dump(self.rank, self.job_id)
            self.profiler = None
        if self._step_sleep_s > 0:  # test hook: pace iterations (before the decision, like a slow step)
            time.sleep(self._step_sleep_s)
        if self.watchdog:
            self.watchdog.beat(f"iteration {iteration}")
        if self.rank == 0 and iteration % self.settings.log_interval == 0:
            self._report(iteration, flops_so_far)

    def choose_checkpoint(self) -> int | None:
        """Rank 0 plans (moving unusable checkpoints aside); every rank gets the same answer."""
        import torch
        import torch.distributed as dist

        from megalaunch.runtime.megatron_seams import collective_device

        self.timeline.mark("load_start")
        chosen, error = -1, None
        if self.rank == 0:
            try:
                plan = resume.plan_resume(self.paths, job_id=self.job_id, requested=self.resume_from)
                chosen = plan.iteration if plan.iteration is not None else -1
                for e in plan.events:
                    self.log(f"resume: {e['event']} {json.dumps({k: v for k, v in e.items() if k not in ('event', 'time', 'job_id')})}")
            except Exception as e:
                chosen, error = -2, e
        self.resume_from = None  # only for the first attempt
        t = torch.tensor([chosen], dtype=torch.int64, device=collective_device())
        if dist.is_initialized():
            dist.broadcast(t, 0)
        chosen = int(t.item())
        if chosen == -2:
            if error is not None and isinstance(error, ValueError):
                raise ConfigFailure(str(error), "megalaunch resume RUN --from one of the complete checkpoints, "
                                                "or plain megalaunch resume (the newest complete one)")
            raise RuntimeError(f"rank 0 could not choose a checkpoint: {error}" if error else
                               "rank 0 could not choose a checkpoint")
        self.resumed_from = chosen if chosen >= 0 else None
        return self.resumed_from

    def load_failed(self, iteration: int, error: BaseException) -> int | None:
        """A checkpoint passed the completeness check but failed to load: rank 0 moves it aside
        and points the tracker at the next older complete one, if any; every rank gets the same."""
        import traceback

        import torch
        import torch.distributed as dist

        from megalaunch.runtime.megatron_seams import collective_device

        traceback.print_exception(error)
        self.log(f"resume: checkpoint {iteration} failed to load ({resume.one_line(error)})")
        older = -1
        if self.rank == 0:
            found = resume.fall_back_from(self.paths, iteration, error, self.job_id)
            older = -1 if found is None else found
        t = torch.tensor([older], dtype=torch.int64, device=collective_device())
        if dist.is_initialized():
            dist.broadcast(t, 0)
        older = int(t.item())
        self.log(f"resume: falling back to checkpoint {older}" if older >= 0 else
                 "resume: no older complete checkpoint to fall back to")
        self.resumed_from = older if older >= 0 else None
        return self.resumed_from

    def loaded(self, iteration: int, consumed_samples: int) -> None:
        self.iteration = iteration
        self.timeline.mark("load_end", start_iteration=iteration)
        if self.settings.profile_window and iteration > 0:
            from megatron.training import get_args

            args = get_args()  # the rendered nsys window counts from the iteration resumed from
            args.profile_step_start += iteration
            args.profile_step_end += iteration
        if self.rank == 0:  # a fresh start for status: not the last segment's (maybe later) iteration
            write_progress(self.paths, iteration=iteration, consumed_samples=consumed_samples)
        if iteration > 0:
            self.log(f"resumed at iteration {iteration} with {consumed_samples} consumed samples")
            self.ledger("resumed", iteration=iteration, consumed_samples=consumed_samples)
        else:
            self.log("starting from scratch")
        self._window = None

    # --- progress ----------------------------------------------------------------------------------
    def _report(self, iteration: int, flops_so_far: float) -> None:
        from megatron.training import get_args

        args = get_args()
        now = time.monotonic()
        samples = int(args.consumed_train_samples)
        tokens_per_s = tflops = None
        if self._window is not None:
            t0, s0, f0 = self._window
            dt = max(now - t0 - self._saving_in_window, 1e-9)
            tokens_per_s = (samples - s0) * args.seq_length / dt
            tflops = (flops_so_far - f0) / dt / self.world / 1e12
        self._window = (now, samples, flops_so_far)
        self._saving_in_window = 0.0
        write_progress(self.paths, iteration=iteration, consumed_samples=samples, loss=self.loss,
                       tokens_per_s=tokens_per_s, tflops_per_gpu=tflops, lr=self.lr, grad_norm=self.grad_norm,
                       train_iters=self.settings.train_iters)
        try:
            append_jsonl(self.paths.metrics, {
                "job_id": self.job_id, "iteration": iteration, "time": time.time(), "loss": self.loss,
                "lr": self.lr, "grad_norm": self.grad_norm, "tokens_per_s": tokens_per_s,
                "tflops_per_gpu": tflops, "consumed_samples": samples})
        except OSError as e:
            self.log(f"could not append to {self.paths.metrics}: {e}")
        if self.wandb is not None:
            extra: dict[str, Any] = {}
            if not self._wandb_started:
                self._wandb_started = True
                try:
                    extra = self._wandb_segment_start()
                except Exception as e:  # accounting must never take training down
                    self.log(f"W&B: no segment summary ({resume.one_line(e)})")
            self.wandb.log(iteration, {"loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
                                       "tokens_per_s": tokens_per_s, "tflops_per_gpu": tflops,
                                       "consumed_samples": samples, **extra})

    def _wandb_segment_start(self) -> dict[str, Any]:
        """At a segment's first log step: its start-up phases, and the chain's goodput up to the
        previous segment (state/goodput.json, written by `job end`)."""
        from megalaunch.rundir.files import read_json

        ph = self.timeline.data["phases"]
        # the trainer does not know `job begin`: no launch; the first iteration is added
        cuts = [*STARTUP_PHASES[1:], ("first_iteration", "first_iteration_end")]
        out: dict[str, Any] = {"segment/index": self._segment_index()}
        for (_, a), (name, b) in zip([("", "process_start"), *cuts[:-1]], cuts, strict=True):
            if a in ph and b in ph:
                out[f"segment/{name}_s"] = ph[b] - ph[a]
        if "process_start" in ph and "first_iteration_end" in ph:
            out["segment/startup_s"] = ph["first_iteration_end"] - ph["process_start"]
        chain = read_json(self.paths.goodput)
        if isinstance(chain, dict) and chain.get("goodput") is not None:
            out["chain/goodput"] = chain["goodput"]
            out["chain/wall_s"] = chain.get("wall_s")
            out.update({f"chain/{k}_s": v for k, v in (chain.get("totals_s") or {}).items()})
        return out

    def _segment_index(self) -> int | None:
        """This segment's number as `status`, `logs --segment` and `report` show it."""
        from megalaunch.rundir.ledger import Ledger, segment_numbers

        return segment_numbers(Ledger(self.paths).segments()).get(str(self.job_id))

    def maybe_hang(self) -> None:
        """Test hook: stop making progress inside iteration MEGALAUNCH_TEST_HANG."""
        if self._hang_at is not None and self.iteration + 1 == self._hang_at:
            self.log(f"test hook: hanging in iteration {self._hang_at}")
            while True:
                time.sleep(3600)

    # --- the verdict ---------------------------------------------------------------------------------
    def verdict(self, exited_early: bool) -> tuple[str, str | None]:
        if self.decision == Decision.ABORT:
            return "aborted", f"abort trigger at iteration {self.decision_iteration}"
        if self.iteration >= self.settings.train_iters:
            return "finished", None
        if self.decision == Decision.EXIT:
            return "exited", f"exit trigger at iteration {self.decision_iteration}"
        if self.decision == Decision.SIGNAL:
            return "saved", f"{self.settings.stop_signal} at iteration {self.decision_iteration}"
        how = "exited" if exited_early else "returned"
        return "failed", f"Megatron {how} at iteration {self.iteration} before train_iters {self.settings.train_iters}"


def _parse_slow_forward(text: str | None, rank: int) -> float:
    if not text:
        return 0.0
    slow_rank, _, seconds = text.partition(":")
    return float(seconds or 0.1) if int(slow_rank) == rank else 0.0


def _parse_hang(text: str | None, rank: int) -> int | None:
    if not text:
        return None
    iteration, _, hang_rank = text.partition(":")
    return int(iteration) if int(hang_rank or 0) == rank else None


# --- the entry ---------------------------------------------------------------------------------------

def _setup(session: Session) -> tuple[list[str], str]:
    """Everything before Megatron starts: blend check, CPU mode, seams, W&B."""
    paths, rank, settings = session.paths, session.rank, session.settings
    try:
        resume.check_blend(paths, allow_change=settings.allow_blend_change, write=rank == 0, job_id=session.job_id)
    except resume.BlendChanged as e:
        raise ConfigFailure(str(e)) from e
    if settings.cpu:  # the recipe asked for no GPU: hide any there is (before torch initialises CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    session.timeline.mark("torch_imported")
    from megalaunch.runtime.stragglers import StepTimer

    session.step_timer = StepTimer(cuda=not settings.cpu and torch.cuda.is_available())

    if settings.cpu or not torch.cuda.is_available():
        from megalaunch.runtime import cpu_compat

        cpu_compat.enable()
        session.log("no GPU: running on the CPU (gloo, cpu_compat)")
    argv = megatron_argv(paths)
    cpu = settings.cpu or not torch.cuda.is_available()
    attention, why = resolve_attention(settings.attention, argv, cpu=cpu)
    session.log(f"attention: {attention} ({why})")
    session.ledger("attention", requested=settings.attention, chosen=attention, why=why)
    for note in check_kernels(argv, attention):  # a missing library: config_error, now
        session.log(note)
        session.ledger("kernel", note=note)
    from megalaunch.runtime import megatron_seams

    megatron_seams.install(session)
    session.timeline.mark("megatron_imported")
    if rank == 0 and settings.wandb_project:
        _open_wandb(session)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not settings.cpu else None
    session.timeline.mark("setup_done", gpu=gpu, attention=attention)
    _maybe_skip_rendezvous(session)
    return argv, attention


def _maybe_skip_rendezvous(session: Session) -> None:
    """Test hook MEGALAUNCH_TEST_RENDEZVOUS_HANG=RANK: that rank never joins torch.distributed's
    rendezvous, so the others wait in it forever, in the first segment that sees the hook only (a
    marker under state/ remembers it)."""
    text = os.environ.get(RENDEZVOUS_HANG_ENV)
    if not text or int(text) != session.rank:
        return
    marker = session.paths.state / "test-rendezvous-hang"
    if marker.exists():
        return
    marker.write_text(f"{session.job_id}\n")
    session.log("test hook: never joining the rendezvous")
    while True:
        time.sleep(3600)


def _open_wandb(session: Session) -> None:
    import yaml

    from megalaunch.runtime.wandb_run import WandbRun, offline_by_default

    s = session.settings
    mode = s.wandb_mode
    if mode == "online" and offline_by_default():
        session.log("W&B: no WANDB_API_KEY in the environment, logging offline")
        mode = "offline"
    session.wandb = WandbRun.open(session.paths, project=str(s.wandb_project), entity=s.wandb_entity, mode=mode,
                                  name=s.run_name, config=yaml.safe_load(session.paths.run_yaml.read_text()),
                                  job_id=session.job_id)
    session.log(f"W&B run {session.wandb.run_id} ({mode})")


def main(argv: list[str] | None = None) -> int:
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
    settings = RuntimeSettings.load(paths)
    # First thing after knowing which signal: before the handler exists, SIGUSR2 would kill us.
    flag = SignalFlag(resolve_signal(settings.stop_signal))
    env = export_rank_env()  # Megatron reads RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address
    rank, world = env.rank, env.world_size
    os.environ["MEGALAUNCH_RUN_DIR"] = str(paths.root)
    # No environment variable for this: a successor submitted from inside the job would inherit it
    # and resume from the same iteration again. `megalaunch resume RUN --from ITER` writes a
    # one-shot request instead (rundir/resume_request.py).
    resume_from = opts.resume_from if opts.resume_from is not None else -1
    session = Session(paths, settings, flag, rank=rank, world=world, resume_from=None if resume_from < 0 else resume_from)
    session.profiler = profiler
    if rank == 0 and settings.eval_interval > 0:
        from megalaunch.runtime.eval_queue import EvalQueue

        session.evals = EvalQueue(paths, interval=settings.eval_interval, submit=settings.eval_submit,
                                  job_id=session.job_id, log=session.log)
    return run_session(session)


class StartupProfile:
    """MEGALAUNCH_PROFILE_STARTUP=DIR: cProfile every rank from its entry to the end of its first
    iteration and write DIR/startup-<job>-rank<N>.prof (pstats) and .txt (top functions by cumulative
    time). For finding where start-up goes (bench/goodput.py --profile); off by default."""

    def __init__(self, out: Path) -> None:
        import cProfile

        self.out = out
        self.profile = cProfile.Profile()
        self.profile.enable()

    @classmethod
    def start(cls) -> StartupProfile | None:
        out = os.environ.get(PROFILE_ENV)
        return cls(Path(out)) if out else None

    def dump(self, rank: int, job_id: str | None) -> None:
        import io
        import pstats

        self.profile.disable()
        stem = self.out / f"startup-{job_id or 'nojob'}-rank{rank}"
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self.profile.dump_stats(f"{stem}.prof")
            text = io.StringIO()
            pstats.Stats(self.profile, stream=text).sort_stats("cumulative").print_stats(60)
            Path(f"{stem}.txt").write_text(text.getvalue())
        except OSError as e:
            print(f"[megalaunch rank {rank}] start-up profile not written: {e}", flush=True)


def run_session(session: Session) -> int:
    from megalaunch.runtime.watchdog import Watchdog

    paths = session.paths

    def on_hang(reason: str) -> None:
        if session.rank == 0:
            write_outcome(paths, "hung", iteration=session.iteration, reason=reason)
            session.ledger("hung", iteration=session.iteration, reason=reason)

    session.watchdog = Watchdog(paths.debug, rank=session.rank, job_id=session.job_id,
                                timeout_s=session.settings.hang_timeout_s, on_hang=on_hang,
                                ).start(stacks_file=paths.step_stacks(session.job_id or "nojob", session.rank))
    status, code = "failed", 1
    reason: str | None = "did not start"
    failure: Failure | None = None
    try:
        argv, attention = _setup(session)
        run_pretrain(argv, attention=attention, session=session)
        (status, reason), code = session.verdict(exited_early=False), 0
        session.gather_stragglers("end")
    except SystemExit as e:  # Megatron leaves its loop with sys.exit() after a signal or trigger
        if e.code in (0, None):
            (status, reason), code = session.verdict(exited_early=True), 0
            session.gather_stragglers("end")  # every rank left at the same decision
        else:
            failure = exit_failure(e.code, started=session.steps > 0)
    except UnhealthyNode as e:  # every rank took the same decision: no training, a clean exit
        status, reason, code = "unhealthy_node", str(e), 0
    except BaseException as e:
        if not isinstance(e, ConfigFailure):
            import traceback

            traceback.print_exc()
        failure = classify(e, started=session.steps > 0)
    finally:
        session.watchdog.stop()
    fix: str | None = None
    if failure is not None:
        status, reason, fix, code = ("config_error" if failure.config else "failed"), failure.reason, failure.fix, 1
        if failure.config and fix is None:
            fix = _fix_from_recipe(paths, reason)
            failure = Failure(True, reason, fix)
        _record_rank_error(session, failure)
    if status == "failed" and code == 0:
        code = 1
    if status == "failed" and (hang := session.watchdog.hang_reported()):
        # Another rank's watchdog fired and exited; this rank's collective then failed.
        from megalaunch.runtime.watchdog import EXIT_HUNG

        status, reason, code = "hung", hang, EXIT_HUNG
    if status == "config_error":
        session.log(f"configuration error: no retry can fix this: {reason}" + (f"; fix: {fix}" if fix else ""))
    if session.flag.received_at is not None:
        session.timeline.mark("signal_received", session.flag.received_at)
    session.timeline.mark("exit", outcome=status)
    session.log(f"outcome {status}" + (f": {reason}" if reason else "") + f" (iteration {session.iteration})")
    if session.rank == 0:
        figures: dict[str, Any] = {name: value for name, value in (("health_check", session.health),
                                                                   ("stragglers", session.stragglers)) if value}
        write_outcome(paths, status, iteration=session.iteration, reason=reason, fix=fix,
                      kind="config" if status == "config_error" else None, resumed_from=session.resumed_from,
                      save_times_s=[round(t, 3) for t in session.save_times], **figures)
    if session.evals is not None:
        session.evals.join()
    if session.wandb is not None:
        session.wandb.summarize({"segment/outcome": status, "segment/job_id": session.job_id,
                                 "segment/save_blocking_s": round(sum(session.save_times), 3),
                                 "segment/last_iteration": session.iteration})
        session.wandb.finish(exit_code=code)
    if not fast_exit():
        _shutdown()
    return code


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


def _record_rank_error(session: Session, failure: Failure) -> None:
    """Every failing rank leaves its error next to its task record: when another rank's exit gets
    this one killed (srun --kill-on-bad-exit), rank 0's outcome may never be written."""
    from megalaunch.rundir.files import atomic_write_json

    if session.job_id is None:
        return
    try:
        path = session.paths.task_error(session.job_id, session.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"rank": session.rank, "config": failure.config, "reason": failure.reason,
                                 "fix": failure.fix, "iteration": session.iteration, "steps": session.steps,
                                 "time": time.time()})
    except OSError as e:
        session.log(f"could not record this rank's error: {e}")


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
