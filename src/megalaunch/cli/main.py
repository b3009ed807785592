"""The `megalaunch` command. One error boundary: a MegalaunchError prints one line and exits
non-zero; `--debug` shows the traceback."""

from __future__ import annotations

import copy
import functools
import importlib
import os
import sys
from typing import Annotated

import typer

from megalaunch import __version__
from megalaunch.cli import job, plan, recipes, report, run
from megalaunch.errors import MegalaunchError

app = typer.Typer(
    name="megalaunch",
    help="Launch and babysit Megatron-core training chains on Slurm clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
run.register(app)
report.register(app)
plan.register(app)
app.add_typer(recipes.app, name="recipes", help="List, show and validate recipes.")
app.add_typer(job.app, name="job", help="Called by the job script inside each segment (not by hand).")
for _name, _help in (("tokenize", "Tokenize raw text into Megatron .bin/.idx with datatrove."),
                     ("data", "Check datasets, build data blends and mixtures."),
                     ("convert", "Convert checkpoints between Hugging Face and Megatron-core."),
                     ("nodes", "Suspect nodes of the team's node-health ledger (list, clear)."),
                     ("eval", "Evaluate checkpoints (held-out perplexity, tasks): eval RUN, eval status RUN.")):
    app.add_typer(importlib.import_module(f"megalaunch.cli.{_name}").app, name=_name, help=_help)


def _version(value: bool) -> None:
    if value:
        print(f"megalaunch {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
    host: Annotated[str | None, typer.Option("--host", metavar="USER@LOGIN", help=(
        "Run submit, status, logs, trigger, cancel or resume on this login node over SSH (anywhere on the "
        "line; also MEGALAUNCH_HOST or cluster.ssh.host; `local`: here). docs/remote.md"))] = None,
) -> None:
    if debug:
        os.environ["MEGALAUNCH_DEBUG"] = "1"


@app.command("remote-side", hidden=True)
def _remote_side() -> None:
    """The login node's half of `--host` (the laptop's ssh starts it; docs/remote.md)."""
    from megalaunch.remote.server import serve

    raise typer.Exit(serve(_run_here, _params, sys.stdin.buffer, sys.stdout.buffer))


@functools.cache
def _cli(word: str | None = None) -> typer.core.TyperGroup:
    """The command tree, built once per process: routing reads the commands' options from it and then runs
    it. Only `word`'s command or group when `word` names one (building every command's parameters from
    its signature costs ~50 ms that a login node's `status` need not pay); the whole tree otherwise (help,
    a misspelt command's suggestions)."""
    tree = copy.copy(app)
    commands = [c for c in app.registered_commands if _command_name(c) == word]
    groups = [g for g in app.registered_groups if g.name == word]
    if commands or groups:
        tree.registered_commands, tree.registered_groups = commands, groups
    return typer.main.get_command(tree)  # type: ignore[return-value]


def _command_name(info: typer.models.CommandInfo) -> str:
    return info.name or (info.callback.__name__.lower().replace("_", "-") if info.callback else "")


def _command_word(args: list[str]) -> str | None:
    """The command a line names: its first word that is neither an option nor the value of --host."""
    skip = False
    for w in args:
        if skip:
            skip = False
        elif w == "--host":
            skip = True
        elif not w.startswith("-"):
            return w
    return None


def _value_options(command: str) -> set[str]:
    """`command`'s options that take a value, from its own definition."""
    cmd = _cli(command).commands[command]
    return {o for p in cmd.params if getattr(p, "param_type_name", "") == "option" and not getattr(p, "is_flag", False)
            and not getattr(p, "count", False) for o in (*p.opts, *p.secondary_opts)}


def _params(argv: list[str]) -> tuple[str, dict[str, object]] | None:
    """(command, its parameters) as the command itself parses `argv`; None when they do not parse."""
    try:
        i = next(i for i, w in enumerate(argv) if not w.startswith("-"))
        cmd = _cli(argv[i]).commands[argv[i]]
        return argv[i], dict(cmd.make_context(argv[i], argv[i + 1:], resilient_parsing=True).params)
    except Exception:
        return None


def _run_here(argv: list[str], via: str | None = None) -> int:
    from megalaunch.cli import output

    output.VIA_HOST = via  # the hints it prints name the host the laptop used
    try:
        main(argv, remote=False)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    return 0


def _remote(args: list[str]) -> list[str]:
    """Runs the command on the login node and exits with its status, or returns the words to run here."""
    from megalaunch.remote.route import route

    target, rest = route(args, _value_options)
    if target is None:
        return rest
    from megalaunch.remote.client import run_remote
    from megalaunch.remote.ship import build_request

    sys.exit(run_remote(target, build_request(rest, _value_options("submit"))))


def main(argv: list[str] | None = None, *, remote: bool = True) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("MEGALAUNCH_DEBUG") == "1"
    try:
        args = _remote(args) if remote else args
        code = _cli(_command_word(args)).main(args=args, standalone_mode=False)
        if isinstance(code, int) and code:  # typer.Exit(N) comes back as N when not standalone
            sys.exit(code)
    except MegalaunchError as e:
        if debug:
            raise
        print(f"megalaunch: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("megalaunch: aborted", file=sys.stderr)
        sys.exit(130)
    except PermissionError as e:
        if debug:
            raise
        print(f"megalaunch: error: permission denied: {e.filename or e} | fix: check that you are in the "
              "run's group (`id -Gn`) or use a directory you can write", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("megalaunch: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            # a usage error (unknown option, missing argument, bad choice). Duck-typed: typer >= 0.28
            # vendors Click, older typer depends on it; neither is imported here.
            _usage_error(e)
        if debug:
            raise
        print(f"megalaunch: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              "(run with --debug for the traceback)", file=sys.stderr)
        sys.exit(1)


def _usage_error(e: Exception) -> None:
    """Two lines: what was wrong and where the help is (a bare command still shows its help)."""
    if type(e).__name__ == "NoArgsIsHelpError":
        e.show()  # type: ignore[attr-defined]
    else:
        ctx = getattr(e, "ctx", None)
        message = e.format_message() if callable(getattr(e, "format_message", None)) else str(e)  # type: ignore[attr-defined]
        print(f"megalaunch: error: {' '.join(message.split())}", file=sys.stderr)
        print(f"see: {getattr(ctx, 'command_path', 'megalaunch') or 'megalaunch'} --help", file=sys.stderr)
    sys.exit(e.exit_code)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
