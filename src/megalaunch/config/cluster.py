"""The recipe's `cluster` section: where and how the job runs (Slurm options, the environment and
container, the backend's traits). Part of the recipe schema (config/schema.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from megalaunch.config.typed import doc

_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})$|^(\d+)$")


def parse_time_limit(text: str) -> int:
    """Slurm time ("D-HH:MM:SS", "HH:MM:SS" or minutes) -> seconds."""
    m = _TIME_RE.match(text.strip())
    if not m:
        raise ValueError(f"time {text!r} is not D-HH:MM:SS, HH:MM:SS or minutes")
    if m.group(5) is not None:
        return int(m.group(5)) * 60
    days = int(m.group(1) or 0)
    return days * 86400 + int(m.group(2)) * 3600 + int(m.group(3)) * 60 + int(m.group(4))


@dataclass(frozen=True, kw_only=True)
class ContainerConfig:
    """A container for the job's tasks (pyxis/enroot or a CSCS environment file)."""

    kind: Literal["none", "pyxis", "cscs"] = doc("none, pyxis (--container-image) or cscs (--environment)", "none")
    image: str | None = doc("pyxis: image (squashfs path or registry reference)", None, path="path")
    mounts: list[str] = doc("pyxis: SRC:DST mounts (SRC on the host is expanded, DST is not)", [], path="mount")
    workdir: str | None = doc("pyxis: working directory inside the container", None)
    environment: str | None = doc("cscs: environment definition file (.toml) or name", None, path="path")

    def __post_init__(self) -> None:
        if self.kind == "pyxis" and not self.image:
            raise ValueError("cluster.container.image is required when kind is pyxis")
        if self.kind == "cscs" and not self.environment:
            raise ValueError("cluster.container.environment is required when kind is cscs")


@dataclass(frozen=True, kw_only=True)
class SshConfig:
    """Where the commands on runs go when you work from a laptop (docs/remote.md). Read where you type
    the command, never in the job."""

    host: str | None = doc("the login node, as `ssh` takes it (user@login, an ~/.ssh/config alias, "
                           "ssh://user@host:port): submit, status, logs, trigger, cancel and resume run "
                           "there over SSH (null: here)", None)
    megalaunch: str = doc("the command that runs megalaunch on the login node (a name on its PATH, a "
                          "path, or words such as `env PYTHONPATH=/src /venv/bin/megalaunch`)", "megalaunch")

    def __post_init__(self) -> None:
        if self.host is not None and (not self.host or self.host.startswith("-") or any(c.isspace() for c in self.host)):
            raise ValueError(f"cluster.ssh.host must be a destination such as user@login, got {self.host!r}")
        if not self.megalaunch.strip():
            raise ValueError("cluster.ssh.megalaunch must name a command, e.g. megalaunch or /venv/bin/megalaunch")


@dataclass(frozen=True)
class BackendTraits:
    """What recipes and preflight need to know of a backend (its code: launcher/backends/registry.py)."""

    signal_delay_s: int  # how late the time-limit signal may come (slurmctld checks every 30 s)
    multi_node: bool
    job_script: bool  # segments run RUN/job.sbatch


