"""Commands on runs: submit, status, logs, trigger, cancel, resume."""

from __future__ import annotations

import time
from enum import Enum
from typing import Annotated

import typer

from megalaunch.cli.options import ClusterOpt, RunArg, SetOpt
from megalaunch.cli.output import emit_json, ml, say


class Backend(str, Enum):
    slurm = "slurm"
    local = "local"


class Verb(str, Enum):
    save = "save"
    exit = "exit"
    abort = "abort"


def submit(
    recipe: Annotated[str, typer.Argument(help="Recipe file or shipped name (see `megalaunch recipes list`).")],
    set_: SetOpt = None,
    name: Annotated[str | None, typer.Option("--name", help="Experiment name (default: the recipe's).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and render; write and submit nothing.")] = False,
    backend: Annotated[Backend | None, typer.Option("--backend", help="Override cluster.backend.")] = None,
    no_auto_requeue: Annotated[bool, typer.Option("--no-auto-requeue", help="Run one segment, no successor.")] = False,
    cluster: ClusterOpt = None,
    from_hf: Annotated[str | None, typer.Option("--from-hf", metavar="DIR", help="Start from this Hugging Face "
                                                "model: its config.json gives the model's shape, its tokenizer and "
                                                "chat template the run's; the first stage converts it.")] = None,
    data: Annotated[str | None, typer.Option("--data", metavar="DIR", help="SFT data: chat JSONL files (or a "
                                             "folder of them), tokenized by the chain's first stage, or the "
                                             "output of `megalaunch data sft`.")] = None,
) -> None:
    """Validate a recipe, create the run directory and start the chain.

    On the local backend the command runs the chain and waits for it; its exit status then says how the
    chain ended: 0 finished (or an exit trigger saved and stopped it), 3 an abort trigger or `cancel`
    stopped it without a save, 1 it ended on an error (configuration error, failure, hang, storage full,
    the crash-loop guard, a first stage that failed)."""
    from megalaunch.finetune.layers import submit_layers
    from megalaunch.launcher.backends.registry import backend_for
    from megalaunch.launcher.prepare.outlook import outlook_lines
    from megalaunch.launcher.prepare.prepare import prepare_submission
    from megalaunch.launcher.prepare.preview import disk_lines, dry_run_text, stage_lines, summary

    layers = submit_layers(recipe, set_ or [], from_hf=from_hf, data=data, cluster=cluster)
    prepared = prepare_submission(recipe, set_ or [], name=name, cluster=cluster, check_disk=not dry_run,
                                  backend=backend.value if backend else None, auto_requeue=not no_auto_requeue,
                                  layers=layers)
    if dry_run:
        say(dry_run_text(prepared))
        return
    r = prepared.recipe
    head = ["\n".join([summary(prepared), *stage_lines(prepared), *outlook_lines(prepared.outlook, why=False),
                       *disk_lines(prepared)])]

    def echo(line: str) -> None:  # what the run is, right before the backend's first word: a refusal before
        while head:  # it (a missing secret, Slurm down, an unwritable run root) is the only line printed
            say(head.pop())
        say(line)

    started = backend_for(r.cluster.backend).start(prepared, echo)
    while head:
        say(head.pop())
    if started.job_id is None:
        say(f"done: {started.outcome}")
        if r.chain.export_hf and (started.paths.root / "hf" / "config.json").is_file():
            say(f"Hugging Face model: {started.paths.root / 'hf'} (transformers: AutoModelForCausalLM.from_pretrained)")
        say(f"  {ml()} status {started.paths.root}")
        _exit_as_chain(started.exit_code)
        return
    say(f"run directory: {started.paths.root}")
    say(f"submitted job {started.job_id} (chain {prepared.chain_name}; each segment queues its successor)")
    say("next:")
    say(f"  {ml()} status {started.paths.root}")
    say(f"  {ml()} logs {started.paths.root} -f")
    say(f"  {ml()} trigger save|exit|abort {started.paths.root} --reason '...'")
    say(f"  {ml()} cancel {started.paths.root}")


