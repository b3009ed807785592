"""The observation room: everything a segment reports about itself, none of which may take training
down (docs/goodput.md, docs/training.md).

- the timeline (runtime/observation/timeline.py, with rank 0's heartbeat) and the hang watchdog's beats;
- the loss, learning rate, grad norm and a flow's own metrics of each log step, state/progress.json and
  state/metrics.jsonl (rank 0), with tokens/s and TFLOP/s per GPU measured between log steps, saves left out;
- the health check at segment start (runtime/health/health.py) and the per-rank step-time spread
  (runtime/health/stragglers.py);
- one W&B run for the whole experiment (runtime/observation/wandb_run.py), its segment's start-up and the chain's goodput.
Test hook: MEGALAUNCH_LOSS_LOG (rank 0 appends every iteration's loss to that file)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from megalaunch.rundir.files import append_jsonl
from megalaunch.rundir.state import write_progress
from megalaunch.runtime.checkpoint.resume import one_line
from megalaunch.runtime.health.health import UnhealthyNode, node_name
from megalaunch.runtime.observation.moe_balance import summary, wandb_figures
from megalaunch.runtime.observation.rank_output import SLOW_MARK
from megalaunch.runtime.observation.timeline import Timeline
from megalaunch.runtime.observation.warm_imports import WarmImports, imported_since, record, recorded
from megalaunch.runtime.rank.context import RankContext

LOSS_LOG_ENV = "MEGALAUNCH_LOSS_LOG"


@dataclass(frozen=True, kw_only=True)
class ObserveConfig:
    train_iters: int
    """Shown with the progress (status: how far along)."""
    log_interval: int = 10
    """Progress, metrics and W&B every this many iterations."""
    profile_window: bool = False
    """--profile-step-start/end count from the iteration resumed from (the nsys window)."""
    health_check: bool = False
    health_check_margin: float = 0.2
    node_health_dir: str | None = None
    """Where the health check's figures per device are kept (None: no baselines)."""
    straggler_threshold: float = 0.1
    run_name: str = "run"
    wandb_project: str | None = None  # None: no W&B
    sequences_per_sample: int = 1  # a DPO sample is a pair: tokens/s and TFLOP/s count both sequences
    wandb_entity: str | None = None
    wandb_mode: str = "online"


