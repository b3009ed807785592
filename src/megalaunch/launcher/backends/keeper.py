"""The keeper: a one-task step on the allocation's last node that ends a job whose batch host died.

Why: a job with `--no-kill` (spares, `cluster.min_nodes`) survives the death of any node but the one that
runs its script. When that one dies, Slurm 22.05 takes it out of the job and keeps the job RUNNING on the
others with nothing left to run (measured on the scale cluster: still RUNNING minutes later, until its
time limit), and the successor, queued `--dependency=singleton`, waits behind it: a whole segment of the
allocation lost, and nothing in the job left to notice. Steps on the other nodes keep running (srun's own
death does not end them), so the job script starts this keeper beside the training step
(templates/train.sbatch.j2, with `--no-kill` and more than one node).

Every POLL_S it asks Slurm about its job (one `scontrol show job`, with a timeout; no answer: ask again).
Slurm's verdict comes late: the node is DOWN after `SlurmdTimeout` (300 s by default) and its pings. So every
TICK_S it also reads the batch host's beat (runtime/health/node_beat.py: written by the hang watcher there and
its tasks' supervisor): a host that stopped beating while other nodes beat is frozen or cut off (a machine
that lost power closes no socket; its peers block in their collectives). When the batch host went silent,
or is no longer in the job's node list (the node is DOWN), it records the segment as ended with its batch host lost (a suspect in the team's node-health ledger, as a node lost
inside a job is: launcher/chain/chain.py Chain.batch_host_lost), then cancels the job so that the successor starts, on other
nodes. When the job ends otherwise, the keeper is ended with it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from megalaunch.launcher.backends.slurm import ACTIVE_STATES, JobInfo
from megalaunch.rundir.hostlist import expand_hostlist
from megalaunch.runtime.health.node_beat import HostSilence

POLL_S = 5.0
TICK_S = 1.0  # the batch host's beat (runtime/health/node_beat.py) is read this often
# Slurm's warning goes to every task of every step (the stop signal, USR1 or USR2); SIGHUP is what srun or
# a dying session may pass on. None of them is the keeper's to obey: the job's end (SIGTERM, SIGKILL) is.
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def detach(log: str | None) -> None:
    """Nothing of the keeper may pass through the batch host: with its srun gone, the step's standard
    streams (relayed by slurmstepd towards srun) block a task that writes to them (measured on the scale
    cluster: a task's writes stopped the moment the batch host died). So the keeper writes its own log
    file (srun gives it /dev/null), and ignores the signals that are not its own."""
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        for target in (1, 2):
            os.dup2(fd, target)
        os.close(fd)


def batch_host_gone(info: JobInfo | None, batch_host: str) -> bool:
    """Slurm still runs the job but no longer counts its batch host among its nodes. Only RUNNING: a job
    that is COMPLETING (its script ended) releases its nodes one by one, the batch host perhaps first."""
    if info is None or info.state != "RUNNING" or not info.nodes or info.nodes == "(null)":
        return False
    return batch_host not in expand_hostlist(info.nodes)


def keep(job_id: str, batch_host: str, *, ask: Callable[[str], JobInfo | None],
         on_lost: Callable[[str | None], None], cancel: Callable[[str], None], poll_s: float = POLL_S,
         sleep: Callable[[float], None] = time.sleep, silence: HostSilence | None = None,
         clock: Callable[[], float] = time.monotonic) -> str:
    """Watch until the job ends ('ended'), or its batch host is gone ('lost': Slurm took it out of the job) or
    went silent ('silent': runtime/health/node_beat.py, without waiting for Slurm); then on_lost(why) and
    cancel. Slurm is asked every `poll_s`, the beats read every TICK_S."""
    asked = float("-inf")
    while True:
        now = clock()
        why = silence.check(now) if silence is not None else None
        gone = False
        if why is None and (silence is None or now - asked >= poll_s):
            asked = now
            try:
                info = ask(job_id)
            except Exception:  # Slurm did not answer: the job may well be fine
                info = None
            else:
                if info is not None and info.state not in ACTIVE_STATES:
                    return "ended"
            gone = batch_host_gone(info, batch_host)
        if why is None and not gone:
            sleep(TICK_S if silence is not None else poll_s)
            continue
        try:
            on_lost(why)
        finally:
            cancel(job_id)
        return "silent" if why is not None else "lost"
