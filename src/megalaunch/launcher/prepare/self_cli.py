"""Which megalaunch a job script runs: the recipe's `cluster.megalaunch` when it names one, else the
megalaunch that submits the run, by absolute path, so a job from an unactivated venv (or over SSH, whose
login shell never saw the venv) runs the same code and does not die on "megalaunch: command not found"."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

from megalaunch.config.loader import LoadedRecipe
from megalaunch.config.schema import Recipe
from megalaunch.errors import ConfigError

FIELD = "cluster.megalaunch"
ORIGIN = "the megalaunch that submitted the run"


def _executable(path: str | Path) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def submitting_megalaunch() -> str | None:
    """This process's megalaunch command, absolute: the console script it was started as, else the one
    beside its interpreter (`python -m megalaunch.cli.main` from a venv), else the one on PATH."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "megalaunch" and _executable(argv0):
        return os.path.abspath(argv0)
    beside = Path(sys.executable).parent / "megalaunch"  # not resolved: a venv's python is a link out of it
    if _executable(beside):
        return str(beside.absolute())
    found = shutil.which("megalaunch")
    return os.path.abspath(found) if found else None


def with_job_megalaunch(loaded: LoadedRecipe) -> LoadedRecipe:
    """`loaded` with cluster.megalaunch set to the submitting megalaunch when the recipe left it at its
    default and the backend runs job scripts (run.yaml then records it, for eval and conversion jobs too)."""
    cl = loaded.recipe.cluster
    if not cl.traits.job_script or loaded.origin(FIELD) != "default":
        return loaded
    path = submitting_megalaunch()
    if path is None:
        return loaded
    recipe = dataclasses.replace(loaded.recipe, cluster=dataclasses.replace(cl, megalaunch=path))
    return dataclasses.replace(loaded, recipe=recipe, provenance={**loaded.provenance, FIELD: ORIGIN})


def check_job_megalaunch(recipe: Recipe) -> None:
    """At submit: a megalaunch named by its path must be an executable file there (the job sees the same
    shared file system); a bare command name is looked up in the job's environment (venv, modules, image)."""
    cl = recipe.cluster
    if not cl.traits.job_script:
        return
    path = os.path.expanduser(cl.megalaunch)
    if os.sep in path and not _executable(path):
        raise ConfigError(f"{path} is not an executable file: the job script could not start megalaunch",
                          field=FIELD, valid="the path of a megalaunch command (e.g. /venv/bin/megalaunch)",
                          fix=f"install megalaunch there or name the right one: --set {FIELD}=$(command -v megalaunch)")
