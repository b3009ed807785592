"""Helpers for tests against the local Slurm cluster started by ``.ci/slurm-up``.

Standard library only. The cluster uses the default ``/etc/slurm/slurm.conf``, so the
Slurm client tools need no ``SLURM_CONF``. Users: ``mlalice``/``mlbob`` (group ``mlteam``),
``mleve`` (not in ``mlteam``); run commands as them with :func:`run_as` (the test process
must be root, or have password-less sudo).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

#: States after which a job never runs again (``GONE``: no longer known to slurmctld).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "GONE",
    }
)

_USABLE_NODE_STATES = ("idle", "mixed", "allocated", "completing")


def cluster_available(timeout: float = 5.0) -> bool:
    """True when ``sinfo`` answers within *timeout* s and shows at least one usable node."""
    if shutil.which("sinfo") is None:
        return False
    try:
        res = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (subprocess.TimeoutExpired, OSError):
        return False
    if res.returncode != 0:
        return False
    # A trailing "*" (or other flag char) means the node does not respond.
    return any(line.strip() in _USABLE_NODE_STATES for line in res.stdout.splitlines())


def wait_for[T](
    predicate: Callable[[], T], timeout: float, interval: float = 0.5, what: str = "condition"
) -> T:
    """Poll *predicate* until it returns something truthy; return that value.

    Raises ``AssertionError`` naming *what* after *timeout* seconds.
    """
    deadline = time.monotonic() + timeout
    heal_at = time.monotonic() + DRAIN_CHECK_S
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; {cluster_snapshot()}")
        if time.monotonic() >= heal_at:  # a drain mid-test would hold this very wait (the hang test, twice)
            resume_kill_task_drains(f"a wait for {what}")
            heal_at = time.monotonic() + DRAIN_CHECK_S
        time.sleep(interval)


DRAIN_CHECK_S = 10.0


def resume_kill_task_drains(test: str) -> None:
    """A node that Slurm drained "Kill task failed" (slurmstepd gave up on a task that outlived its
    SIGKILL by UnkillableStepTimeout) stays out of service until an administrator resumes it: every later
    wait for it would be in vain (one CI run lost five tests so). Resume it, and warn, naming the test or
    wait during which it happened (the warning shows in pytest's summary). Called before and after every
    test on the shared cluster (tests/slurm/conftest.py) and every 10 s of a `wait_for`; not on the scale
    cluster, whose tests kill nodes on purpose and resume what that drains themselves."""
    if os.environ.get("SLURM_CONF") == str(PRIVATE_CONFS["scale"]):
        return
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N|%T|%E"], capture_output=True, text=True,
                             timeout=15).stdout
    except (subprocess.TimeoutExpired, OSError):
        return
    drained = sorted({name for name, state, reason in (line.split("|", 2) for line in out.splitlines()
                                                        if line.count("|") == 2)
                      if state.startswith("drain") and "Kill task failed" in reason})
    if not drained:
        return
    subprocess.run(["scontrol", "update", f"nodename={','.join(drained)}", "state=resume"], capture_output=True,
                   timeout=15)
    warnings.warn(f"Slurm drained {', '.join(drained)} 'Kill task failed' during {test} (a task outlived "
                  "SIGKILL by UnkillableStepTimeout); resumed", stacklevel=1)


def cluster_snapshot() -> str:
    """One line of what Slurm shows now (the nodes that are not idle, with their reasons; the queue), for a
    failed wait's message: CI keeps little more than the assertion."""
    parts = []
    for label, cmd in (("nodes not idle", ["sinfo", "-h", "-N", "-o", "%N %T %E"]),
                       ("queue", ["squeue", "-h", "-o", "%i %u %T %r %N"])):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        except (subprocess.TimeoutExpired, OSError) as e:
            out = f"({type(e).__name__})"
        lines = sorted({line.strip() for line in out.splitlines()
                        if line.strip() and (label == "queue" or line.split()[1:2] != ["idle"])})
        parts.append(f"{label}: " + (" | ".join(lines[:12]) or "-") + (f" | +{len(lines) - 12}" if len(lines) > 12 else ""))
    return "; ".join(parts)


def show_job(job_id: str | int) -> dict[str, str]:
    """``scontrol -o show job`` as a dict (empty when the job is unknown)."""
    res = subprocess.run(
        ["scontrol", "-o", "show", "job", str(job_id)],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )
    if res.returncode != 0 or not res.stdout.strip():
        return {}
    line = res.stdout.splitlines()[0]
    # Values may contain spaces only in a few fields (Command, WorkDir...); split on " Key=".
    fields: dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=(\S*)", line):
        fields.setdefault(m.group(1), m.group(2))
    return fields


def job_state(job_id: str | int) -> str:
    """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``TIMEOUT``, ``CANCELLED``...).

    ``GONE`` when slurmctld no longer knows it (purged after MinJobAge, or never existed).
    """
    state = show_job(job_id).get("JobState")
    return state if state else "GONE"


def wait_job_done(job_id: str | int, timeout: float, interval: float = 0.5) -> str:
    """Wait until the job reaches a terminal state; return it."""
    result: list[str] = []

    def done() -> bool:
        st = job_state(job_id)
        result[:] = [st]
        return st in TERMINAL_STATES

    try:
        wait_for(done, timeout, interval, what=f"job {job_id} to finish")
    except AssertionError as exc:
        raise AssertionError(f"{exc} (last state {result[0] if result else '?'})") from None
    return result[0]


def queue_ids(name: str | None = None, user: str | None = None) -> list[str]:
    """Job ids in ``squeue`` (optionally only those named *name* / owned by *user*)."""
    argv = ["squeue", "-h", "-o", "%i"]
    if name is not None:
        argv += ["--name", name]
    if user is not None:
        argv += ["--user", user]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=15, check=True)
    return [line.strip() for line in res.stdout.splitlines() if line.strip()]


