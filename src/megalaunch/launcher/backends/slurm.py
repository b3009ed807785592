"""The one place that talks to Slurm. Every call has a timeout and turns failures into one-line
SlurmErrors (Slurm missing, controller down, request refused). Queries are batched: one `squeue`
for many jobs."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megalaunch.errors import SlurmError

DEFAULT_TIMEOUT_S = 30.0
# States in which a job still occupies or waits for the queue.
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                 "RESIZING", "SIGNALING", "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "STOPPED"}


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    name: str
    state: str
    reason: str
    user: str = ""
    time_used: str = ""
    nodes: str = ""
    batch_host: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


class SlurmClient:
    """Thin, typed wrapper over sbatch/squeue/scontrol/scancel."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def _run(self, argv: Sequence[str], *, check: bool = True, cwd: Path | None = None,
             stdin_text: str | None = None) -> subprocess.CompletedProcess[str]:
        exe = argv[0]
        if shutil.which(exe) is None:
            raise SlurmError(f"'{exe}' was not found on PATH: Slurm is not installed here",
                             fix="run on a Slurm login node, or use --backend local")
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=self.timeout_s, cwd=cwd,
                                  **({"input": stdin_text} if stdin_text is not None else {"stdin": subprocess.DEVNULL}))
        except subprocess.TimeoutExpired:
            raise SlurmError(f"'{' '.join(argv[:2])}' did not answer within {self.timeout_s:.0f} s: "
                             "the Slurm controller is slow or down", fix="retry later; check `sinfo`") from None
        if check and proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip().splitlines()
            detail = msg[-1] if msg else f"exit code {proc.returncode}"
            raise SlurmError(f"{exe} failed: {detail}")
        return proc

    def check_available(self) -> None:
        """Slurm's client tools are installed and answer."""
        self._run(["sinfo", "--version"])

    def sbatch(self, script: Path, extra_args: Iterable[str] = (), *, cwd: Path | None = None,
               env: dict[str, str] | None = None, text: str | None = None) -> str:
        """Submit `script`; returns the job id. `--parsable` prints `id[;cluster]`. With `text`, sbatch reads
        the script from its standard input instead: the bytes the caller checked are the ones that run
        (`script` then only names it in errors)."""
        argv = ["sbatch", "--parsable", *extra_args, *([] if text is not None else [str(script)])]
        if env is not None:
            argv.insert(1, "--export=ALL," + ",".join(f"{k}={v}" for k, v in env.items()))
        proc = self._run(argv, cwd=cwd, stdin_text=text)
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.split("_")[0].isdigit():
            raise SlurmError(f"sbatch printed no job id: {proc.stdout.strip()!r}")
        return job_id

    def squeue(self, job_ids: Iterable[str] = (), *, me: bool = False, name: str | None = None) -> dict[str, JobInfo]:
        """Active jobs, one call. With job ids: only those; with a name: every job of that name (any
        user: a chain's name is unique); with me=True: all of the user's jobs."""
        fmt = "%i|%j|%T|%r|%u|%M|%N"
        ids = [str(j) for j in job_ids]
        argv = ["squeue", "-h", "-o", fmt]
        if ids:
            argv += ["-j", ",".join(ids)]
        elif name:
            argv += ["--name", name]
        elif me:
            argv += ["-u", _user()]
        else:
            return {}
        proc = self._run(argv, check=False)
        if proc.returncode != 0:
            # squeue errors on ids it has forgotten ("Invalid job id"); treat as none active.
            if "Invalid job id" in proc.stderr:
                return {}
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise SlurmError(f"squeue failed: {detail[-1] if detail else proc.returncode}",
                             fix="check that slurmctld is up (`sinfo`)")
        out = {}
        for line in proc.stdout.splitlines():
            parts = line.split("|")
            if len(parts) < 7:
                continue
            info = JobInfo(job_id=parts[0], name=parts[1], state=parts[2], reason=parts[3],
                           user=parts[4], time_used=parts[5], nodes=parts[6])
            out[info.job_id] = info
        return out

    def job_state(self, job_id: str) -> JobInfo | None:
        """State of one job, finished ones included while slurmctld remembers them (MinJobAge)."""
        proc = self._run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        if proc.returncode != 0:
            return None
        fields = _parse_scontrol(proc.stdout)
        return JobInfo(job_id=fields.get("JobId", str(job_id)), name=fields.get("JobName", ""),
                       state=fields.get("JobState", "UNKNOWN"), reason=fields.get("Reason", ""),
                       user=fields.get("UserId", "").split("(")[0], time_used=fields.get("RunTime", ""),
                       nodes=fields.get("NodeList", ""), batch_host=fields.get("BatchHost", ""))

    def node_names(self, partition: str | None = None) -> list[str]:
        """Every node Slurm lists (in `partition`, if given), down or drained ones included."""
        argv = ["sinfo", "-h", "-o", "%N", *(["-p", partition] if partition else [])]
        from megalaunch.rundir.hostlist import expand_hostlist

        names: list[str] = []
        for line in self._run(argv).stdout.split():
            names += [n for n in expand_hostlist(line) if n not in names]
        return names

    def exclude_nodes(self, job_id: str, nodes: Iterable[str]) -> None:
        """Set a pending job's excluded nodes (replaces its previous list)."""
        self._run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"])

    def scancel(self, job_ids: Iterable[str], *, signal: str | None = None, batch: bool = False) -> None:
        ids = [str(j) for j in job_ids]
        if not ids:
            return
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        self._run([*argv, *ids])


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _parse_scontrol(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for token in text.split():
        if "=" in token:
            k, v = token.split("=", 1)
            out.setdefault(k, v)
    return out
