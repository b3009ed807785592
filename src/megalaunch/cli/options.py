"""Options that several commands share, defined once."""

from __future__ import annotations

from typing import Annotated

import typer

SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                  help="Override a recipe value, e.g. training.lr=3e-4 (repeatable).")]
ClusterOpt = Annotated[str | None, typer.Option("--cluster", help="Cluster profile merged over the recipe "
                                                "(e.g. slurm, pyxis, cscs, modules, local).")]
RunArg = Annotated[str, typer.Argument(help="Run directory or name.")]
