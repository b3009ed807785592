"""Create a run directory: preflight, render everything in memory, write it into a temporary
directory next to the final one and rename it into place, so a failure leaves nothing behind."""

from __future__ import annotations

import dataclasses
import getpass
import grp
import hashlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch import __version__
from megalaunch.config.loader import LoadedRecipe
from megalaunch.config.megatron_args import megatron_args
from megalaunch.config.planner.checkpoint_size import recipe_checkpoint_bytes
from megalaunch.config.preflight import (
    Topology,
    check_period_s,
    eval_interval,
    preflight,
    recipe_tokenizer,
    signal_lead_s,
)
from megalaunch.config.schema import Recipe
from megalaunch.config.storage import DiskBudget
from megalaunch.config.tokenizer import TokenizerSpec
from megalaunch.errors import PreflightError, RunDirError
from megalaunch.launcher.prepare.explain import yaml_with_origins
from megalaunch.launcher.prepare.render import render
from megalaunch.launcher.prepare.sbatch import JobHeader, cluster_options, environment_context, home
from megalaunch.rundir.files import args_file_text
from megalaunch.rundir.paths import RunPaths
from megalaunch.rundir.trust import (
    RUN_DIR_MODE,
    TEAM_DIR_MODE,
    TRIGGER_DIR_MODE,
    check_ancestors,
    file_hashes,
)
from megalaunch.runtime.rank.settings import RuntimeSettings


@dataclass(frozen=True)
class PreparedRun:
    """Everything a submit writes, computed before anything touches the disk."""

    loaded: LoadedRecipe
    paths: RunPaths
    chain_name: str
    topology: Topology
    files: dict[str, str]  # relative path -> content
    blend_sha256: str | None
    tokenizer: TokenizerSpec | None = None  # frozen into RUN/tokenizer/ (Megatron's --tokenizer-model)
    budget: DiskBudget | None = None  # the checkpoints' disk budget (submit: prepare_submission)

    @property
    def recipe(self) -> Recipe:
        return self.loaded.recipe


def chain_name_for(recipe: Recipe, root: Path) -> str:
    """`<name>-<8 hex>`, the same for `submit --dry-run` and the submit that follows it: the hash of the
    run root, the name, the user and the first sequence number whose directory does not exist yet, so
    every run under a root gets its own name (and so its own Slurm job name) without randomness."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    for n in range(10_000):
        salt = f"{root}/{recipe.name}/{user}/{n}"
        name = f"{recipe.name}-{hashlib.sha256(salt.encode()).hexdigest()[:8]}"
        if not (root / name).exists() and not (root / f".{name}.partial").exists():
            return name
    raise RunDirError(f"{root} already holds 10,000 runs named {recipe.name}", field="name",
                      fix="choose another --name or run.root")


def run_root(recipe: Recipe) -> Path:
    return Path(recipe.run.root).absolute()  # expanded when the recipe was loaded (config/paths.py)


def job_command(recipe: Recipe, paths: RunPaths) -> list[str]:
    """What each task runs: Megatron training, or the recipe's `workload` ({run_dir} is substituted)."""
    if recipe.workload:
        return [arg.replace("{run_dir}", str(paths.root)) for arg in recipe.workload]
    return [home(recipe.cluster.python), "-m", "megalaunch.runtime.train", str(paths.root)]


def task_supervisor(recipe: Recipe) -> list[str]:
    """The per-task supervisor every rank starts under (runtime/task.py): it keeps the stop signal
    from the trainer's child processes, kills what a dying rank leaves behind, records each rank's exit."""
    return [home(recipe.cluster.python), "-m", "megalaunch.runtime.task", "--signal", recipe.chain.stop_signal, "--"]


