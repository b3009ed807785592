"""`megalaunch eval RUN [--iteration N] [--tasks ...]` and `megalaunch eval status RUN`: evaluation
of a run's checkpoints (docs/eval.md). Commands parse and delegate to megalaunch.evaluation; torch,
transformers and lm_eval are imported inside the stage only."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from megalaunch.cli.options import RunArg
from megalaunch.cli.output import emit_json, say, warn


class _RunByDefault(TyperGroup):
    """`megalaunch eval RUN ...` is `megalaunch eval run RUN ...`: a first word that is no subcommand
    (nor an option) is the run."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(no_args_is_help=True, cls=_RunByDefault)

IterOpt = Annotated[int | None, typer.Option("--iteration", "-i", min=1, help="Checkpoint iteration (default: the "
                                                                             "newest complete one).")]
TasksOpt = Annotated[str | None, typer.Option("--tasks", help="Comma-separated task names: the recipe's local "
                                                              "tasks or lm-eval task names (default: the recipe's).")]


def _tasks(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        from megalaunch.errors import ConfigError

        raise ConfigError("--tasks names no task", field="--tasks", valid="comma-separated task names",
                          fix="--tasks arith,hellaswag, or leave --tasks out for the recipe's")
    return names


def _check_tasks(recipe: Any, names: list[str] | None) -> None:
    """A name that is not a local task of the recipe is an lm-eval task: that needs the [eval] extra
    (checked without importing it) and a tokenizer; unknown names fail in the job, with lm-eval's list."""
    if not names:
        return
    local = {t.name for t in recipe.eval.local_tasks}
    others = [n for n in names if n not in local]
    if others:
        from megalaunch.errors import ConfigError, require

        if recipe.data.tokenizer_type != "HuggingFaceTokenizer":
            raise ConfigError(f"tasks {', '.join(others)} are text but the run has no tokenizer", field="--tasks",
                              valid=f"this run's local tasks: {', '.join(sorted(local)) or 'none'}",
                              fix="leave --tasks out (held-out perplexity only)")
        require("lm_eval", "eval")


@app.command("run")
def run_(
    run: RunArg,
    iteration: IterOpt = None,
    tasks: TasksOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Evaluate again even if results exist.")] = False,
) -> None:
    """Evaluate a checkpoint: a Slurm job on a Slurm run, here and now on a local one."""
    from megalaunch.config.loader import load_run_recipe
    from megalaunch.errors import MegalaunchError
    from megalaunch.evaluation import submit
    from megalaunch.launcher.control import find_run
    from megalaunch.rundir.access import require_owner
    from megalaunch.rundir.evals import EvalPaths
    from megalaunch.runtime.checkpoint.resume import checkpoint_iterations, is_complete

    paths = find_run(run)
    require_owner(paths.root, "evaluate", "the run's milestone evals run by themselves (eval.enabled); or evaluate a "
                  f"converted copy: megalaunch convert mcore-to-hf {paths.root} --out DIR")
    recipe = load_run_recipe(paths)
    names = _tasks(tasks)
    _check_tasks(recipe, names)
    complete = [i for i in checkpoint_iterations(paths) if is_complete(paths, i)]
    if iteration is None:
        if not complete:
            raise MegalaunchError(f"{paths.root} has no complete checkpoint yet", field="RUN",
                                  fix=f"wait for the first save (megalaunch status {paths.root})")
        iteration = complete[-1]
    elif iteration not in complete:
        raise MegalaunchError(f"iteration {iteration} has no complete checkpoint", field="--iteration",
                              valid=", ".join(map(str, complete)) or "none yet",
                              fix=f"megalaunch eval {paths.root} --iteration {complete[-1]}" if complete else None)
    ep = EvalPaths(paths, iteration)
    state = (ep.read_state() or {}).get("state")
    if state == "done" and not force and names is None:
        say(f"iteration {iteration} is already evaluated: {ep.results}")
        say(f"next: megalaunch eval status {paths.root}   (again: megalaunch eval {paths.root} --iteration "
            f"{iteration} --force)")
        return
    under_way = submit.active(paths, iteration)
    if under_way is not None and under_way["state"] != "queued":
        say(f"iteration {iteration} is being evaluated ({under_way['state']}, job {under_way.get('job_id')})")
        say(f"next: megalaunch eval status {paths.root}")
        return
    if recipe.cluster.traits.job_script:
        job_id = submit.submit_slurm(recipe, paths, iteration, names)
        say(f"submitted eval of iteration {iteration}: job {job_id}, script {ep.job_script}, logs {ep.logs}/")
        say(f"next: megalaunch eval status {paths.root}")
        return
    results = submit.run_here(paths, iteration, names, log=say)
    say(f"evaluated iteration {iteration} in {results['wall_s']:.1f} s: {ep.results}")
    say(f"next: megalaunch eval status {paths.root}")


@app.command()
def status(
    run: RunArg,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """What was evaluated, what is queued or running, what failed and why."""
    from megalaunch.evaluation.submit import live_records
    from megalaunch.launcher.control import find_run
    from megalaunch.rundir.evals import format_eval_records

    paths = find_run(run)
    records = live_records(paths)
    if as_json:
        emit_json(records)
        return
    if not records:
        say(f"no evals yet in {paths.evals} (recipe: eval.enabled and eval.interval or checkpoint.milestone_interval; "
            f"by hand: megalaunch eval {paths.root})")
        return
    for line in format_eval_records(records):
        say(line)


@app.command(hidden=True)
def job(run: RunArg, iteration: Annotated[int, typer.Option("--iteration", min=1)], tasks: TasksOpt = None) -> None:
    """The eval stage in this process (what eval.sbatch runs)."""
    import os

    from megalaunch.evaluation.stage import run_stage
    from megalaunch.rundir.paths import RunPaths

    results = run_stage(RunPaths(Path(os.path.abspath(run))), iteration, tasks=_tasks(tasks), log=say)
    say(f"evaluated iteration {iteration} in {results['wall_s']:.1f} s")


@app.command("submit-queued", hidden=True)
def submit_queued(run: RunArg, iteration: Annotated[int, typer.Option("--iteration", min=1)]) -> None:
    """Rank 0's call (runtime/observation/eval_queue.py): submit a queued eval as a Slurm job."""
    import os

    from megalaunch.config.loader import load_run_recipe
    from megalaunch.evaluation.submit import submit_slurm
    from megalaunch.rundir.evals import EvalPaths
    from megalaunch.rundir.paths import RunPaths

    paths = RunPaths(Path(os.path.abspath(run)))
    if (EvalPaths(paths, iteration).read_state() or {}).get("state") != "queued":
        say(f"eval of iteration {iteration} is not queued: nothing to submit")
        return
    job_id = submit_slurm(load_run_recipe(paths), paths, iteration)
    say(f"submitted eval of iteration {iteration}: job {job_id}")


@app.command("run-queued", hidden=True)
def run_queued(run: RunArg) -> None:
    """The local backend's worker: every queued eval of the run, one after the other."""
    import os

    from megalaunch.evaluation.submit import run_queued_locally
    from megalaunch.rundir.paths import RunPaths

    done = run_queued_locally(RunPaths(Path(os.path.abspath(run))), log=say)
    (say if done else warn)(f"evals run: {done}")