def as_float(value: Any) -> float | None:
    """A loss, learning rate or norm from Megatron (tensor, number or None) as a float."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class Observer:
    """One rank's reports. Rank 0 writes the files; every rank takes part in the collectives."""

    def __init__(self, ctx: RankContext, config: ObserveConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.iteration = 0
        self.steps = 0  # iterations run in this segment: a failure before the first is judged for config
        self.loss: float | None = None
        self.lr: float | None = None
        self.grad_norm: float | None = None
        self.flow_metrics: dict[str, float] = {}  # a flow's own metrics at the last log step (rewards, KL, ...)
        self.timeline = Timeline(ctx.paths, ctx.job_id, write=ctx.is_zero)
        self.watchdog: Any = None  # runtime/watchdog.Watchdog, from the entry
        self.wandb: Any = None  # runtime/wandb_run.WandbRun on rank 0 when W&B is on
        self.profiler: Any = None  # runtime/startup_profile.StartupProfile, dumped after the first iteration
        self.step_timer: Any = None  # stragglers.StepTimer, made when torch is imported
        self.health: dict[str, Any] | None = None  # the health check's figures (runtime/health/health.py)
        self.stragglers: dict[str, Any] | None = None  # the latest step-time spread summary
        self.moe: Any = None  # observation/moe_load.MoeLoad on an MoE run (from distributed_ready)
        self._said_slow = False  # this rank printed SLOW_MARK (its held output goes to the log from then on)
        self._forward_section: Any = None
        self._window: tuple[float, int, float] | None = None  # (time, consumed samples, flops)
        self._save_begun: dict[int, float] = {}  # iteration -> wall-clock start of its save, until complete
        self._save_blocking: dict[int, float] = {}  # iteration -> the save's blocking seconds
        self._saving_in_window = 0.0
        self._wandb_started = False
        self._loss_log = os.environ.get(LOSS_LOG_ENV) if ctx.is_zero else None
        self._modules_before: set[str] | None = None  # sys.modules at distributed_ready (warm_imports.py)
        self.timeline.mark("runtime_start", world=ctx.world)

    def phase(self, name: str) -> None:
        self.timeline.mark(name)

    def beat(self, what: str) -> None:
        self.timeline.hang = self.watchdog.beat(what) if self.watchdog else None  # its limits: rank 0's heartbeat

    # --- start-up: the health check ---------------------------------------------------------------------
    def distributed_ready(self) -> None:
        """torch.distributed is up, Megatron has not built anything yet: the health check (every rank)."""
        self.timeline.mark("distributed_ready")
        self._modules_before = set(sys.modules)
        from megalaunch.runtime.health import stragglers
        from megalaunch.runtime.observation.moe_load import start

        self.moe = start(self.ctx, self.config.log_interval)  # MoE: the routers' load, counted from here on

        if stragglers.nvrx_start():
            self.ctx.log("stragglers: nvidia-resiliency-ext's Detector is on")
        if self.config.health_check:
            self._health_check()

    def _health_check(self) -> None:
        from megalaunch.runtime.health.health import Baselines, run_check

        c, ctx = self.config, self.ctx
        baselines = Baselines(c.node_health_dir) if c.node_health_dir else None
        self.timeline.mark("health_check_start")
        self.beat("health check started")
        warm = WarmImports(recorded(ctx.paths.state))  # what Megatron imports next, while the GPU works
        try:
            verdict = run_check(rank=ctx.rank, margin=c.health_check_margin, baselines=baselines,
                                while_busy=warm.start)
        finally:
            warmed = warm.stop()
        self.health = verdict.summary()
        self.timeline.mark("health_check_end", health_check=self.health, warm_imports=warmed)
        self.beat("health check done")
        mine = next(f for f in verdict.figures if f.rank == ctx.rank)
        tflops = "failed" if mine.error else f"{mine.tflops:.3g} TFLOP/s" if mine.tflops is not None else "no figure"
        gbps = f", all-reduce {mine.allreduce_gbps:.3g} GB/s" if mine.allreduce_gbps is not None else ""
        ctx.log(f"health check on {mine.node}: matmul {tflops}{gbps} in {mine.seconds:.1f} s; {verdict.reason}")
        ctx.ledger("health_check", **self.health)
        if not verdict.healthy:
            raise UnhealthyNode(verdict)
        if ctx.is_zero and baselines is not None and verdict.median_tflops is not None:
            try:  # only a healthy check's figure becomes the device's reference
                baselines.record(verdict.figures[0].device, verdict.median_tflops, run=c.run_name,
                                 job_id=ctx.job_id, nodes=sorted({f.node for f in verdict.figures}))
            except OSError as e:
                ctx.log(f"could not record the health check's figure in {baselines.file}: {e}")

    # --- every step ------------------------------------------------------------------------------------
    def forward_begin(self) -> None:
        if self.step_timer is not None:
            self.step_timer.forward_begin()
        from megalaunch.runtime.health.stragglers import nvrx_section

        self._forward_section = nvrx_section()
        self._forward_section.__enter__()

    def forward_end(self) -> None:
        if self._forward_section is not None:
            self._forward_section.__exit__(None, None, None)
            self._forward_section = None
        if self.step_timer is not None:
            self.step_timer.forward_end()

    def on_log(self, iteration: int, loss: Any, lr: Any, grad_norm: Any, extra: dict[str, Any] | None = None) -> None:
        """Every iteration; values are converted (a device sync) only when used; `extra`: a flow's metrics."""
        if not (self._loss_log or iteration % self.config.log_interval == 0):
            return
        self.loss, self.lr, self.grad_norm, self.flow_metrics = as_float(loss), as_float(lr), as_float(grad_norm), {
            k: f for k, f in ((k, as_float(v)) for k, v in (extra or {}).items()) if f is not None}
        if self._loss_log and self.loss is not None:
            with open(self._loss_log, "a") as f:
                f.write(json.dumps({"iteration": iteration, "loss": self.loss, "metrics": self.flow_metrics}) + "\n")

    def iteration_ended(self, iteration: int) -> None:
        """Megatron finished `iteration` (before its decision): the timeline; the profile after the first."""
        self.iteration = iteration
        self.steps += 1
        if self.step_timer is not None:
            self.step_timer.iteration()
        self.timeline.iteration(iteration, flush=iteration % self.config.log_interval == 0)
        if self.steps == 1 and self.ctx.is_zero and self._modules_before is not None:
            self._record_modules(self._modules_before)
        if self.steps == 1 and self.profiler is not None:
            self.profiler.dump(self.ctx.rank, self.ctx.job_id)
            self.profiler = None

    def _record_modules(self, before: set[str]) -> None:
        self._modules_before = None
        try:
            record(self.ctx.paths.state, imported_since(before))
        except OSError as e:  # a faster start-up next time, never a reason to stop
            self.ctx.log(f"start-up module list not written: {one_line(e)}")

    def report(self, iteration: int, flops_so_far: float) -> None:
        """The watchdog's beat; on rank 0 every log interval, progress, metrics and W&B."""
        self.beat(f"iteration {iteration}")
        moe = self.moe.collect(iteration) if self.moe is not None else None  # every rank: one all-reduce
        if self.ctx.is_zero and iteration % self.config.log_interval == 0:
            self._report(iteration, flops_so_far, moe)

    def gather_stragglers(self, at: str) -> None:
        """A collective at a point every rank reaches together (after a save, at the segment's end)."""
        if self.step_timer is None:
            return
        from megalaunch.runtime.health.stragglers import describe, gather

        try:
            summary = gather(self.step_timer, rank=self.ctx.rank, node=node_name(),
                             threshold=self.config.straggler_threshold)
        except Exception as e:  # accounting must never take training down
            self.ctx.log(f"stragglers: no summary ({one_line(e)})")
            return
        if summary is None:
            return
        self.stragglers = summary
        mine, median = self.step_timer.stats().get("mean_s"), summary.get("median_step_s")
        if (not self.ctx.is_zero and not self._said_slow and isinstance(mine, (int, float)) and median
                and (mine - median) / median > self.config.straggler_threshold):
            self._said_slow = True  # the task supervisor passes this rank's output to the log from here on
            print(f"{SLOW_MARK} rank {self.ctx.rank} on {node_name()}: {mine:.3g} s forward/step, "
                  f"{(mine - median) / median:.0%} above the median {median:.3g} s", flush=True)
        if self.ctx.is_zero:
            self.ctx.ledger("stragglers", at=at, iteration=self.iteration, **summary)
            if summary["straggling"]:
                self.ctx.log(f"stragglers: {describe(summary)}")

    # --- load and save ---------------------------------------------------------------------------------
    def loaded(self, iteration: int, consumed_samples: int) -> None:
        self.iteration = iteration
        self.timeline.mark("load_end", start_iteration=iteration)
        if self.config.profile_window and iteration > 0:
            from megatron.training import get_args

            args = get_args()  # the rendered nsys window counts from the iteration resumed from
            args.profile_step_start += iteration
            args.profile_step_end += iteration
        if self.ctx.is_zero:  # a fresh start for status: not the last segment's (maybe later) iteration
            write_progress(self.ctx.paths, iteration=iteration, consumed_samples=consumed_samples)
        self._window = None

    def save_started(self, iteration: int) -> None:
        self._save_begun[iteration] = time.time()
        self.timeline.save_started(iteration)
        self.beat(f"save at iteration {iteration} started")

    def save_finished(self, iteration: int, elapsed: float) -> None:
        self._saving_in_window += elapsed  # throughput leaves the time spent saving out
        self._save_blocking[iteration] = elapsed
        self.beat(f"save at iteration {iteration} done")

    def save_blocking_s(self, iteration: int) -> float:
        return self._save_blocking.get(iteration, 0.0)

    def save_written(self, iteration: int) -> None:
        """The checkpoint of `iteration` is complete on disk (an asynchronous one: when Megatron
        finalized it): from the save's start until now on the timeline's `writes`, which the chain
        reads for the next segments' signal lead (launcher/prepare/signal_lead.py)."""
        begun = self._save_begun.pop(iteration, None)
        self._save_blocking.pop(iteration, None)
        if begun is not None:
            self.timeline.write(iteration, begun, time.time())
        self.beat(f"checkpoint of iteration {iteration} written")  # the watchdog's save limit ends here

    def evaluation(self, what: str) -> None:
        """Megatron's evaluation during training (runtime/loop/eval_seam.py): "started", "batch", "done"."""
        self.timeline.evaluation(what)
        self.beat(f"evaluation {what}")

    def save_waited(self, iteration: int, begin: float, end: float) -> None:
        """The segment waited for the asynchronous save of `iteration` to complete: save time."""
        self._saving_in_window += end - begin
        self.timeline.save_waited(iteration, begin, end)
        self.beat(f"waited for the save at iteration {iteration}")

    def save_recorded(self, iteration: int, span: tuple[float, float]) -> None:
        """After retention: the save's interval on the timeline; the step-time spread (every rank
        saves at the same iteration)."""
        self.timeline.save(iteration, *span)
        self.gather_stragglers("save")

    # --- progress, metrics, W&B ----------------------------------------------------------------------------
    def _report(self, iteration: int, flops_so_far: float, moe: dict[str, Any] | None = None) -> None:
        from megatron.training import get_args

        args = get_args()
        now = time.monotonic()
        samples = int(args.consumed_train_samples)
        tokens_per_s = tflops = None
        if self._window is not None:
            t0, s0, f0 = self._window
            dt = max(now - t0 - self._saving_in_window, 1e-9)
            tokens_per_s = (samples - s0) * args.seq_length * self.config.sequences_per_sample / dt
            tflops = (flops_so_far - f0) * self.config.sequences_per_sample / dt / self.ctx.world / 1e12
        self._window = (now, samples, flops_so_far)
        self._saving_in_window, paths, flow = 0.0, self.ctx.paths, {"flow": self.flow_metrics} if self.flow_metrics else {}
        write_progress(paths, iteration=iteration, consumed_samples=samples, loss=self.loss,
                       tokens_per_s=tokens_per_s, tflops_per_gpu=tflops, lr=self.lr, grad_norm=self.grad_norm,
                       train_iters=self.config.train_iters, **({"moe": summary(moe)} if moe else {}), **flow)
        metrics = {"loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm, "tokens_per_s": tokens_per_s,
                   "tflops_per_gpu": tflops, "consumed_samples": samples, **flow}
        try:
            append_jsonl(paths.metrics, {"job_id": self.ctx.job_id, "iteration": iteration, "time": time.time(),
                                         **metrics})
        except OSError as e:
            self.ctx.log(f"could not append to {paths.metrics}: {e}")
        if self.wandb is not None:
            self._log_wandb(iteration, {**metrics, **wandb_figures(moe)} if moe else metrics)

    def _log_wandb(self, iteration: int, metrics: dict[str, Any]) -> None:
        extra: dict[str, Any] = {}
        if not self._wandb_started:
            self._wandb_started = True
            from megalaunch.runtime.observation.wandb_run import segment_start

            try:
                extra = segment_start(self.ctx.paths, self.timeline.data["phases"], self.ctx.job_id)
            except Exception as e:  # accounting must never take training down
                self.ctx.log(f"W&B: no segment summary ({one_line(e)})")
        self.wandb.log(iteration, {**metrics, **extra})

    def open_wandb(self) -> None:
        """Rank 0, when the recipe names a W&B project: the experiment's run, continued."""
        import yaml

        from megalaunch.runtime.observation.wandb_run import WandbRun, offline_by_default

        c, ctx = self.config, self.ctx
        mode = c.wandb_mode
        if mode == "online" and offline_by_default():
            ctx.log("W&B: no WANDB_API_KEY in the environment, logging offline")
            mode = "offline"
        self.wandb = WandbRun.open(ctx.paths, project=str(c.wandb_project), entity=c.wandb_entity, mode=mode,
                                   name=c.run_name, config=yaml.safe_load(ctx.paths.run_yaml.read_text()),
                                   job_id=ctx.job_id)
        ctx.log(f"W&B run {self.wandb.run_id} ({mode})")

    # --- the end -----------------------------------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        """The health check's and the step-time spread's figures, for the outcome."""
        return {name: value for name, value in (("health_check", self.health), ("stragglers", self.stragglers))
                if value}

    def close_wandb(self, status: str, code: int, save_times: list[float], *, reason: str | None = None,
                    figures: dict[str, Any] | None = None) -> None:
        """The segment's outcome in the run's summary (`figures`: storage_full's filesystem, free, needed)."""
        if self.wandb is None:
            return
        self.wandb.summarize({"segment/outcome": status, "segment/job_id": self.ctx.job_id,
                              "segment/save_blocking_s": round(sum(save_times), 3),
                              "segment/last_iteration": self.iteration, "segment/reason": reason,
                              **{f"segment/storage/{k}": v for k, v in (figures or {}).items()}})
        self.wandb.finish(exit_code=code)
