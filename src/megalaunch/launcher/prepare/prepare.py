"""Prepare a run: preflight, name its chain, and render everything the run directory will hold in
memory (`prepare_run`, touching no file); with `prepare_submission`, load the recipe first and weigh the
checkpoints' disk budget. Writing it is `write`; what submit says about it, `preview`."""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalaunch import __version__
from megalaunch.config.loader import Layers, LoadedRecipe
from megalaunch.config.megatron_args import megatron_args
from megalaunch.config.planner.auto import check_fits
from megalaunch.config.planner.checkpoint_size import recipe_checkpoint_bytes
from megalaunch.config.preflight import preflight, recipe_tokenizer
from megalaunch.config.schema import Recipe
from megalaunch.config.storage import DiskBudget
from megalaunch.config.tokenizer import TokenizerSpec
from megalaunch.config.topology import Topology
from megalaunch.config.training.reference_plan import check_post_training_submit
from megalaunch.config.training.teacher_plan import check_distill_submit
from megalaunch.errors import RunDirError
from megalaunch.launcher.prepare.explain import yaml_with_origins
from megalaunch.launcher.prepare.job_inputs import runtime_settings, script_context
from megalaunch.launcher.prepare.outlook import Outlook, outlook
from megalaunch.launcher.prepare.render import render
from megalaunch.launcher.prepare.self_cli import check_job_megalaunch, with_job_megalaunch
from megalaunch.rundir.files import args_file_text
from megalaunch.rundir.paths import RunPaths


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
    outlook: Outlook | None = None  # the layout chosen and the forecast (RUN/plan.json; a loaded recipe's)

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


def prepare_run(loaded: LoadedRecipe, *, chain_name: str | None = None, created: str | None = None,
                root: Path | None = None, frozen_blend: Any | None = None) -> PreparedRun:
    """Preflight and render; touches no file. `frozen_blend`: a run's own blend (resume), not re-resolved."""
    loaded = with_job_megalaunch(loaded)  # the job runs the megalaunch that submits it, unless the recipe names one
    recipe = loaded.recipe
    check_fits(loaded.layout)  # `parallel: auto` found no layout that fits: its one line, before preflight's
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
    view = outlook(recipe, loaded.layout, recipe_checkpoint_bytes(recipe, tokenizer)) if loaded.layout else None
    if view is not None:
        files["plan.json"] = view.record()
    return PreparedRun(loaded=loaded, paths=paths, chain_name=chain_name, topology=topo, files=files,
                       blend_sha256=blend.sha256 if blend is not None else None,
                       tokenizer=tokenizer, outlook=view)


def prepare_submission(ref: str, sets: list[str], *, name: str | None = None, cluster: str | None = None,
                       backend: str | None = None, auto_requeue: bool = True, check_disk: bool = True,
                       layers: Layers = ()) -> PreparedRun:
    """What `megalaunch submit` does before anything is written: load (with the command line's
    overrides, which win over `--set`), preflight, render and the disk budget (refused when it does
    not fit and `check_disk`; a dry run shows the verdict instead). `layers`: values under `--set` from
    elsewhere (`--from-hf`'s model shape and tokenizer, `--data`'s data; finetune/)."""
    from megalaunch.config.loader import load_recipe

    sets = list(sets)
    if backend is not None:
        sets.append(f"cluster.backend={backend}")
    if not auto_requeue:
        sets.append("chain.auto_requeue=false")
    prepared = prepare_run(load_recipe(ref, sets, name=name, cluster=cluster, layers=layers))
    check_post_training_submit(prepared.recipe)  # DPO on mock data: a plan or a render shows the shape, a submit needs pairs
    check_distill_submit(prepared.recipe)  # the teacher's placeholder, mock data (config/training/teacher_plan.py)
    if check_disk:  # a real submit, not a dry run
        check_job_megalaunch(prepared.recipe)
    return with_disk_budget(prepared, enforce=check_disk)


def with_disk_budget(prepared: PreparedRun, *, enforce: bool = True) -> PreparedRun:
    """The checkpoints' peak on disk against the free space and quota of the run root's filesystem
    (config/storage.py); `enforce`: a PreflightError when it does not fit (checkpoint.disk_check)."""
    from megalaunch.config.planner.checkpoint_size import recipe_peak
    from megalaunch.config.preflight import tokenizer_vocab_size
    from megalaunch.config.storage import check_disk, disk_budget
    from megalaunch.config.training.score_budget import scores_bytes

    recipe = prepared.recipe
    if recipe.workload:  # a workload instead of Megatron: no checkpoints to budget
        return prepared
    vocab = tokenizer_vocab_size(recipe, prepared.tokenizer)
    peak = recipe_peak(recipe, vocab)
    scores = scores_bytes(recipe, prepared.files.get("data_blend.txt"))  # DPO's reference, a teacher's top-k
    budget = disk_budget(dataclasses.replace(peak, scores_bytes=scores) if scores else peak, prepared.paths.checkpoints)
    if enforce:
        check_disk(recipe, budget, vocab)
    return dataclasses.replace(prepared, budget=budget)
