"""`megalaunch job begin|end|watch|keeper|step-nodes|step-end RUN`: run by the job script at the start and
end of every segment, (watch) in the background while the training step runs, (keeper) on another node
while the segment runs, and (step-nodes, step-end) around each training step of the segment (in-job
restarts: launcher/chain/restart.py)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True)


def _chain(run: str):
    from pathlib import Path

    from megalaunch.launcher.backends.registry import backend_for
    from megalaunch.launcher.chain.chain import Chain
    from megalaunch.rundir.paths import RunPaths
    from megalaunch.runtime.rank.settings import RuntimeSettings

    paths = RunPaths(Path(run).absolute())
    settings = RuntimeSettings.load(paths)  # the job's slice: `job begin/end` do not re-type the recipe
    return Chain(paths, backend_for(settings.backend), settings)


def _job_id() -> str:
    from megalaunch.errors import MegalaunchError
    from megalaunch.rundir.state import current_job_id

    jid = current_job_id()
    if not jid:
        raise MegalaunchError("no SLURM_JOB_ID in the environment: `job begin/end` run inside a job",
                              fix="this command is called by the job script, not by hand")
    return jid


@app.command()
def begin(run: Annotated[str, typer.Argument(help="Run directory.")]) -> None:
    """Segment start: ledger, guardrails, pending exit/abort, successor. Exit 100: do not train."""
    from megalaunch.launcher.chain.chain import STOP_EXIT_CODE

    verdict = _chain(run).begin(_job_id())
    if not verdict.proceed:
        sys.exit(STOP_EXIT_CODE)


@app.command()
def end(
    run: Annotated[str, typer.Argument(help="Run directory.")],
    exit_code: Annotated[int | None, typer.Option("--exit-code", help="The training step's exit status.")] = None,
) -> None:
    """Segment end: read the outcome and stop or continue the chain."""
    _chain(run).end(_job_id(), exit_code)


@app.command("step-nodes")
def step_nodes(
    run: Annotated[str, typer.Argument(help="Run directory.")],
    step: Annotated[int, typer.Option("--step", help="The step's number in this segment (0, 1, ...).")] = 0,
) -> None:
    """Before each training step: the nodes it runs on (comma-separated), healthy ones first."""
    from megalaunch.launcher.chain.restart import step_nodes as choose

    print(",".join(choose(_chain(run), _job_id(), step)))


@app.command("step-end")
def step_end(
    run: Annotated[str, typer.Argument(help="Run directory.")],
    step: Annotated[int, typer.Option("--step", help="The step's number in this segment.")] = 0,
    exit_code: Annotated[int | None, typer.Option("--exit-code", help="The training step's exit status.")] = None,
) -> None:
    """After each training step: exit 101 to restart it in this allocation, 0 to end the segment."""
    from megalaunch.launcher.chain.restart import RESTART_EXIT_CODE
    from megalaunch.launcher.chain.restart import step_end as decide

    try:
        restart = decide(_chain(run), _job_id(), step, exit_code).restart
    except Exception as e:  # the decision must never lose the segment's end: `job end` follows
        print(f"megalaunch: could not decide on an in-job restart ({e}); the segment ends", file=sys.stderr)
        restart = False
    if restart:
        sys.exit(RESTART_EXIT_CODE)


@app.command()
def keeper(
    run: Annotated[str, typer.Argument(help="Run directory.")],
    batch_host: Annotated[str, typer.Option("--batch-host", help="The node that runs the job script.")],
    log: Annotated[str | None, typer.Option("--log", help="Append this command's output to this file.")] = None,
) -> None:
    """Beside the steps, on another node: end the job if its batch host dies (launcher/backends/keeper.py)."""
    import socket

    from megalaunch.launcher.backends.keeper import detach, keep
    from megalaunch.launcher.backends.slurm import SlurmClient
    from megalaunch.runtime.health.node_beat import HostSilence, NodeBeat, beat_dir

    detach(log)
    job_id, client = _job_id(), SlurmClient()
    here = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    # this node beats too: the batch host is judged against it (the training step's nodes may all have ended)
    NodeBeat(beat_dir(run, job_id), here, "keeper").start()
    keep(job_id, batch_host, ask=client.job_state, cancel=lambda j: client.scancel([j]),
         on_lost=lambda why: _chain(run).batch_host_lost(job_id, batch_host, here, why),
         silence=HostSilence(beat_dir(run, job_id), batch_host, here))


@app.command()
def watch(
    run: Annotated[str, typer.Argument(help="Run directory.")],
    shell_pid: Annotated[int, typer.Option("--shell-pid", help="The job script's pid (srun's parent).")],
) -> None:
    """While the step runs: kill it when rank 0's heartbeat stays silent (runtime/hangwatch.py)."""
    from megalaunch.runtime.hangwatch import main

    _job_id()
    sys.exit(main([run, "--shell-pid", str(shell_pid)]))