def _env_for(user: str, env: Mapping[str, str] | None) -> dict[str, str]:
    home = os.path.expanduser(f"~{user}")
    base = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": home,
        "USER": user,
        "LOGNAME": user,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
    }
    for key in ("SLURM_CONF", "TZ"):
        if key in os.environ:
            base[key] = os.environ[key]
    base.update(env or {})
    return base


def run_as(
    user: str | None,
    argv: Iterable[str],
    env: Mapping[str, str] | None = None,
    *,
    check: bool = False,
    timeout: float = 60,
    **kw: Any,
) -> subprocess.CompletedProcess[str]:
    """Run *argv* as *user* with a clean environment: PATH, HOME, USER, LOGNAME, LANG,
    SLURM_CONF (if set) plus *env*. Returns the CompletedProcess (text, output captured).

    ``user=None`` or the current user runs directly (still with that clean environment).
    As root this uses ``runuser -u USER --``; otherwise ``sudo -n -u USER``.
    Pass ``cwd=`` a directory the user can reach (see the ``slurm_tmp`` fixture).
    """
    argv = [str(a) for a in argv]
    me = getpass.getuser()
    target = user or me
    envv = [f"{k}={v}" for k, v in _env_for(target, env).items()]
    if target == me:
        cmd = ["env", "-i", *envv, *argv]
    elif os.geteuid() == 0:
        cmd = ["runuser", "-u", target, "--", "env", "-i", *envv, *argv]
    else:
        cmd = ["sudo", "-n", "-u", target, "--", "env", "-i", *envv, *argv]
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run(cmd, check=check, timeout=timeout, **kw)


def sbatch(
    args: Iterable[str],
    user: str | None = None,
    env: Mapping[str, str] | None = None,
    **kw: Any,
) -> str:
    """``sbatch --parsable ARGS`` (as *user*); return the job id, raise with stderr on failure."""
    args = [str(a) for a in args]
    res = run_as(user, ["sbatch", "--parsable", *args], env, **kw)
    if res.returncode != 0:
        raise AssertionError(f"sbatch {args} as {user or 'self'} failed: {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]


SLURM_STATE = Path(os.environ.get("MEGALAUNCH_SLURM_STATE", "/var/lib/megalaunch-ci-slurm"))
#: The other clusters of .ci/slurm-up, for tests that stop the controller ("ctld") or take whole nodes
#: away ("nodes"): the `private_cluster` marker, tests/slurm/conftest.py. Same node names and layout,
#: daemons of their own. "scale": the many-node cluster (snode[1-N], `.ci/slurm-up scale`, booted on
#: demand by the fixture) whose nodes tests kill (tests/slurm/scale.py).
PRIVATE_CONFS = {
    "ctld": Path("/etc/slurm-iso/slurm.conf"),
    "nodes": Path("/etc/slurm-iso2/slurm.conf"),
    "scale": Path("/etc/slurm-scale/slurm.conf"),
}
#: Private clusters that .ci/slurm-up starts only when asked (`.ci/slurm-up NAME`): the fixture boots them.
ON_DEMAND = {"scale": "scale"}


def slurm_conf() -> Path:
    """The configuration of the cluster this test talks to (SLURM_CONF, else Slurm's default)."""
    return Path(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf")


def _ctld_pidfile() -> Path:
    for line in slurm_conf().read_text().splitlines():
        if line.startswith("SlurmctldPidFile="):
            return Path(line.split("=", 1)[1].strip())
    return SLURM_STATE / "run" / "slurmctld.pid"


def stop_slurmctld() -> None:
    pid = int(_ctld_pidfile().read_text())
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z",
             30, interval=0.2, what="slurmctld to stop")


def start_slurmctld() -> None:
    """Start the controller again from its saved state (running jobs and the queue survive)."""
    subprocess.run(["slurmctld", "-f", str(slurm_conf())], check=True, capture_output=True, timeout=60)

    def up() -> bool:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
        return "is UP" in ping.stdout

    wait_for(up, 60, interval=0.5, what="slurmctld to answer again")
