"""RunPaths owns every file name of a run directory (docs/architecture.md, "The run directory").

Both the launcher (login node) and the runtime (inside the job) use it, so it lives here and
imports nothing beyond the standard library."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TRIGGER_VERBS = ("save", "exit", "abort")
# Megatron's tracker file name; the test workload writes the same one so the chain logic is uniform.
TRACKER_NAME = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @classmethod
    def from_env(cls) -> RunPaths:
        return cls(Path(os.environ["MEGALAUNCH_RUN_DIR"]))

    @property
    def run_yaml(self) -> Path:
        return self.root / "run.yaml"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def plan(self) -> Path:
        """The layout chosen at submit and its inputs, the predicted figures and forecast (launcher/prepare/outlook.py)."""
        return self.root / "plan.json"

    @property
    def runtime_json(self) -> Path:
        """The runtime's slice of the recipe (intervals, target, signal), read inside the job."""
        return self.root / "runtime.json"

    @property
    def data_blend(self) -> Path:
        return self.root / "data_blend.txt"

    @property
    def tokenizer(self) -> Path:
        """The run's frozen Hugging Face tokenizer directory (config/tokenizer.py): Megatron's
        --tokenizer-model and the tokenizer of a converted model."""
        return self.root / "tokenizer"

    @property
    def megatron_args(self) -> Path:
        return self.root / "megatron.args"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        return self.root / "wandb"

    @property
    def job_script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def triggers(self) -> Path:
        return self.root / "triggers"

    @property
    def consumed_triggers(self) -> Path:
        return self.root / "triggers" / "consumed"

    def trigger(self, verb: str) -> Path:
        return self.triggers / verb

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tracker(self) -> Path:
        return self.checkpoints / TRACKER_NAME

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def segment_log(self, job_id: str) -> Path:
        """A segment's log: the job script's `--output=logs/%x-%j.out`, %x being the chain name."""
        return self.logs / f"{self.root.name}-{job_id}.out"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def ledger(self) -> Path:
        return self.state / "ledger.jsonl"

    @property
    def progress(self) -> Path:
        return self.state / "progress.json"

    @property
    def outcome(self) -> Path:
        return self.state / "outcome.json"

    def timeline(self, job_id: str) -> Path:
        """Rank 0's phase times of one segment (runtime/observation/timeline.py)."""
        return self.state / "timeline" / f"{job_id}.json"

    def heartbeat(self, job_id: str) -> Path:
        """Rank 0's sign of life in one segment (runtime/health/heartbeat.py), watched by runtime/hangwatch.py."""
        return self.state / "heartbeat" / f"{job_id}.json"

    def hang_limit(self, job_id: str) -> Path:
        """The hang limits in effect in one segment and why (runtime/hangwatch.py); status shows them."""
        return self.state / "hang_limit" / f"{job_id}.json"

    def step_stacks(self, job_id: str, rank: int) -> Path:
        """Python stacks a rank dumps when the hang watcher asks (SIGURG, runtime/health/watchdog.py)."""
        return self.debug / f"stacks-step-job{job_id}-rank{rank}.txt"

    @property
    def goodput(self) -> Path:
        """The chain's goodput as of the last `job end` (launcher/accounting/goodput.py), for the next segment's W&B."""
        return self.state / "goodput.json"

    @property
    def metrics(self) -> Path:
        """One line per log interval of every segment: iteration, time, loss, tokens/s, TFLOP/s."""
        return self.state / "metrics.jsonl"

    @property
    def moe_load(self) -> Path:
        """MoE runs: one line per log interval, tokens per expert per layer, dropped, aux losses
        (runtime/observation/moe_balance.py)."""
        return self.state / "moe_load.jsonl"

    def tasks(self, job_id: str) -> Path:
        """One exit record per rank of a segment, written by runtime/task.py."""
        return self.state / "tasks" / str(job_id)

    def task_record(self, job_id: str, rank: int) -> Path:
        return self.tasks(job_id) / f"rank-{rank:05d}.json"

    def task_error(self, job_id: str, rank: int) -> Path:
        """The trainer's own account of its failure on this rank (runtime/train.py)."""
        return self.tasks(job_id) / f"error-rank-{rank:05d}.json"

    @property
    def cancel_requested(self) -> Path:
        return self.state / "cancel_requested"

    @property
    def resume_request(self) -> Path:
        """`megalaunch resume RUN --from ITER`'s one-shot request, applied by the next segment that trains."""
        return self.state / "resume_request.json"

    def settled_resume_request(self, how: str, job_id: str | None) -> Path:
        """Where a request goes once settled: `how` is done (applied), refused or withdrawn."""
        return self.state / f"resume_request.{how}-{job_id}.json"

    @property
    def debug(self) -> Path:
        return self.root / "debug"

    @property
    def wandb_state(self) -> Path:
        """The experiment's W&B run id (one for the whole chain), project and mode."""
        return self.state / "wandb.json"

    @property
    def blend_hash(self) -> Path:
        """sha256 of the data blend the checkpoints were trained on (a changed blend is refused)."""
        return self.checkpoints / "data_blend.sha256"

    def stacks(self, job_id: str, rank: int) -> Path:
        """Python stacks dumped by the hang watchdog."""
        return self.debug / f"stacks-job{job_id}-rank{rank}.txt"

    @property
    def evals(self) -> Path:
        """One directory per evaluated iteration (rundir/evals.py: EvalPaths)."""
        return self.root / "evals"

    @property
    def code_snapshot(self) -> Path:
        return self.root / "code"

    def read_tracker(self) -> int | None:
        """Iteration of the newest complete checkpoint per the tracker, or None."""
        try:
            text = self.tracker.read_text().strip()
        except FileNotFoundError:
            return None
        if text == "release":
            return 0
        try:
            return int(text)
        except ValueError:
            return None


def enclosing_run(path: str | os.PathLike[str]) -> RunPaths | None:
    """The training run directory that `path` (a file or directory, existing or not) lies in, if any:
    the nearest enclosing directory that holds a run.yaml and a manifest.json."""
    here = Path(os.path.abspath(os.path.expanduser(path)))
    for d in (here, *here.parents):
        if (d / "run.yaml").is_file() and (d / "manifest.json").is_file():
            return RunPaths(d)
    return None


def refuse_frozen_write(path: str | os.PathLike[str], field: str) -> None:
    """A run's files are frozen: only megalaunch's own commands on that run write them (a new blend
    goes through `megalaunch resume RUN --set`, which records it). Raises a one-line RunDirError."""
    from megalaunch.errors import RunDirError

    run = enclosing_run(path)
    if run is not None:
        raise RunDirError(f"{path} is inside the run directory {run.root}, whose files are frozen (its checkpoints "
                          "were trained on its data_blend.txt)", field=field,
                          valid="a path outside every run directory",
                          fix=f"write it elsewhere; to train the run on it: megalaunch resume {run.root} "
                              "--set data.blend_file=FILE (or data.blend=[...])")


@dataclass(frozen=True)
class ConversionPaths:
    """A conversion's output directory when it runs as a Slurm job: its script and logs."""

    root: Path

    @property
    def job_script(self) -> Path:
        return self.root / "convert.sbatch"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def step_file(path: os.PathLike[str] | str, step: int) -> str:
    """Where a file of one training step goes when an in-job restart starts the next step
    (launcher/chain/restart.py): `NAME.stepN.EXT`, or `NAME.stepN` for a name without an extension."""
    p = os.fspath(path)
    base, dot, ext = p.rpartition(".") if "." in os.path.basename(p) else (p, "", "")
    return f"{base}.step{step}{dot}{ext}"
