"""The recipe's `eval` section: milestone checkpoints evaluated by jobs of their own (docs/eval.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from megalaunch.config.cluster import parse_time_limit
from megalaunch.config.typed import doc

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # as run names (config/schema.py)


@dataclass(frozen=True, kw_only=True)
class LocalTask:
    """A task of megalaunch's own runner: a JSON-lines file, one multiple-choice question a line:
    {"context": "...", "choices": ["...", ...], "answer": INDEX}; scored by the summed log-likelihood
    of each choice after the context (accuracy)."""

    name: str = doc("task name in results.json and W&B (letters, digits, . _ -)")
    path: str = doc("the JSON-lines file (local; no download ever)", path="path")

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"eval.local_tasks: name {self.name!r} must be 1-64 letters, digits, '.', '_' or '-'")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation of milestone checkpoints: each one converted to Hugging Face and evaluated by a job
    of its own (docs/eval.md). Results: RUN/evals/<iteration>/results.json, W&B, `status --evals`."""

    interval: int = doc("evaluate every N-th iteration (a multiple of checkpoint.save_interval); 0: every "
                        "checkpoint.milestone_interval; evaluation is off when both are 0", 0)
    enabled: bool = doc("submit an eval stage when an eval checkpoint is complete", False)
    heldout_sequences: int = doc("held-out perplexity over this many sequences of model.seq_length tokens "
                                 "(fixed: comparable across milestones; 0: no perplexity)", 32)
    heldout_blend: list[str] = doc("dataset prefixes for held-out perplexity (all their documents); default: "
                                   "the validation split (data.split) of the run's frozen blend", [], path="path")
    tasks: list[str] = doc("lm-eval-harness task names (pip install 'megalaunch[eval]'; their data must be in "
                           "the local Hugging Face cache: jobs run offline)", [])
    task_paths: list[str] = doc("directories of lm-eval task YAMLs (lm-eval's include_path), e.g. tasks over "
                                "local JSON files", [], path="path")
    local_tasks: list[LocalTask] = doc("multiple-choice tasks of megalaunch's own runner (no lm-eval needed)", [])
    batch_size: int = doc("sequences per forward pass", 8)
    keep_hf: bool = doc("keep the converted Hugging Face directory (RUN/evals/<iteration>/hf); default: "
                        "deleted once the eval is done", False)
    gpus: int | None = doc("GPUs of the eval job (default: 1 on a GPU cluster, else 0)", None)
    cpus_per_task: int | None = doc("CPU cores of the eval job (default: cluster.cpus_per_task)", None)
    time: str = doc("time limit of the eval job", "01:00:00")
    partition: str | None = doc("Slurm partition of the eval job (default: cluster.partition)", None)
    wait_complete_s: float = doc("how long the eval job waits for its checkpoint to be complete (async saves)", 1800.)

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError("eval.interval must be >= 0")
        if self.heldout_sequences < 0 or self.batch_size < 1:
            raise ValueError("eval.heldout_sequences must be >= 0 and eval.batch_size >= 1")
        if self.gpus is not None and self.gpus < 0:
            raise ValueError("eval.gpus must be >= 0")
        parse_time_limit(self.time)
        names = [t.name for t in self.local_tasks] + list(self.tasks)
        if len(set(names)) != len(names):
            raise ValueError(f"eval: task names repeat ({', '.join(names)}); give each task one name")
