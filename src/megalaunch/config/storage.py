"""The disk budget at submit: a run's checkpoint peak (config/planner/checkpoint_size.py) against the free space
of the filesystem that will hold its checkpoints and, where the tools exist, the quota that applies.

Free space is statvfs of the checkpoint directory's nearest existing ancestor (the run root is created
at submit). Quotas: on Lustre `lfs quota -u USER MOUNT` (and `lfs df MOUNT`, whose fullest storage
target matters: a file striped on it fails mid-save while the filesystem as a whole has room),
elsewhere `quota -w`. Each tool runs with a short timeout; a missing tool, a timeout or output it
cannot read means "unknown", never a refusal. Not enough room: one PreflightError with the numbers
and the fixes, before anything is written or submitted (`checkpoint.disk_check: false` skips it)."""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import subprocess
from dataclasses import dataclass

from megalaunch.config.planner.checkpoint_size import DiskPeak, peak_lines, recipe_peak
from megalaunch.config.schema import Recipe
from megalaunch.errors import PreflightError
from megalaunch.runtime.rank.storage import Filesystem, filesystem_of, free_bytes, gb

TOOL_TIMEOUT_S = 5.0
KIB = 1024


@dataclass(frozen=True)
class Quota:
    source: str  # the command that said so
    used: int  # bytes
    limit: int  # bytes: the hard limit, else the soft one

    @property
    def left(self) -> int:
        return max(self.limit - self.used, 0)


def _run(cmd: list[str]) -> str | None:
    """stdout of `cmd`, or None when the tool is missing, fails or takes longer than TOOL_TIMEOUT_S."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def _kib(token: str) -> int | None:
    token = token.rstrip("*")  # '*': over the soft quota
    return int(token) * KIB if token.isdigit() else None


def _quota_from(tokens: list[str], source: str) -> Quota | None:
    """(used, soft, hard) in KiB, the first three numbers after the filesystem's name."""
    values = [_kib(t) for t in tokens[:3]]
    if len(values) < 3 or any(v is None for v in values):
        return None
    used, soft, hard = (v or 0 for v in values)
    limit = hard or soft
    return Quota(source, used, limit) if limit else None


def parse_lfs_quota(text: str, mount: str) -> Quota | None:
    """`lfs quota -u USER MOUNT`: the row of MOUNT (a long name wraps its numbers onto the next line)."""
    tokens = text.split()
    if mount not in tokens:
        return None
    return _quota_from(tokens[tokens.index(mount) + 1:], f"lfs quota {mount}")


def parse_quota(text: str, fs: Filesystem) -> Quota | None:
    """`quota -w` (Linux quota tools): the row whose filesystem is this mount's device or mount point."""
    for line in text.splitlines():
        tokens = line.split()
        if tokens and tokens[0] in (fs.device, fs.mount):
            return _quota_from(tokens[1:], f"quota ({tokens[0]})")
    return None


def parse_lfs_df(text: str) -> int | None:
    """`lfs df MOUNT`: the free bytes of its fullest object storage target (OST)."""
    free = [_kib(line.split()[3]) for line in text.splitlines() if "[OST:" in line and len(line.split()) >= 4]
    known = [f for f in free if f is not None]
    return min(known) if known else None


def probe_quota(fs: Filesystem, user: str) -> Quota | None:
    if fs.fstype == "lustre":
        out = _run(["lfs", "quota", "-u", user, fs.mount])
        return parse_lfs_quota(out, fs.mount) if out else None
    out = _run(["quota", "-w"])
    return parse_quota(out, fs) if out else None


@dataclass(frozen=True)
class DiskBudget:
    peak: DiskPeak
    directory: str  # where the checkpoints go
    filesystem: Filesystem
    free: int  # bytes free on it (statvfs)
    quota: Quota | None  # None: no quota, or unknown
    fullest_target_free: int | None = None  # Lustre: the fullest OST's free bytes

    @property
    def available(self) -> int:
        return min(self.free, self.quota.left) if self.quota is not None else self.free

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.available

    def room(self) -> str:
        """'filesystem /dev/sda1 (/scratch, ext4): 73.1 GB free, quota 20.0 GB left (lfs quota /scratch)'"""
        out = f"{self.filesystem.describe()}: {gb(self.free)} free"
        if self.quota is not None:
            out += f", quota {gb(self.quota.left)} left ({self.quota.source})"
        return out

    def lines(self) -> list[str]:
        """What plan, submit and the dry run show."""
        out = [*peak_lines(self.peak), f"disk: {self.room()}: " + ("fits" if self.fits else "DOES NOT FIT")]
        per_file = self.peak.checkpoint.total
        if self.fullest_target_free is not None and self.fullest_target_free < per_file:
            out.append(f"disk: the fullest storage target of {self.filesystem.mount} has "
                       f"{gb(self.fullest_target_free)} free: a checkpoint file striped on it alone can fill it "
                       f"mid-save (spread them: lfs setstripe -c -1 on the run root)")
        return out


def disk_budget(peak: DiskPeak, directory: str | os.PathLike[str], *, user: str | None = None) -> DiskBudget:
    """`peak` against the filesystem (and quota) of `directory`, which need not exist yet."""
    fs = filesystem_of(directory)
    try:
        user = user or getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    target = None
    if fs.fstype == "lustre":
        out = _run(["lfs", "df", fs.mount])
        target = parse_lfs_df(out) if out else None
    return DiskBudget(peak=peak, directory=str(directory), filesystem=fs, free=free_bytes(directory),
                      quota=probe_quota(fs, user), fullest_target_free=target)


def check_disk(recipe: Recipe, budget: DiskBudget, vocab_size: int | None) -> None:
    """Refuse a submit whose checkpoint peak does not fit, in one line with the numbers and the fixes."""
    if budget.fits or not recipe.checkpoint.disk_check:
        return
    fixes = []
    field = "run.root"
    keep = recipe.checkpoint.keep_last
    for n in range(keep - 1 if keep > 0 else 10, 0, -1):  # the largest keep_last that fits
        smaller = dataclasses.replace(recipe, checkpoint=dataclasses.replace(recipe.checkpoint, keep_last=n))
        alt = recipe_peak(smaller, vocab_size)
        if alt.total <= budget.available:
            fixes.append(f"--set checkpoint.keep_last={n} (peak {gb(alt.total)})")
            field = "checkpoint.keep_last"
            break
    if budget.peak.milestones:
        fixes.append("a larger checkpoint.milestone_interval (or 0)")
    fixes += [f"--set run.root=DIR on a filesystem with {gb(budget.peak.total)} free",
              "free space, or --set checkpoint.disk_check=false to submit anyway"]
    raise PreflightError(f"the checkpoints need up to {budget.peak.describe()}; but {budget.room()}",
                         field=field, valid=f"a peak within {gb(budget.available)}", fix="; ".join(fixes))

