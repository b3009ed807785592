"""`megalaunch report RUN`: the chain's goodput report as one HTML page with PNG figures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from megalaunch.cli.options import RunArg
from megalaunch.cli.output import say, warn


def report(
    run: RunArg,
    out: Annotated[Path | None, typer.Option("--out", metavar="DIR", help="Where to write report.html and its "
                                             "figures (default: RUN/report/, or ./<chain>-report/ if you "
                                             "cannot write in the run directory).")] = None,
    open_: Annotated[bool, typer.Option("--open", help="Open the report in a web browser.")] = False,
) -> None:
    """Write the chain's report: loss, throughput and MFU, the timeline of segments, goodput, checkpoints,
    triggers and a checkpoint-interval suggestion (needs the `report` extra: matplotlib)."""
    from megalaunch.errors import require
    from megalaunch.launcher.control import find_run
    from megalaunch.launcher.report.write import write_report

    paths = find_run(run)
    require("matplotlib", "report")
    result = write_report(paths, out.expanduser() if out is not None else None)
    if result.out_note:
        warn(f"note: {result.out_note}")
    say(str(result.html))
    say(result.summary)
    if open_:
        import webbrowser

        if not webbrowser.open(result.html.resolve().as_uri()):
            warn(f"no web browser found here; open {result.html} yourself")


def register(app: typer.Typer) -> None:
    app.command()(report)
