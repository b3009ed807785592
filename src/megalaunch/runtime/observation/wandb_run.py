"""One Weights & Biases run per experiment, continued by every segment of the chain.

The run id is created once and stored in RUN/state/wandb.json (with the project, the mode and the
last step logged); every segment calls `wandb.init(id=..., resume="allow")`. Steps are iterations
and only ever go forward: after a crash and a resume from an older checkpoint, iterations already
logged are skipped rather than sent out of order (W&B would drop them anyway).

Offline mode (compute nodes without network) writes under RUN/wandb/; wandb.json carries the
command that uploads it (`wandb sync --include-offline RUN/wandb/offline-run-*`), which `megalaunch
status` can show. Nothing secret is written: the API key stays in the environment (WANDB_API_KEY,
passed by name through the cluster profile's `secret_env`)."""

from __future__ import annotations

import os
import time
from typing import Any

from megalaunch.rundir.files import atomic_write_json, read_json
from megalaunch.rundir.paths import RunPaths


def state_file(paths: RunPaths) -> Any:
    return paths.wandb_state


def wandb_dir(paths: RunPaths) -> Any:
    return paths.root  # wandb appends "wandb/"


def sync_command(paths: RunPaths) -> str:
    return f"wandb sync --include-offline {paths.wandb_dir}/offline-run-*"


class WandbRun:
    """Rank 0's W&B run for this segment."""

    def __init__(self, paths: RunPaths, run: Any, state: dict[str, Any]) -> None:
        self.paths = paths
        self.run = run
        self.state = state

    @classmethod
    def open(cls, paths: RunPaths, *, project: str, entity: str | None, mode: str, name: str,
             config: dict[str, Any] | None = None, job_id: str | None = None) -> WandbRun:
        import wandb

        state = read_json(state_file(paths)) or {}
        if not state.get("id"):
            state = {"id": new_run_id(), "created": time.time(), "last_step": -1}
        state.update({"project": project, "entity": entity, "mode": mode,
                      "sync_command": sync_command(paths) if mode == "offline" else None})
        paths.state.mkdir(parents=True, exist_ok=True)
        atomic_write_json(state_file(paths), state)
        run = wandb.init(
            project=project, entity=entity, id=state["id"], resume="allow", name=name,
            mode="offline" if mode == "offline" else "online",
            dir=str(wandb_dir(paths)), config=config or {}, allow_val_change=True,
            settings=wandb.Settings(console="off", silent=True),
        )
        if job_id is not None:
            run.summary["megalaunch/last_job_id"] = job_id
        return cls(paths, run, state)

    @property
    def run_id(self) -> str:
        return str(self.state["id"])

    def log(self, step: int, metrics: dict[str, Any]) -> bool:
        """Log at `step` (an iteration) if it is past the last step logged; True if logged."""
        if step <= int(self.state.get("last_step", -1)):
            return False
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)
        self.state["last_step"] = step
        atomic_write_json(state_file(self.paths), self.state)
        return True

    def summarize(self, values: dict[str, Any]) -> None:
        """Set summary values (the latest segment's outcome...), never failing the segment."""
        try:
            for k, v in values.items():
                self.run.summary[k] = v
        except Exception as e:
            print(f"[megalaunch] W&B summary failed: {e}", flush=True)

    def finish(self, exit_code: int = 0) -> None:
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as e:  # never let logging turn an outcome into a failure
            print(f"[megalaunch] W&B finish failed: {e}", flush=True)


def segment_start(paths: RunPaths, phases: dict[str, float], job_id: str | None) -> dict[str, Any]:
    """At a segment's first log step: its start-up phases (the timeline's `phases`), and the chain's
    goodput up to the previous segment (state/goodput.json, written by `job end`)."""
    from megalaunch.rundir.ledger import Ledger, segment_numbers
    from megalaunch.runtime.observation.timeline import STARTUP_PHASES

    # the trainer does not know `job begin`: no launch; the first iteration is added
    cuts = [*STARTUP_PHASES[1:], ("first_iteration", "first_iteration_end")]
    # this segment's number as `status`, `logs --segment` and `report` show it
    out: dict[str, Any] = {"segment/index": segment_numbers(Ledger(paths).segments()).get(str(job_id))}
    for (_, a), (name, b) in zip([("", "process_start"), *cuts[:-1]], cuts, strict=True):
        if a in phases and b in phases:
            out[f"segment/{name}_s"] = phases[b] - phases[a]
    if "process_start" in phases and "first_iteration_end" in phases:
        out["segment/startup_s"] = phases["first_iteration_end"] - phases["process_start"]
    chain = read_json(paths.goodput)
    if isinstance(chain, dict) and chain.get("goodput") is not None:
        out["chain/goodput"] = chain["goodput"]
        out["chain/wall_s"] = chain.get("wall_s")
        out.update({f"chain/{k}_s": v for k, v in (chain.get("totals_s") or {}).items()})
    return out


def log_eval(paths: RunPaths, *, metrics: dict[str, Any], project: str, entity: str | None, mode: str) -> str:
    """An eval stage's results into the chain's W&B run (the id in state/wandb.json; created if no
    segment logged yet), on axes of their own: every `eval/*` metric is plotted against
    `eval/iteration` (`eval/tokens` is logged alongside for a tokens x axis). W&B's own step is not
    used, so the training segments' iteration steps are never disturbed."""
    import wandb

    state = read_json(state_file(paths)) or {}
    if not state.get("id"):
        state = {"id": new_run_id(), "created": time.time(), "last_step": -1, "project": project,
                 "entity": entity, "mode": mode}
        paths.state.mkdir(parents=True, exist_ok=True)
        atomic_write_json(state_file(paths), state)
    if mode == "online" and offline_by_default():
        mode = "offline"
    run = wandb.init(project=project, entity=entity, id=state["id"], resume="allow",
                     mode="offline" if mode == "offline" else "online", dir=str(wandb_dir(paths)),
                     settings=wandb.Settings(console="off", silent=True))
    try:
        run.define_metric("eval/iteration")
        run.define_metric("eval/*", step_metric="eval/iteration")
        run.log({k: v for k, v in metrics.items() if v is not None}, commit=True)
    finally:
        run.finish()
    return str(state["id"])


def new_run_id() -> str:
    """Eight lowercase letters and digits, like W&B's own ids."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def offline_by_default() -> bool:
    """True when W&B cannot reach its server: no key, or WANDB_MODE=offline in the environment."""
    return os.environ.get("WANDB_MODE") == "offline" or not os.environ.get("WANDB_API_KEY")