BACKENDS = {"slurm": BackendTraits(signal_delay_s=30, multi_node=True, job_script=True),
            "local": BackendTraits(signal_delay_s=0, multi_node=False, job_script=False)}


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where and how the job runs."""

    backend: Literal["slurm", "local"] = doc("slurm (sbatch) or local (this machine)", "slurm")
    nodes: int = doc("nodes per segment", 1)
    spare_nodes: int = doc("nodes allocated beyond `nodes` (Slurm): each training step runs on `nodes` healthy ones "
                           "(node-health ledger, health check at start) and an in-job restart swaps a spare in for "
                           "the node that failed (chain.restarts_per_segment)", 0)
    min_nodes: int | None = doc("with no spare node left, an in-job restart after a lost or unhealthy node goes on "
                                "with fewer nodes, down to this many: the data-parallel size shrinks to the largest "
                                "the layout allows (global batch and consumed samples stay exact); the next segment "
                                "asks Slurm for all `nodes` again. null: the segment ends and its successor asks for a "
                                "replacement node", None)
    gpus_per_node: int = doc("GPUs per node (0: CPU-only)", 8)
    tasks_per_node: int | None = doc("tasks per node (default: gpus_per_node, or 1 on CPU)", None)
    cpus_per_task: int = doc("CPU cores per task", 8)
    mem: str | None = doc("memory per node (Slurm --mem, e.g. 0 for all or 200G)", None)
    time: str = doc("time limit per segment (HH:MM:SS or D-HH:MM:SS)", "04:00:00")
    partition: str | None = doc("Slurm partition", None)
    account: str | None = doc("Slurm account", None)
    qos: str | None = doc("Slurm QoS", None)
    reservation: str | None = doc("Slurm reservation", None)
    constraint: str | None = doc("Slurm node constraint", None)
    exclusive: bool = doc("whole nodes (--exclusive)", False)
    sbatch_extra: dict[str, str] = doc("extra #SBATCH options, name -> value (quoted)", {})
    modules: list[str] = doc("environment modules to load", [])
    venv: str | None = doc("Python virtual environment to activate", None, path="path")
    env: dict[str, str] = doc("environment variables to export (values, never secrets)", {})
    secret_env: list[str] = doc("names of variables that must be set in the submitting shell (W&B key...); "
                                "sbatch passes them on, no file holds them", [])
    container: ContainerConfig = doc("container settings", ContainerConfig())
    ssh: SshConfig = doc("submit and watch from another machine over SSH (docs/remote.md)", SshConfig())
    mail_user: str | None = doc("Slurm mails this address (#SBATCH --mail-user) about each training segment "
                                "(null: no mail; chain.notify tells about the whole chain)", None)
    mail_type: str = doc("which segment events Slurm mails (--mail-type, with mail_user): a comma-separated "
                         "list of NONE BEGIN END FAIL REQUEUE ALL TIME_LIMIT TIME_LIMIT_90 ...", "END,FAIL")
    python: str = doc("Python interpreter inside the job", "python3", path="path")
    megalaunch: str = doc("how the job invokes megalaunch (a command name or path)", "megalaunch", path="path")
    master_port: int | None = doc("rendezvous port (default: 20000 + job id mod 20000, so jobs sharing a "
                                  "node do not collide)", None)
    gpu: str | None = doc("GPU type, e.g. H100, H200, A100-40GB, GH200 (config/planner/gpus.py): preflight's memory check "
                          "and `megalaunch plan` use its memory and speed", None)
    gpu_memory_gb: float | None = doc("GPU memory in GiB, when cluster.gpu is unset or not in the table", None)
    gpu_peak_tflops: float | None = doc("dense bf16 peak TFLOP/s per GPU for MFU (default: from the GPU's name, "
                                        "docs/goodput.md)", None)
    node_health_dir: str | None = doc("the team's node-health ledger for this cluster: a shared directory the "
                                      "group can write (default: RUN_ROOT/.node-health)", None, path="path")
    suspect_ttl_h: float = doc("hours a node stays suspect after a failure attributed to it", 12.0)
    exclude_suspects: bool = doc("a failed segment's successor excludes the suspect nodes (Slurm)", True)
    health_check: bool | Literal["auto"] = doc(
        "a matmul + all-reduce check on every rank at segment start (~30 s at most): a slow or failing node "
        "ends the segment `unhealthy_node` and the successor excludes it; true/on, false/off, or auto: on "
        "with GPUs, off on the CPU", "auto")
    health_check_margin: float = doc(
        "a rank whose matmul TFLOP/s is below the job's median (or the team's recorded figure for the "
        "device) by more than this fraction is unhealthy (0.2: 20 % slower)", 0.2)
    straggler_threshold: float = doc(
        "`status` shows a segment's `stragglers:` line when the slowest rank's mean step time exceeds the "
        "median by more than this fraction (0.1: 10 %)", 0.1)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("cluster.nodes must be >= 1")
        if self.spare_nodes < 0:
            raise ValueError(f"cluster.spare_nodes must be >= 0, got {self.spare_nodes}; fix: --set cluster.spare_nodes=1")
        if self.spare_nodes and self.backend != "slurm":
            raise ValueError("cluster.spare_nodes needs backend: slurm (the local backend runs on this machine only); "
                             "fix: --set cluster.spare_nodes=0")
        if self.min_nodes is not None and not 1 <= self.min_nodes < self.nodes:
            raise ValueError(f"cluster.min_nodes must be from 1 to cluster.nodes - 1 = {self.nodes - 1}, got "
                             f"{self.min_nodes}; fix: --set cluster.min_nodes={max(1, self.nodes // 2)} (or null: "
                             "never shrink)")
        if self.min_nodes is not None and self.backend != "slurm":
            raise ValueError("cluster.min_nodes needs backend: slurm (the local backend runs on this machine only); "
                             "fix: --set cluster.min_nodes=null")
        if self.gpus_per_node < 0:
            raise ValueError("cluster.gpus_per_node must be >= 0")
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise ValueError("cluster.tasks_per_node must be >= 1")
        parse_time_limit(self.time)
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError("cluster.gpu_memory_gb must be > 0")
        if self.suspect_ttl_h <= 0:
            raise ValueError("cluster.suspect_ttl_h must be > 0")
        if not 0 < self.health_check_margin < 1:
            raise ValueError(f"cluster.health_check_margin must be a fraction between 0 and 1 (e.g. 0.2 for 20 %), "
                             f"got {self.health_check_margin}")
        if self.straggler_threshold <= 0:
            raise ValueError(f"cluster.straggler_threshold must be a fraction > 0 (e.g. 0.1 for 10 %), "
                             f"got {self.straggler_threshold}")
        for name in list(self.env) + list(self.secret_env):
            if not _ENV_RE.match(name):
                raise ValueError(f"cluster.env: {name!r} is not a valid environment variable name")

    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node or max(self.gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ntasks_per_node

    @property
    def time_limit_s(self) -> int:
        return parse_time_limit(self.time)

    @property
    def traits(self) -> BackendTraits:
        return BACKENDS[self.backend]
