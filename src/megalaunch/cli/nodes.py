"""`megalaunch nodes`: the team's node-health ledger (launcher/accounting/nodes.py): which nodes are suspect, on
what evidence, until when; `megalaunch nodes clear NODE` takes a node off the list."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from megalaunch.cli.output import emit_json, say

if TYPE_CHECKING:
    from megalaunch.launcher.accounting.nodes import NodeHealth

app = typer.Typer(no_args_is_help=False, invoke_without_command=True)

DirOpt = Annotated[str | None, typer.Option(
    "--run", "-r", metavar="RUN|DIR", help="A run directory (its cluster's ledger), or the node-health directory "
    "itself (default: ~/megalaunch-runs/.node-health, next to the default run root).")]


def _health(where: str | None) -> NodeHealth:
    """The ledger of a run's cluster, a node-health directory given as is, or the default one."""
    from megalaunch.errors import RunDirError
    from megalaunch.launcher.accounting.nodes import NodeHealth
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.runtime.rank.settings import RuntimeSettings

    if where is None:
        return NodeHealth(Path(os.path.expanduser("~/megalaunch-runs")) / ".node-health")
    p = Path(where).expanduser()
    if not (p / "runtime.json").is_file():
        if p.is_dir():
            return NodeHealth(p)
        from megalaunch.launcher.control import find_run

        p = find_run(where).root  # a run's name; a one-line error when there is none
    configured = RuntimeSettings.load(RunPaths(p)).node_health_dir
    if not configured:
        raise RunDirError(f"{p} was made before megalaunch kept a node-health ledger", field="--run",
                          fix="give the node-health directory itself")
    return NodeHealth(configured)


@app.callback()
def nodes(ctx: typer.Context, where: DirOpt = None,
          as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """List the suspect nodes: why, from which run and job, and when each expires."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = where
        return
    health = _health(where)
    now = time.time()
    active = health.active(now)
    if as_json:
        emit_json({"ledger": str(health.file), "suspects": [s.__dict__ for s in active.values()]})
        return
    if not active:
        say(f"no suspect nodes ({health.file})")
        return
    say(f"{len(active)} suspect node(s) ({health.file}):")
    for s in sorted(active.values(), key=lambda x: x.node):
        say(f"  {s.describe(now)}")
        for line in s.evidence:
            say(f"      {line}")
    say("next: megalaunch nodes clear NODE   (once a node is repaired)")


@app.command()
def clear(ctx: typer.Context,
          node: Annotated[list[str], typer.Argument(metavar="NODE...", help="Node name(s) to clear.")],
          where: DirOpt = None) -> None:
    """Take nodes off the suspect list (recorded in the ledger, with who did it)."""
    health = _health(where if where is not None else ctx.obj)
    active = health.active()
    for n in node:
        health.clear(n)
        say(f"cleared {n}" + ("" if n in active else " (it was not suspect)"))