def status(
    run: Annotated[str | None, typer.Argument(help="Run directory or name; none: all of your runs.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    watch: Annotated[float | None, typer.Option("--watch", help="Refresh every N seconds (Ctrl-C to stop).")] = None,
    evals: Annotated[bool, typer.Option("--evals", help="Also the run's evaluations (megalaunch eval status).")] = False,
) -> None:
    """Show a run's chain (segments, iteration, checkpoint, triggers, guard) or all of your runs."""
    from megalaunch.launcher.control import find_run
    from megalaunch.launcher.status import all_runs_status, run_status
    from megalaunch.launcher.status_format import format_run_status
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.rundir.registry import known_runs

    def once() -> None:
        if run is not None:
            paths = find_run(run)
            st = run_status(paths)
            if evals:
                from megalaunch.evaluation.submit import live_records
                from megalaunch.rundir.evals import format_eval_records

                st["evals"] = live_records(paths)
            if as_json:
                emit_json(st)
                return
            say(format_run_status(st))
            if evals:
                say("  evals:" + ("" if st["evals"] else " none yet"))
                for line in format_eval_records(st["evals"]):
                    say(f"    {line}")
            return
        rows = all_runs_status([RunPaths(p) for p in known_runs()])
        if as_json:
            emit_json(rows)
            return
        if not rows:
            say("no runs yet: megalaunch submit RECIPE (a team's runs: megalaunch status RUN_DIR once, "
                "or MEGALAUNCH_RUN_ROOTS=/path/to/runs)")
        for row in rows:
            it = row["iteration"] if row["iteration"] is not None else "-"
            say(f"{row['chain_name']:<32} {row['owner']:<10} {row['state']:<8} iter {it}/{row['target']}  "
                f"jobs {','.join(row['jobs']) or '-'}  {row['run_dir']}"
                + (f"  ({row['stop_reason']})" if row["stop_reason"] else ""))
        if rows and rows[0]["slurm_error"]:
            say(f"slurm: {rows[0]['slurm_error']}")

    if watch is None:
        once()
        return
    try:
        while True:
            print("\033[2J\033[H", end="")
            once()
            time.sleep(max(watch, 1.0))
    except KeyboardInterrupt:
        pass


def logs(
    run: RunArg,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing as the log grows and move on to "
                                         "each next segment's log; ends when the chain does (or Ctrl-C).")] = False,
    segment: Annotated[int | None, typer.Option("--segment", help="Segment number as `megalaunch status` shows it "
                                                "(1 = first); default: the newest with a log.")] = None,
    tail: Annotated[int | None, typer.Option("--tail", "-n", min=0, metavar="N",
                                             help="Only the last N lines (then follow with -f).")] = None,
    since_start: Annotated[bool, typer.Option("--since-start", help="Skip the start-up output up to the end of "
                                              "Megatron's argument dump (a log without one is shown whole).")] = False,
) -> None:
    """Print a segment's log; with -f, follow the chain from segment to segment."""
    import sys

    from megalaunch.launcher.control import find_run
    from megalaunch.launcher.logs import print_logs

    paths = find_run(run)
    backend = None
    if follow:
        from megalaunch.config.loader import load_run_recipe
        from megalaunch.launcher.backends.registry import backend_for

        backend = backend_for(load_run_recipe(paths).cluster.backend)
    try:
        ended = print_logs(paths, sys.stdout.buffer, number=segment, tail=tail, since_start=since_start,
                           follow=follow, backend=backend)
    except KeyboardInterrupt:  # the usual way out of -f: no traceback, no error
        return
    if ended:
        say(ended)


def trigger(
    verb: Annotated[Verb, typer.Argument(help="save: checkpoint and continue; exit: save and stop the chain; "
                                              "abort: stop now without saving.")],
    run: RunArg,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (recorded in the audit trail).")] = None,
) -> None:
    """Ask a running job to save, exit or abort (any member of the run's group may)."""
    from megalaunch.launcher.control import find_run
    from megalaunch.rundir.triggers import TriggerBox

    paths = find_run(run)
    path = TriggerBox(paths).write(verb.value, reason)
    say(f"trigger '{verb.value}' written: {path}")
    say(f"the job acts on it within chain.trigger_interval iterations; check: {ml()} status {paths.root}")


