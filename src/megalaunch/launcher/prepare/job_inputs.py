"""What the training job is given, decided at render time: the command every task runs under its
supervisor (in the job script, or started by the local backend), the settings the trainer reads from
RUN/runtime.json (`runtime_settings`), and the context of the job script (templates/train.sbatch.j2)."""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from megalaunch import __version__
from megalaunch.config.planner.checkpoint_size import recipe_checkpoint_bytes
from megalaunch.config.preflight import check_period_s, eval_interval, signal_lead_s
from megalaunch.config.schema import Recipe
from megalaunch.config.tokenizer import TokenizerSpec
from megalaunch.config.topology import node_counts
from megalaunch.config.training.reference_plan import job_reference
from megalaunch.config.training.teacher_plan import job_teacher
from megalaunch.launcher.prepare.sbatch import JobHeader, cluster_options, environment_context, home
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.settings import RuntimeSettings


def job_command(recipe: Recipe, paths: RunPaths) -> list[str]:
    """What each task runs: Megatron training, or the recipe's `workload` ({run_dir} is substituted)."""
    if recipe.workload:
        return [arg.replace("{run_dir}", str(paths.root)) for arg in recipe.workload]
    return [home(recipe.cluster.python), "-m", "megalaunch.runtime.train", str(paths.root)]


def task_supervisor(recipe: Recipe) -> list[str]:
    """The per-task supervisor every rank starts under (runtime/task.py): it keeps the stop signal
    from the trainer's child processes, kills what a dying rank leaves behind, records each rank's exit."""
    return [home(recipe.cluster.python), "-m", "megalaunch.runtime.task", "--signal", recipe.chain.stop_signal,
            "--rank-output", recipe.logging.rank_output, "--"]


def runtime_settings(recipe: Recipe, paths: RunPaths | None = None, tokenizer: TokenizerSpec | None = None) -> RuntimeSettings:
    return RuntimeSettings(
        train_iters=recipe.training.train_iters, save_interval=recipe.checkpoint.save_interval,
        log_interval=recipe.training.log_interval, trigger_interval=recipe.chain.trigger_interval,
        stop_signal=recipe.chain.stop_signal, hang_timeout_s=recipe.chain.hang_timeout_s,
        startup_timeout_s=recipe.chain.startup_timeout_s, save_time_estimate_s=recipe.checkpoint.save_time_estimate_s,
        keep_last=recipe.checkpoint.keep_last, milestone_interval=recipe.checkpoint.milestone_interval,
        cpu=recipe.cluster.gpus_per_node == 0, attention=recipe.training.attention, kernels=recipe.training.kernels,
        fits_with=fits_with(recipe, tokenizer),
        fp8=recipe.training.fp8_recipe if recipe.training.precision == "fp8" else None,
        allow_blend_change=recipe.checkpoint.allow_blend_change, profile_window=recipe.debug.nsys,
        run_name=recipe.name, wandb_project=recipe.logging.wandb_project, wandb_entity=recipe.logging.wandb_entity,
        wandb_mode=recipe.logging.wandb_mode, backend=recipe.cluster.backend, auto_requeue=recipe.chain.auto_requeue,
        max_segments_without_progress=recipe.chain.max_segments_without_progress,
        nodes=recipe.cluster.nodes, partition=recipe.cluster.partition,
        node_health_dir=node_health_dir(recipe, paths.root.parent if paths is not None else None), suspect_ttl_s=recipe.cluster.suspect_ttl_h * 3600.0,
        exclude_suspects=recipe.cluster.exclude_suspects,
        health_check=recipe.cluster.health_check is True or (recipe.cluster.health_check == "auto"
                                                             and recipe.cluster.gpus_per_node > 0),
        health_check_margin=recipe.cluster.health_check_margin, straggler_threshold=recipe.cluster.straggler_threshold,
        eval_interval=eval_interval(recipe),
        eval_submit=eval_submit_command(recipe, paths) if paths is not None and recipe.cluster.traits.job_script
        else None,
        checkpoint_bytes=recipe_checkpoint_bytes(recipe, tokenizer),
        signal_lead_s=signal_lead_s(recipe), signal_delay_s=check_period_s(recipe),
        step_time_estimate_s=recipe.chain.step_time_estimate_s, signal_margin_s=recipe.chain.signal_margin_s,
        max_signal_lead_s=recipe.cluster.time_limit_s - check_period_s(recipe) - recipe.chain.min_train_time_s,
        notify=recipe.chain.notify.job_slice(), restarts_per_segment=recipe.chain.restarts_per_segment,
        spare_nodes=recipe.cluster.spare_nodes,
        node_counts=node_counts(recipe) if recipe.cluster.min_nodes is not None else None, tasks_per_node=recipe.cluster.ntasks_per_node,
        min_train_time_s=recipe.chain.min_train_time_s, data_format=recipe.data.format,
        flow=recipe.post_training.flow or recipe.training.flow, from_hf=recipe.checkpoint.from_hf,
        chat_files=recipe.data.chat_files, export_hf=recipe.chain.export_hf,
        post_training={**asdict(recipe.post_training), **job_reference(recipe), **job_teacher(recipe)}
        if recipe.post_training.flow else None)


