"""Run a conversion as a Slurm job: the same `megalaunch convert ...` command, rendered into
OUT/convert.sbatch (logs in OUT/logs/) with the recipe's cluster settings, submitted through the
launcher's Slurm client."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from megalaunch.config.schema import Recipe
from megalaunch.rundir.paths import ConversionPaths


@dataclass(frozen=True)
class Submitted:
    job_id: str
    script: Path
    logs: Path


def render_script(recipe: Recipe, command: list[str], out: Path, *, gpus: int | None = None,
                  time_limit: str | None = None) -> str:
    """The job script for `megalaunch convert COMMAND...` (COMMAND without --submit, absolute paths)."""
    from megalaunch import __version__
    from megalaunch.launcher.prepare.render import render
    from megalaunch.launcher.prepare.sbatch import JobHeader, cluster_options, environment_context

    cl = recipe.cluster
    # Conversion needs no GPU; GPU clusters often refuse jobs without one, so take one there.
    default_gpus = 1 if cl.gpus_per_node > 0 else 0
    job = JobHeader(name=f"convert-{recipe.name}", log=str(ConversionPaths(out).logs / "%x-%j.out"),
                    log_from="the output directory (OUT)", time=time_limit or cl.time,
                    cpus_per_task=cl.cpus_per_task, gpus_per_node=default_gpus if gpus is None else gpus, mem=cl.mem,
                    options=cluster_options(cl))
    return render(
        "convert.sbatch.j2", version=__version__, created=time.strftime("%Y-%m-%d %H:%M:%S"),
        direction=command[0], out=str(out), script=str(ConversionPaths(out).job_script), job=job,
        **environment_context(cl, [str(out)]), command=command)


def submit(recipe: Recipe, command: list[str], out: Path, *, gpus: int | None = None,
           time_limit: str | None = None, slurm: object | None = None) -> Submitted:
    from megalaunch.launcher.backends.slurm import SlurmClient
    from megalaunch.rundir.files import atomic_write_text

    out = Path(out).absolute()
    paths = ConversionPaths(out)
    paths.logs.mkdir(parents=True, exist_ok=True)
    script = paths.job_script
    atomic_write_text(script, render_script(recipe, command, out, gpus=gpus, time_limit=time_limit))
    client = slurm or SlurmClient()
    job_id = client.sbatch(script, cwd=out)  # type: ignore[attr-defined]
    return Submitted(job_id, script, paths.logs)
