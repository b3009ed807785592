"""One builder from a cluster profile to what every job script needs: the #SBATCH header (rendered by
the shared partial templates/_header.sbatch.j2) and the environment and container context (modules,
venv, exported variables, srun's container flags). Training, tokenization and conversion jobs use it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from megalaunch.config.cluster import ClusterConfig
from megalaunch.errors import ConfigError

# Options megalaunch sets itself; `cluster.sbatch_extra` may not name them.
MANAGED_SBATCH = {"job-name", "nodes", "ntasks-per-node", "ntasks", "cpus-per-task", "gpus-per-node", "mem",
                  "time", "signal", "requeue", "no-requeue", "output", "error", "open-mode", "dependency",
                  "partition", "account", "qos", "reservation", "constraint", "exclusive", "array"}


@dataclass(frozen=True, kw_only=True)
class JobHeader:
    """The #SBATCH lines of one job script (templates/_header.sbatch.j2)."""

    name: str
    log: str  # --output and --error (Slurm's %x, %j, %A, %a patterns)
    time: str
    cpus_per_task: int
    nodes: int = 1
    ntasks_per_node: int | None = None  # None: one task in all (--ntasks=1)
    gpus_per_node: int = 0
    mem: str | None = None
    options: list[dict[str, str]] = field(default_factory=list)
    exclusive: bool = False
    no_kill: bool = False  # --no-kill: a node that dies leaves the job running on the others (spares, min_nodes)
    signal: str | None = None  # e.g. USR2@61
    append: bool = False  # --open-mode=append (every segment of a chain appends to its own log)
    log_from: str = "the run directory"  # what the user set that the log path derives from (for errors)
    mail_user: str | None = None  # #SBATCH --mail-user (config/notify.py checked it)
    mail_type: str = "END,FAIL"

    def __post_init__(self) -> None:
        from megalaunch.config.values import SBATCH_SAFE

        if not SBATCH_SAFE.match(self.log):
            directory = self.log.rsplit("/logs/", 1)[0]
            raise ConfigError(f"{directory!r}: the job's log under it goes into #SBATCH --output, which cannot hold "
                              "spaces, quotes, $, ; or newlines", field=self.log_from,
                              valid="a directory path of letters, digits and . _ , : = @ / + % - [ ]",
                              fix=f"choose {self.log_from} without those characters (e.g. a symlink to the directory)")


def home(path: str | None) -> str:
    """Expand a leading ~ at render time: inside quotes the shell would not."""
    return os.path.expanduser(path) if path else ""


def sbatch_options(partition: str | None = None, account: str | None = None, qos: str | None = None,
                   reservation: str | None = None, constraint: str | None = None,
                   extra: dict[str, str] | None = None, field_prefix: str = "cluster.sbatch_extra",
                   reserved: frozenset[str] | set[str] = frozenset()) -> list[dict[str, str]]:
    """The named scheduling options that are set, then the free-form ones (sorted), checked: none
    may be one megalaunch sets itself (MANAGED_SBATCH), except those in `reserved` (the caller has
    no field of its own for them)."""
    named = {"partition": partition, "account": account, "qos": qos, "reservation": reservation,
             "constraint": constraint}
    options = [{"name": k, "value": str(v)} for k, v in named.items() if v]
    for name, value in sorted((extra or {}).items()):
        if (name in MANAGED_SBATCH and name not in reserved) or not name.replace("-", "").isalnum():
            raise ConfigError(f"'{name}' is set by megalaunch or is not an sbatch option name",
                              field=f"{field_prefix}.{name}", fix="use the dedicated recipe field")
        options.append({"name": name, "value": str(value)})
    return options


def cluster_options(cl: ClusterConfig) -> list[dict[str, str]]:
    return sbatch_options(cl.partition, cl.account, cl.qos, cl.reservation, cl.constraint, cl.sbatch_extra)


def environment_context(cl: ClusterConfig, mounts: list[str]) -> dict[str, Any]:
    """Modules, venv, exported variables and srun's container flags; `mounts` are the directories the
    job writes (bound into a pyxis container at the same path)."""
    srun_args: list[str] = []
    co = cl.container
    if co.kind == "pyxis":
        binds = [*(f"{m}:{m}" for m in mounts), *co.mounts]
        srun_args += [f"--container-image={co.image}", f"--container-mounts={','.join(binds)}"]
        if co.workdir:
            srun_args.append(f"--container-workdir={co.workdir}")
    elif co.kind == "cscs":
        srun_args.append(f"--environment={home(co.environment)}")
    return {
        "modules": list(cl.modules), "venv": cl.venv,
        "venv_activate": os.path.join(home(cl.venv), "bin", "activate") if cl.venv else "",
        "env": [{"name": k, "value": v} for k, v in sorted(cl.env.items())],
        "srun_args": srun_args, "megalaunch": home(cl.megalaunch),
    }