def fits_with(recipe: Recipe, tokenizer: TokenizerSpec | None = None) -> dict[str, str] | None:
    """What the layout fits the GPUs' memory only with (config/planner/fit.py fit_needs), for the job's check: at
    the recipe's nodes and, as preflight checks it, at the fewest a shrink may run on (more state per GPU); None
    when nothing (or when it cannot be told: preflight has refused what does not fit)."""
    from megalaunch.config.planner.fit import fit_needs
    from megalaunch.config.preflight import tokenizer_vocab_size
    from megalaunch.errors import MegalaunchError

    try:
        vocab = tokenizer_vocab_size(recipe, tokenizer)
        needs = fit_needs(recipe, vocab)
        if recipe.cluster.min_nodes is not None:
            fewest = replace(recipe.cluster, nodes=node_counts(recipe)[-1], min_nodes=None)
            needs = {**fit_needs(replace(recipe, cluster=fewest), vocab), **needs}
        return needs or None
    except (MegalaunchError, ValueError, OSError):
        return None


def eval_submit_command(recipe: Recipe, paths: RunPaths) -> list[str]:
    """What rank 0 runs (in a thread, never blocking training) to submit a queued eval as a Slurm job."""
    return [home(recipe.cluster.python), "-m", "megalaunch.cli.main", "eval", "submit-queued", str(paths.root),
            "--iteration"]


def node_health_dir(recipe: Recipe, runs: Path | None = None) -> str:
    """The team's node-health ledger (launcher/accounting/nodes.py): the cluster's, or one next to the runs (`runs`:
    the directory the run directory is actually in, where a caller put it elsewhere than run.root)."""
    return recipe.cluster.node_health_dir or os.path.join(runs or recipe.run.root, ".node-health")


def script_context(recipe: Recipe, paths: RunPaths, chain_name: str, source: str, created: str) -> dict[str, Any]:
    cl = recipe.cluster
    job = JobHeader(name=chain_name, log=str(paths.logs / "%x-%j.out"), log_from="run.root", time=cl.time, cpus_per_task=cl.cpus_per_task,
                    nodes=cl.nodes + cl.spare_nodes, ntasks_per_node=cl.ntasks_per_node, gpus_per_node=cl.gpus_per_node, mem=cl.mem,
                    options=cluster_options(cl), exclusive=cl.exclusive, no_kill=cl.spare_nodes > 0 or cl.min_nodes is not None,
                    signal=f"{recipe.chain.stop_signal.removeprefix('SIG')}@{signal_lead_s(recipe)}", append=True,
                    mail_user=cl.mail_user, mail_type=cl.mail_type)
    return {
        "version": __version__, "source": source, "created": created, "run_dir": str(paths.root), "job": job,
        "tasks_per_node": cl.ntasks_per_node, "train_nodes": cl.nodes, **environment_context(cl, [str(paths.root)]),
        "secret_env": [*cl.secret_env, *(n for n in recipe.chain.notify.webhook_env if n not in cl.secret_env)],
        "nccl_debug": recipe.debug.nccl_debug, "flight_recorder": recipe.debug.flight_recorder,
        "debug_dir": str(paths.debug), "nsys": recipe.debug.nsys, "master_port": cl.master_port,
        "supervisor": task_supervisor(recipe), "command": job_command(recipe, paths),
        "max_connections": max_connections(recipe),
    }


def max_connections(recipe: Recipe) -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS' default for the job: 1 (one work queue per device, so that tensor-parallel
    communication overlaps in order); Megatron-FSDP refuses 1 and overlaps its gathers on more queues (8,
    CUDA's default). A value in the environment wins."""
    from megalaunch.config.megatron_args import fsdp

    return "8" if fsdp(recipe) else "1"
