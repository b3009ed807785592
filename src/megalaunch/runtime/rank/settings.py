"""The runtime's slice of the recipe, decided at render time and written into RUN/runtime.json: with
RUN/megatron.args it is everything the job reads of the recipe (the job never re-types run.yaml)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from megalaunch.rundir.paths import RunPaths


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    train_iters: int
    save_interval: int
    log_interval: int = 10
    trigger_interval: int = 1
    stop_signal: str = "SIGUSR2"
    # "auto": follows the measured step / the chain's measured start-ups (runtime/health/hang_limit.py)
    hang_timeout_s: float | str = "auto"
    startup_timeout_s: float | str = "auto"  # the hang watcher's limit before the first iteration
    save_time_estimate_s: float = 60.0  # checkpoint.save_time_estimate_s: the auto hang limit's save allowance
    keep_last: int = 2
    milestone_interval: int = 0
    cpu: bool = False  # gpus_per_node == 0: the job hides any GPU and runs on the CPU (gloo)
    attention: str = "local"
    kernels: str = "megatron"  # training.kernels, resolved in the job (runtime/model/kernels.py); runs made before it: megatron
    # what the layout fits the GPUs' memory only with (config/planner/fit.py fit_needs): liger_loss, grouped_experts
    # -> the figures; the job refuses a node that would run without it (runtime/model/kernels.py check_fit)
    fits_with: dict[str, str] | None = None
    fp8: str | None = None  # training.fp8_recipe when training.precision is fp8 (runtime/model/fp8.py); None: no FP8
    allow_blend_change: bool = False
    profile_window: bool = False  # --profile-step-start/end count from the iteration resumed from
    run_name: str = "run"
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: str = "online"
    # the chain's part (`job begin` / `job end` read these too, never the whole recipe)
    backend: str = "slurm"
    auto_requeue: bool = True
    max_segments_without_progress: int = 3
    nodes: int = 1
    partition: str | None = None
    node_health_dir: str | None = None  # None: no node-health ledger (runs made before it existed)
    suspect_ttl_s: float = 12 * 3600.0
    exclude_suspects: bool = True
    health_check: bool = False  # cluster.health_check resolved: auto is on with GPUs (runtime/health/health.py)
    health_check_margin: float = 0.2
    straggler_threshold: float = 0.1
    # evaluation (evaluation/): rank 0 queues RUN/evals/<iteration> after a save at a multiple of
    # eval_interval (0: off) and, with a job script (Slurm), runs eval_submit + [iteration] in a thread
    eval_interval: int = 0
    eval_submit: list[str] | None = None
    # storage (issue 23): one checkpoint's predicted bytes (config/planner/checkpoint_size.py), what the check
    # before a save asks for until a checkpoint of this run can be measured; None: not known
    checkpoint_bytes: int | None = None
    # the stop signal's timing (runtime/stop/stop_window.py; launcher/prepare/signal_lead.py raises the lead of the
    # next segments from the saves measured): None / 0 in runs made before these existed
    signal_lead_s: int | None = None  # the rendered lead: #SBATCH --signal=SIG@LEAD, the local timer's
    signal_delay_s: int = 0  # how late the signal may come: Slurm's check period (30 s), 0 locally
    step_time_estimate_s: float = 0.0
    signal_margin_s: float = 0.0
    max_signal_lead_s: int | None = None  # a raised lead stops here: time limit - delay - min_train_time_s
    # chain.notify (launcher/chain/notify.py): commands, webhook variable NAMES and secret-free URLs; None: off
    notify: dict[str, Any] | None = None
    # in-job restarts (launcher/chain/restart.py; issue 25): 0 in runs made before they existed
    restarts_per_segment: int = 0
    spare_nodes: int = 0
    node_counts: list[int] | None = None  # the counts a step may shrink to, largest first (config/topology.node_counts); None: `nodes` only
    tasks_per_node: int = 1
    min_train_time_s: float = 60.0
    # data.format (runtime/loop/step.py): "tokens" (GPTDataset) or "chat" (tokenization/chat/dataset.py)
    data_format: str = "tokens"
    from_hf: str | None = None  # checkpoint.from_hf: converted into RUN/pretrained by `job begin` (launcher/chain/first_stage.py)
    chat_files: str | None = None  # data.chat_files: tokenized into RUN/sft_data by `job begin` (launcher/chain/first_stage.py)
    export_hf: bool = False  # chain.export_hf: `job end` converts the final checkpoint into RUN/hf
    flow: str | None = None  # training.flow, or post_training's built-in flow: "module:Class" (runtime/flows/flow.py)
    post_training: dict[str, Any] | None = None  # the recipe's post_training section (method != none), the flow's config

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, paths: RunPaths) -> RuntimeSettings:
        data = json.loads(paths.runtime_json.read_text())
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})