def runtime_settings(recipe: Recipe, paths: RunPaths | None = None, tokenizer: TokenizerSpec | None = None) -> RuntimeSettings:
    return RuntimeSettings(
        train_iters=recipe.training.train_iters, save_interval=recipe.checkpoint.save_interval,
        log_interval=recipe.training.log_interval, trigger_interval=recipe.chain.trigger_interval,
        stop_signal=recipe.chain.stop_signal, hang_timeout_s=recipe.chain.hang_timeout_s,
        startup_timeout_s=recipe.chain.startup_timeout_s,
        keep_last=recipe.checkpoint.keep_last, milestone_interval=recipe.checkpoint.milestone_interval,
        cpu=recipe.cluster.gpus_per_node == 0, attention=recipe.training.attention, kernels=recipe.training.kernels,
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
        spare_nodes=recipe.cluster.spare_nodes, tasks_per_node=recipe.cluster.ntasks_per_node,
        min_train_time_s=recipe.chain.min_train_time_s, data_format=recipe.data.format,
        flow=recipe.training.flow, from_hf=recipe.checkpoint.from_hf)


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
                    options=cluster_options(cl), exclusive=cl.exclusive,
                    signal=f"{recipe.chain.stop_signal.removeprefix('SIG')}@{signal_lead_s(recipe)}", append=True,
                    mail_user=cl.mail_user, mail_type=cl.mail_type)
    return {
        "version": __version__, "source": source, "created": created, "run_dir": str(paths.root), "job": job,
        "tasks_per_node": cl.ntasks_per_node, "train_nodes": cl.nodes, **environment_context(cl, [str(paths.root)]),
        "secret_env": [*cl.secret_env, *(n for n in recipe.chain.notify.webhook_env if n not in cl.secret_env)],
        "nccl_debug": recipe.debug.nccl_debug, "flight_recorder": recipe.debug.flight_recorder,
        "debug_dir": str(paths.debug), "nsys": recipe.debug.nsys, "master_port": cl.master_port,
        "supervisor": task_supervisor(recipe), "command": job_command(recipe, paths),
    }


def code_revision(path: Path) -> dict[str, Any]:
    """git revision of `path` (+ a hash of the diff when dirty), or {} when not a git checkout."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    if rev is None:
        return {}
    diff = git("diff", "HEAD") or ""
    return {"revision": rev.strip(), "dirty": bool(diff),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}


def prepare_run(loaded: LoadedRecipe, *, chain_name: str | None = None, created: str | None = None,
                root: Path | None = None, frozen_blend: Any | None = None) -> PreparedRun:
    """Preflight and render; touches no file. `frozen_blend`: a run's own blend (resume), not re-resolved."""
    recipe = loaded.recipe
    topo, blend = preflight(recipe, frozen_blend=frozen_blend)
    root = root or run_root(recipe)
    chain_name = chain_name or chain_name_for(recipe, root)
    paths = RunPaths(root / chain_name)
    created = created or time.strftime("%Y-%m-%dT%H:%M:%S%z")
    resolved = loaded.resolved()
    run_yaml = (f"# Resolved recipe of run {chain_name} (megalaunch {__version__}, {created}).\n"
                "# Comments say which file or flag set each value; unmarked values are defaults.\n"
                + yaml_with_origins(resolved, loaded.origin))
    tokenizer = recipe_tokenizer(recipe)
    files = {
        "run.yaml": run_yaml,
        "megatron.args": args_file_text(megatron_args(recipe, paths)),
        "runtime.json": runtime_settings(recipe, paths, tokenizer).to_json(),
    }
    if recipe.cluster.traits.job_script:
        files["job.sbatch"] = render("train.sbatch.j2", **script_context(recipe, paths, chain_name,
                                                                         loaded.source, created))
    if blend is not None:
        files["data_blend.txt"] = blend.text
    return PreparedRun(loaded=loaded, paths=paths, chain_name=chain_name, topology=topo, files=files,
                       blend_sha256=blend.sha256 if blend is not None else None,
                       tokenizer=tokenizer)


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise PreflightError(f"group '{group}' does not exist", field="run.group",
                             fix="use a group from `id -Gn`") from None
    if os.getuid() != 0 and gid not in os.getgroups():
        raise PreflightError(f"you are not a member of group '{group}'", field="run.group",
                             valid=", ".join(grp.getgrgid(g).gr_name for g in os.getgroups()),
                             fix="choose one of your groups")
    return gid


