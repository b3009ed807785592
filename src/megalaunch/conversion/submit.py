"""Run a conversion as a Slurm job: the same `megalaunch convert ...` command, rendered into
OUT/convert.sbatch (logs in OUT/logs/) with the recipe's cluster settings, submitted through the
launcher's Slurm client."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from megalaunch.config.schema import Recipe


@dataclass(frozen=True)
class Submitted:
    job_id: str
    script: Path
    logs: Path


def render_script(recipe: Recipe, command: list[str], out: Path, *, gpus: int | None = None,
                  time_limit: str | None = None) -> str:
    """The job script for `megalaunch convert COMMAND...` (COMMAND without --submit, absolute paths)."""
    from megalaunch import __version__
    from megalaunch.launcher.render import render

    cl = recipe.cluster
    options = [{"name": k, "value": v} for k, v in (("partition", cl.partition), ("account", cl.account),
                                                   ("qos", cl.qos), ("reservation", cl.reservation),
                                                   ("constraint", cl.constraint)) if v]
    options += [{"name": k, "value": v} for k, v in sorted(cl.sbatch_extra.items())]
    srun_args: list[str] = []
    if cl.container.kind == "pyxis":
        mounts = [f"{out}:{out}", *cl.container.mounts]
        srun_args += [f"--container-image={cl.container.image}", f"--container-mounts={','.join(mounts)}"]
        if cl.container.workdir:
            srun_args.append(f"--container-workdir={cl.container.workdir}")
    elif cl.container.kind == "cscs":
        srun_args.append(f"--environment={os.path.expanduser(cl.container.environment or '')}")
    # Conversion needs no GPU; GPU clusters often refuse jobs without one, so take one there.
    default_gpus = 1 if cl.gpus_per_node > 0 else 0
    return render(
        "convert.sbatch.j2", version=__version__, created=time.strftime("%Y-%m-%d %H:%M:%S"),
        direction=command[0], out=str(out), script=str(out / "convert.sbatch"),
        job_name=f"convert-{recipe.name}", cpus_per_task=cl.cpus_per_task,
        gpus=default_gpus if gpus is None else gpus, mem=cl.mem, time=time_limit or cl.time,
        slurm_options=options, log_pattern=str(out / "logs" / "%x-%j.out"), modules=list(cl.modules),
        venv_activate=os.path.join(os.path.expanduser(cl.venv), "bin", "activate") if cl.venv else "",
        env=[{"name": k, "value": v} for k, v in sorted(cl.env.items())], srun_args=srun_args,
        megalaunch=os.path.expanduser(cl.megalaunch), command=command)


def submit(recipe: Recipe, command: list[str], out: Path, *, gpus: int | None = None,
           time_limit: str | None = None, slurm: object | None = None) -> Submitted:
    from megalaunch.launcher.slurm import SlurmClient
    from megalaunch.rundir.files import atomic_write_text

    out = Path(out).absolute()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    script = out / "convert.sbatch"
    atomic_write_text(script, render_script(recipe, command, out, gpus=gpus, time_limit=time_limit))
    client = slurm or SlurmClient()
    job_id = client.sbatch(script, cwd=out)  # type: ignore[attr-defined]
    return Submitted(job_id, script, out / "logs")
