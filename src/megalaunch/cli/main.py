"""The `megalaunch` command. One error boundary: a MegalaunchError prints one line and exits
non-zero; `--debug` shows the traceback."""

from __future__ import annotations

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
) -> None:
    if debug:
        os.environ["MEGALAUNCH_DEBUG"] = "1"


def main(argv: list[str] | None = None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:]) or os.environ.get("MEGALAUNCH_DEBUG") == "1"
    try:
        app(args=argv, standalone_mode=False)
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
