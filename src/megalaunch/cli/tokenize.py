"""`megalaunch tokenize plan|submit|status|cancel`: the tokenization stage. Commands parse and
delegate to megalaunch.tokenization; nothing heavy is imported at module level."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from megalaunch.cli.output import emit_json, say

if TYPE_CHECKING:
    from megalaunch.rundir.tokenize import TokenizeRun

app = typer.Typer(no_args_is_help=True)

RunArg = Annotated[str, typer.Argument(help="Tokenization run directory (made by `tokenize plan`).")]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.0f} B"


@app.command()
def plan(
    recipe: Annotated[str, typer.Argument(help="Tokenization recipe: a YAML file or a shipped name (tokenize/NAME).")],
    run_dir: Annotated[str, typer.Option("--run-dir", "-o", help="Where the run directory goes.")],
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                   help="Override a recipe value (e.g. n_dumps=64).")] = None,
) -> None:
    """Find the input files, split them into dumps balanced by size, write the run directory."""
    from megalaunch.tokenization.recipe import load_tokenize_recipe
    from megalaunch.tokenization.submit import create_run

    loaded, _ = load_tokenize_recipe(recipe, list(set_ or []))
    run, the_plan = create_run(loaded, run_dir)
    say(f"planned {the_plan.n_files} input files ({_size(the_plan.bytes)}) into {len(the_plan.dumps)} dumps "
        f"of up to {max(len(d.tasks) for d in the_plan.dumps)} tasks in {run.root} (job array tok-{loaded.name})")
    for dump in the_plan.dumps[:20]:
        say(f"  dump {dump.index:4d}: {dump.n_files:5d} files {_size(dump.bytes):>10} in {len(dump.tasks)} tasks")
    if len(the_plan.dumps) > 20:
        say(f"  ... {len(the_plan.dumps) - 20} more (see {run.plan_json})")
    say(f"next: megalaunch tokenize submit {run.root}")


@app.command()
def submit(
    run_dir: RunArg,
    backend: Annotated[str | None, typer.Option("--backend", help="slurm | local (default: the recipe's).")] = None,
    dump: Annotated[list[int] | None, typer.Option("--dump", help="Only these dumps (repeatable).")] = None,
) -> None:
    """Submit every dump that is not done (a throttled job array; or run them here with --backend local).
    Submitting again resumes: finished tasks are skipped through datatrove's completion markers."""
    from megalaunch.config.cluster import BACKENDS
    from megalaunch.errors import ConfigError
    from megalaunch.rundir.tokenize import TokenizeRun
    from megalaunch.tokenization.submit import submit as submit_run

    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", field="--backend", valid=" | ".join(BACKENDS))
    run = TokenizeRun.at(run_dir)
    result = submit_run(run, backend=backend, dumps=list(dump) if dump else None)
    if result is None:
        say(f"every dump is done; next: {_data_check_command(run)}")
        return
    if result.job_id is not None:
        say(f"submitted job array {result.job_id} ({len(result.dumps)} dumps) for {run.root}")
        say(f"next: megalaunch tokenize status {run.root} --follow")
    else:
        say(f"ran {len(result.dumps)} dumps locally; next: megalaunch tokenize status {run.root}")


@app.command()
def status(
    run_dir: RunArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Refresh until every dump ends.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Per dump: done / running / pending / failed, documents and tokens so far, rate."""
    from dataclasses import asdict

    from megalaunch.rundir.tokenize import TokenizeRun
    from megalaunch.tokenization.status import dump_statuses, totals

    run = TokenizeRun.at(run_dir)
    while True:
        statuses = dump_statuses(run)
        total = totals(statuses)
        if as_json:
            emit_json({"dumps": [asdict(s) for s in statuses], "total": total})
        else:
            _print_status(statuses, total)
        active = any(s.state in ("running", "pending") for s in statuses)
        if not follow or not active:
            break
        time.sleep(interval)
    if any(s.state in ("failed", "cancelled", "stopped") for s in statuses) and not as_json:
        say(f"some dumps did not finish: `megalaunch tokenize submit {run.root}` resumes them")
    elif statuses and all(s.state == "done" for s in statuses) and not as_json:
        say(f"next: {_data_check_command(run)}")


def _data_check_command(run: TokenizeRun) -> str:
    """The next stage: check the outputs against the tokenizer they were made with."""
    import shlex

    from megalaunch.tokenization.recipe import load_run_recipe

    recipe = load_run_recipe(run)
    return (f"megalaunch data check {shlex.quote(str(run.output_dir(recipe.output_dir)))} "
            f"--tokenizer {shlex.quote(recipe.tokenizer.path)}")


def _print_status(statuses: list, total: dict) -> None:
    # tok/s: a running dump's over the last minute, a finished dump's average
    say(f"{'dump':>5} {'state':14}{'tasks':>9}{'documents':>13}{'tokens':>16}{'tok/s':>12}  job")
    for s in statuses:
        rate = f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "-"
        detail = f"  ({s.detail})" if s.detail else ""
        say(f"{s.index:>5} {s.state:14}{f'{s.tasks_done}/{s.tasks}':>9}{s.documents:>13,}{s.tokens:>16,}{rate:>12}"
            f"  {s.job}{detail}")
    width = 30
    frac = total["tasks_done"] / total["tasks"] if total["tasks"] else 0.0
    bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
    rate = total["tokens_per_s"]
    pace = ("stalled" if total["rate_over"] == "recent" else "no rate yet") if rate is None else (
        f"{rate:,.0f} tok/s " + ("over the last minute" if total["rate_over"] == "recent" else "on average"))
    say(f"[{bar}] {frac:6.1%}  {total['done']}/{total['dumps']} dumps, {total['documents']:,} documents, "
        f"{total['tokens']:,} tokens, {pace}")


@app.command()
def cancel(run_dir: RunArg) -> None:
    """Cancel the run's job array (by its job id). Submitting again resumes."""
    from megalaunch.rundir.tokenize import TokenizeRun
    from megalaunch.tokenization.submit import cancel as cancel_run

    run = TokenizeRun.at(run_dir)
    job = cancel_run(run)
    say(f"cancelled job array {job}" if job else "no Slurm submission to cancel")
