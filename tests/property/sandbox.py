"""Run a rendered job script for real, inertly: PATH holds only recording stand-ins for every command
the templates call (each appends its argv, NUL-separated, to a log and exits 0), HOME and the working
directory are inside a temporary sandbox, and the environment is what a Slurm job would see."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Everything the templates (and a shell snippet in them) call; `head` and `env` are the real ones.
STUBS = ("srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "python", "python3", "megalaunch",
         "module", "enroot", "nsys", "hostname", "ml")
REAL = ("head", "env", "cat")
SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "prop", "SLURM_JOB_NODELIST": "node[1]",
             "SLURM_NNODES": "1", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "0", "SLURM_CLUSTER_NAME": "prop"}


def _stub_body(name: str, log: Path) -> str:
    # argv, NUL-separated, one file per call (ordered by time); srun also records its environment.
    # Written aside and renamed: a stub killed mid-call (the job script stops its background hang
    # watcher) leaves no half-written record, only a `.part` that `calls` does not read.
    record = (f'f={_q(str(log))}/{name}.${{EPOCHREALTIME/[.,]/}}.$$\n'
              'printf "%s\\0" "$@" > "$f.part" && /bin/mv -f "$f.part" "$f.argv"\n')
    if name == "srun":
        record += '/usr/bin/env -0 > "$f.env"\n'
    if name == "scontrol":
        record += "echo node1\n"
    if name == "hostname":
        record += "echo node1\n"
    if name in ("megalaunch", "custom"):  # the job script's `job step-nodes` names the step's nodes
        record += 'if [ "$1" = job ] && [ "$2" = step-nodes ]; then echo node1; fi\n'
    return "#!/bin/bash\n" + record + "exit 0\n"


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


@dataclass
class Sandbox:
    root: Path
    bin: Path = field(init=False)
    log: Path = field(init=False)
    home: Path = field(init=False)
    work: Path = field(init=False)

    def __post_init__(self) -> None:
        self.bin, self.log, self.home, self.work = (self.root / d for d in ("bin", "log", "home", "work"))
        for d in (self.bin, self.log, self.home, self.work, self.root / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        for name in STUBS:
            self.stub(self.bin / name, name)
        for name in REAL:
            real = shutil.which(name, path="/usr/bin:/bin")
            assert real, name
            (self.bin / name).symlink_to(real)

    def stub(self, path: Path, name: str) -> None:
        path.write_text(_stub_body(name, self.log))
        path.chmod(path.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP)

    def inside(self, path: str | Path) -> Path | None:
        """`path` as the job's shell resolves it (relative to the working directory), if it lies in the sandbox."""
        try:
            p = Path(os.path.normpath(self.work / path))
        except ValueError:  # NUL
            return None
        return p if p.is_relative_to(self.root) and p != self.root else None

    def make_command(self, command: str, name: str = "custom") -> bool:
        """Make `command` (as a job script invokes it) exist as a recording stub; False when it cannot
        (it would resolve outside the sandbox, or is not a possible file name)."""
        if not command or "\0" in command or command.endswith("/"):  # "x/" names a directory
            return False
        if "/" not in command:
            target: Path | None = self.bin / command
            if command in (".", "..") or command in REAL:
                return False
        else:
            target = self.inside(command)
        if target is None:
            return False
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_dir():
                return False
            if not target.exists():
                self.stub(target, name)
        except (OSError, ValueError):
            return False
        return os.access(target, os.X_OK)

    def make_file(self, path: str, content: str) -> bool:
        target = self.inside(path)
        if target is None:
            return False
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        except (OSError, ValueError):
            return False
        return True

    def run(self, script_text: str, timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
        script = self.root / "job.sbatch"
        script.write_text(script_text)
        env = {"PATH": str(self.bin), "HOME": str(self.home), "TMPDIR": str(self.root / "tmp"), "LC_ALL": "C.UTF-8",
               **SLURM_ENV, "SLURM_SUBMIT_DIR": str(self.work)}
        return subprocess.run(["/bin/bash", str(script)], env=env, cwd=self.work, capture_output=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def calls(self, name: str) -> list[list[str]]:
        """argv of each call to stub `name` (custom stubs are called 'custom'), in order."""
        files = sorted(self.log.glob(f"{name}.*.argv"), key=lambda p: int(p.name.split(".")[1]))
        return [p.read_bytes().decode("utf-8", "surrogateescape").split("\0")[:-1] for p in files]

    def srun_env(self) -> dict[str, str]:
        files = sorted(self.log.glob("srun.*.env"))
        if not files:
            return {}
        out = {}
        for kv in files[-1].read_bytes().decode("utf-8", "surrogateescape").split("\0"):
            if "=" in kv:
                k, v = kv.split("=", 1)
                out[k] = v
        return out