def cancel(run: RunArg) -> None:
    """Cancel the run's running and queued segments (by job id) and stop the chain."""
    from megalaunch.config.loader import load_run_recipe
    from megalaunch.launcher.backends.registry import backend_for
    from megalaunch.launcher.control import find_run
    from megalaunch.rundir.access import require_owner

    paths = find_run(run)
    require_owner(paths.root, "cancel", f"a member stops the run with: megalaunch trigger exit {paths.root} "
                  f"(save, then stop) or megalaunch trigger abort {paths.root} (stop now)")
    ids = backend_for(load_run_recipe(paths).cluster.backend).cancel(paths)
    say(f"cancelled {', '.join(ids) if ids else 'nothing (no job of this run was queued or running)'}")
    say(f"restart later from the last checkpoint: {ml()} resume {paths.root}")


def resume(
    run: RunArg,
    from_iteration: Annotated[int | None, typer.Option(
        "--from", metavar="ITER", help="Resume from this checkpoint instead of the newest; newer checkpoints are "
        "moved aside (kept as iter_N.abandoned-JOB) and recorded in the ledger.")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE", help="Change a setting of the run first (repeatable), e.g. "
        "data.blend_file=FILE or training.train_iters=N: validated like submit, recorded (old and new value and "
        "blend hash, who, when) in the ledger and manifest.json.")] = None,
) -> None:
    """Restart a stopped chain from its last checkpoint (or an older one with --from), optionally with
    changed settings (--set). Checks like submit before anything is queued. On the local backend it
    waits for the chain, with submit's exit status (0 finished or exit trigger, 3 abort or cancel, 1 error)."""
    from megalaunch.config.loader import load_run_recipe
    from megalaunch.launcher.backends.registry import backend_for
    from megalaunch.launcher.chain.resume_from import check_not_live, check_resume_from, resume_chain
    from megalaunch.launcher.control import find_run
    from megalaunch.launcher.prepare.resume_check import (
        apply_change,
        check_resumable,
        describe_change,
        prepare_change,
    )
    from megalaunch.rundir.access import require_owner

    paths = find_run(run)
    require_owner(paths.root, "resume", f"ask its owner; a member can stop it (megalaunch trigger exit {paths.root}) "
                  "or submit their own run from its checkpoint (--set checkpoint.load=" f"{paths.checkpoints})")
    recipe = load_run_recipe(paths)
    change = None
    if set_:
        change = prepare_change(paths, set_)
        check_not_live(paths, backend_for(recipe.cluster.backend), "resume --set changes")
        recipe = change.prepared.recipe
    backend = backend_for(recipe.cluster.backend)
    if from_iteration is None and change is None:
        check_not_live(paths, backend)
    check_resumable(paths, recipe, from_iteration=from_iteration, change=change)
    if change is not None:
        if from_iteration is not None:  # every check before the first write
            check_resume_from(paths, backend, from_iteration, recipe.training.train_iters)
        apply_change(paths, change)
        say("changed (recorded in the ledger and manifest.json):")
        for line in describe_change(change):
            say(line)
    started = resume_chain(paths, backend, say, from_iteration=from_iteration,
                           train_iters=recipe.training.train_iters)
    if started.job_id is None:
        say(f"done: {started.outcome}")
        if (started.paths.root / "hf" / "config.json").is_file():
            say(f"Hugging Face model: {started.paths.root / 'hf'} (transformers: AutoModelForCausalLM.from_pretrained)")
        _exit_as_chain(started.exit_code)
    else:
        say(f"submitted job {started.job_id}; {ml()} status {paths.root}")


def _exit_as_chain(code: int) -> None:
    """A command that waited for the chain exits as the chain ended (launcher/backends/local.py, `exit_status`)."""
    if code:
        import sys

        print(f"megalaunch: the chain did not finish (exit status {code})", file=sys.stderr)
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    for fn in (submit, status, logs, trigger, cancel, resume):
        app.command()(fn)