def write_run(prepared: PreparedRun) -> RunPaths:
    """Create the run directory atomically (temp dir + rename): the owner writes, the run's group reads
    (umask 027, 2750), members write only triggers/ (3770; docs/security.md)."""
    recipe = prepared.recipe
    paths = prepared.paths
    gid = _group_id(recipe.run.group)
    root = paths.root.parent
    check_ancestors(paths.root)  # nobody else can rename the run (or a directory above it) away
    old_umask = os.umask(0o027)
    try:
        try:
            if not root.exists():
                root.mkdir(parents=True)
                if gid is not None:  # the team reaches its runs; sticky: nobody renames another's
                    os.chown(root, -1, gid)
                    os.chmod(root, TEAM_DIR_MODE)
        except OSError as e:
            raise RunDirError(f"cannot create the run root {root}: {e.strerror}", field="run.root",
                              fix="choose a writable directory: --set run.root=/path") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise RunDirError(f"the run root {root} is not writable", field="run.root",
                              fix="choose a writable directory: --set run.root=/path")
        if paths.root.exists():
            raise RunDirError(f"{paths.root} already exists", fix="choose another --name")
        tmp = root / f".{paths.root.name}.partial"
        try:
            _populate(tmp, prepared, gid)
            os.rename(tmp, paths.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        os.umask(old_umask)
    return paths


def _populate(tmp: Path, prepared: PreparedRun, gid: int | None) -> None:
    recipe = prepared.recipe
    tmp.mkdir()
    if gid is not None:
        os.chown(tmp, -1, gid)
    os.chmod(tmp, RUN_DIR_MODE)
    t = RunPaths(tmp)
    for d in (t.triggers, t.consumed_triggers, t.checkpoints, t.logs, t.state, t.debug):
        d.mkdir(parents=True)
    # the only place members write: group-writable whatever the umask, sticky (consumed/ is the owner's)
    os.chmod(t.triggers, TRIGGER_DIR_MODE)
    for rel, content in prepared.files.items():
        (tmp / rel).write_text(content)
    if "job.sbatch" in prepared.files:
        os.chmod(t.job_script, 0o750)
    if prepared.tokenizer is not None:
        t.tokenizer.mkdir()
        for name, data in prepared.tokenizer.files().items():
            (t.tokenizer / name).write_bytes(data)
    snapshot = recipe.debug.code_snapshot
    if snapshot:
        _snapshot_code(Path(os.path.expanduser(snapshot)), t.code_snapshot)
    manifest = {
        "megalaunch_version": __version__,
        "chain_name": prepared.chain_name,
        "run_dir": str(prepared.paths.root),
        "user": getpass.getuser(),
        "host": socket.gethostname(),
        "created": time.time(),
        "recipe_source": prepared.loaded.source,
        "recipe_sha256": hashlib.sha256(prepared.files["run.yaml"].encode()).hexdigest(),
        "data_blend_sha256": prepared.blend_sha256,
        "trusted_sha256": file_hashes(prepared.files),  # what the job checks before it runs anything
        "tokenizer": prepared.tokenizer.record() if prepared.tokenizer is not None else None,
        "backend": recipe.cluster.backend,
        "code": code_revision(Path(os.path.expanduser(snapshot))) if snapshot
        else code_revision(Path(__file__).resolve().parent),
        "world_size": prepared.topology.world_size,
        "data_parallel_size": prepared.topology.dp,
    }
    import json

    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    t.ledger.touch()
    os.chmod(t.ledger, 0o640)


def _snapshot_code(src: Path, dst: Path) -> None:
    """Copy the tracked files of a git checkout (or the whole tree) into RUN/code. Fails loudly."""
    if not src.is_dir():
        raise PreflightError(f"{src} is not a directory", field="debug.code_snapshot",
                             fix="point it at your source tree or set it to null")
    try:
        listed = subprocess.run(["git", "-C", str(src), "ls-files", "-z"], capture_output=True, timeout=60)
        names = [n for n in listed.stdout.decode().split("\0") if n] if listed.returncode == 0 else None
        if names is None:
            shutil.copytree(src, dst, symlinks=True)
            return
        for name in names:
            target = dst / name
            target.parent.mkdir(parents=True, exist_ok=True)
            s = src / name
            if s.is_symlink():
                os.symlink(os.readlink(s), target)
            elif s.is_file():
                shutil.copy2(s, target)
    except (OSError, shutil.Error, subprocess.TimeoutExpired) as e:
        raise RunDirError(f"code snapshot of {src} failed: {e}", field="debug.code_snapshot",
                          fix="fix the source tree or set debug.code_snapshot to null") from None


def prepare_submission(ref: str, sets: list[str], *, name: str | None = None, cluster: str | None = None,
                       backend: str | None = None, auto_requeue: bool = True, check_disk: bool = True) -> PreparedRun:
    """What `megalaunch submit` does before anything is written: load (with the command line's
    overrides, which win over `--set`), preflight, render and the disk budget (refused when it does
    not fit and `check_disk`; a dry run shows the verdict instead)."""
    from megalaunch.config.loader import load_recipe

    sets = list(sets)
    if backend is not None:
        sets.append(f"cluster.backend={backend}")
    if not auto_requeue:
        sets.append("chain.auto_requeue=false")
    return with_disk_budget(prepare_run(load_recipe(ref, sets, name=name, cluster=cluster)), enforce=check_disk)


def with_disk_budget(prepared: PreparedRun, *, enforce: bool = True) -> PreparedRun:
    """The checkpoints' peak on disk against the free space and quota of the run root's filesystem
    (config/storage.py); `enforce`: a PreflightError when it does not fit (checkpoint.disk_check)."""
    from megalaunch.config.planner.checkpoint_size import recipe_peak
    from megalaunch.config.preflight import tokenizer_vocab_size
    from megalaunch.config.storage import check_disk, disk_budget

    recipe = prepared.recipe
    if recipe.workload:  # a workload instead of Megatron: no checkpoints to budget
        return prepared
    vocab = tokenizer_vocab_size(recipe, prepared.tokenizer)
    budget = disk_budget(recipe_peak(recipe, vocab), prepared.paths.checkpoints)
    if enforce:
        check_disk(recipe, budget, vocab)
    return dataclasses.replace(prepared, budget=budget)


def disk_lines(prepared: PreparedRun) -> list[str]:
    """The checkpoint size, the peak on disk and the room for it; a dry run adds what submit would say."""
    budget = prepared.budget
    if budget is None:
        return []
    lines = budget.lines()
    if not budget.fits and prepared.recipe.checkpoint.disk_check:
        from megalaunch.config.preflight import tokenizer_vocab_size
        from megalaunch.config.storage import check_disk

        try:
            check_disk(prepared.recipe, budget, tokenizer_vocab_size(prepared.recipe, prepared.tokenizer))
        except PreflightError as e:
            lines.append(f"disk: submit refuses this: {e}")
    return lines


def summary(prepared: PreparedRun) -> str:
    r, topo = prepared.recipe, prepared.topology
    return (f"{r.name}: {r.model.num_layers} layers x {r.model.hidden_size} hidden, world {topo.world_size} "
            f"= TP {topo.tp} x PP {topo.pp} x CP {topo.cp} x DP {topo.dp}, "
            f"{r.training.global_batch_size} seqs x {r.model.seq_length} tokens per step, "
            f"{r.training.train_iters} iterations, backend {r.cluster.backend}")


def dry_run_text(prepared: PreparedRun) -> str:
    """What a submit would create: the run directory, the job script, Megatron's arguments."""
    import shlex

    lines = [f"dry run: {summary(prepared)}", f"would create {prepared.paths.root}", *disk_lines(prepared)]
    if prepared.tokenizer is not None:
        lines.append(f"{prepared.tokenizer.describe()} -> {prepared.paths.tokenizer}/")
    if "job.sbatch" in prepared.files:
        lines += ["----- job.sbatch -----", prepared.files["job.sbatch"].rstrip("\n")]
    lines += ["----- megatron.args -----",
              shlex.join(line for line in prepared.files["megatron.args"].splitlines() if line),
              "nothing written, nothing submitted"]
    return "\n".join(lines)
