"""The recipe schema. Field names follow Megatron's argument names (`num_layers` -> `--num-layers`),
so a recipe reads like the Megatron command line it becomes. Each section is a frozen, keyword-only
dataclass; each component receives only its own slice."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from megalaunch.config.cluster import ClusterConfig
from megalaunch.config.eval_schema import EvalConfig
from megalaunch.config.model.mla import MLAFields
from megalaunch.config.model.moe import MoEFields
from megalaunch.config.training.post_training import PostTrainingConfig
from megalaunch.config.typed import doc

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # \Z: "$" would allow a final newline


@dataclass(frozen=True, kw_only=True)
class _ModelShape:
    """The dense transformer's shape (listed before the MoE fields in `recipes show`)."""

    num_layers: int = doc("transformer layers (--num-layers)")
    hidden_size: int = doc("model width (--hidden-size)")
    num_attention_heads: int = doc("attention heads (--num-attention-heads)")
    ffn_hidden_size: int | None = doc("MLP width; Megatron's default is 4 x hidden", None)
    num_query_groups: int | None = doc("KV heads for grouped-query attention (--num-query-groups)", None)
    seq_length: int = doc("training sequence length in tokens (--seq-length)", 2048)
    max_position_embeddings: int = doc("positions the model supports (>= seq_length)", 2048)
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = doc("position encoding", "rope")
    rotary_base: int = doc("RoPE theta (--rotary-base)", 10000)
    rotary_percent: float = doc("fraction of head dim rotated", 1.0)
    use_rope_scaling: bool = doc("Llama 3.1 RoPE frequency scaling", False)
    rope_scaling_factor: float = doc("RoPE scaling factor (8 for Llama 3.1, 32 for Llama 3.2)", 8.0)
    normalization: Literal["RMSNorm", "LayerNorm"] = doc("norm layer (--normalization)", "RMSNorm")
    norm_epsilon: float = doc("norm epsilon", 1e-5)
    swiglu: bool = doc("gated SiLU MLP as in Llama (--swiglu)", True)
    disable_bias_linear: bool = doc("no biases in linear layers (--disable-bias-linear)", True)
    add_qkv_bias: bool = doc("bias on QKV only, as in Qwen2 (--add-qkv-bias)", False)
    untie_embeddings_and_output_weights: bool = doc("separate output layer", True)
    attention_dropout: float = doc("dropout on attention probabilities", 0.0)
    hidden_dropout: float = doc("dropout on hidden states", 0.0)
    qk_layernorm: bool = doc("RMSNorm/LayerNorm on each head's queries and keys (Qwen3; --qk-layernorm)", False)
    kv_channels: int | None = doc("head size, when not hidden_size / num_attention_heads (Qwen3: 128; "
                                  "--kv-channels)", None)
    make_vocab_size_divisible_by: int = doc("pad the vocabulary to a multiple of this", 128)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(MoEFields, MLAFields, _ModelShape):
    """Model shape, in Megatron's terms; the mixture-of-experts fields are config/model/moe.py's, the
    multi-latent-attention ones config/model/mla.py's."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is split. World size = nodes x tasks per node = TP x PP x CP x DP (DP derived)."""

    tensor_model_parallel_size: int = doc("TP: tensor-parallel degree", 1)
    pipeline_model_parallel_size: int = doc("PP: pipeline stages", 1)
    virtual_pipeline_model_parallel_size: int | None = doc("VPP: interleaved chunks per stage", None)
    context_parallel_size: int = doc("CP: context-parallel degree", 1)
    expert_model_parallel_size: int = doc("EP: expert-parallel degree (MoE: the experts split over EP ranks)", 1)
    expert_tensor_parallel_size: int | None = doc("MoE: TP degree inside each expert (null: the same as TP)", None)
    sequence_parallel: bool = doc("sequence parallelism (needs TP > 1)", False)
    use_distributed_optimizer: bool = doc("shard optimizer state over DP (ZeRO-1)", True)
    data_sharding: Literal["optimizer", "optimizer_grads", "optimizer_grads_params"] = doc(
        "what data parallelism shards: optimizer (the distributed optimizer above), or Megatron-FSDP's "
        "optimizer_grads (ZeRO-2) or optimizer_grads_params (ZeRO-3: each layer's weights gathered when used, "
        "so 8B fits TP 1 on 80 GB); FSDP saves the fsdp_dtensor checkpoint format (docs/training.md)", "optimizer")
    layout: Literal["auto", "pinned"] = doc("auto: the planner's layout for the job's GPUs (docs/training.md)", "pinned")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Batch, schedule and optimizer."""

    micro_batch_size: int = doc("sequences per GPU per micro-step", 1)
    global_batch_size: int = doc("sequences per optimizer step (must divide by micro x DP)", 8)
    train_iters: int = doc("target iteration count; constant across the chain", 1000)
    lr: float = doc("peak learning rate", 3e-4)
    min_lr: float = doc("final learning rate", 3e-5)
    lr_warmup_iters: int = doc("warm-up iterations", 0)
    lr_decay_style: Literal["cosine", "linear", "constant", "WSD", "inverse-square-root"] = doc("decay", "cosine")
    lr_decay_iters: int | None = doc("iterations of decay (default: train_iters)", None)
    weight_decay: float = doc("AdamW weight decay", 0.1)
    adam_beta1: float = doc("Adam beta1", 0.9)
    adam_beta2: float = doc("Adam beta2", 0.95)
    adam_eps: float = doc("Adam epsilon", 1e-8)
    clip_grad: float = doc("gradient-norm clip", 1.0)
    init_method_std: float = doc("weight init std", 0.02)
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = doc(
        "training precision; fp8: the transformer layers' GEMMs in FP8 on bf16 weights (docs/training.md)", "bf16")
    fp8_recipe: Literal["tensorwise", "rowwise"] = doc("FP8 scaling with precision fp8: per tensor, per row", "tensorwise")
    seed: int = doc("random seed", 1234)
    log_interval: int = doc("iterations between log lines and progress.json", 10)
    eval_interval: int = doc("iterations between evaluations", 1000)
    eval_iters: int = doc("batches per evaluation (0 disables)", 0)
    attention: Literal["auto", "local", "sdpa", "te"] = doc(
        "attention kernel: auto (chosen in the job: transformer-engine if importable, else flash-attn, else "
        "torch SDPA; recorded in the ledger), local (Megatron's, slow), sdpa (torch), te", "auto")
    kernels: Literal["auto", "megatron", "liger", "te"] = doc(
        "RMSNorm, RoPE, SwiGLU and the output layer's cross entropy: auto (chosen in the job: te with "
        "transformer_impl transformer_engine, else liger-kernel's where importable on a GPU and measured faster, "
        "else Megatron's; recorded in the ledger), megatron, liger (needs liger-kernel and a GPU), te", "auto")
    recompute: Literal["none", "selective", "full"] = doc("activation recomputation: none, selective (the core "
                                                          "attention) or full (every layer; ~1/3 more compute)", "none")
    transformer_impl: Literal["local", "transformer_engine"] = doc("Megatron layer implementation", "local")
    flow: str | None = doc("a user-defined training step, 'module:Class' importable in the job (runtime/flows/flow.py); "
                           "null: next-token loss on the loss mask", None)
    fused_kernels: bool | Literal["auto"] = doc("Megatron's torch.compile'd fusions (no TE or apex needed): SwiGLU/GELU "
                                                "with bias, bias-dropout-add, cross entropy; auto: on with GPUs", "auto")

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1")
        if self.lr <= 0:
            raise ValueError("training.lr must be > 0")
        if self.flow is not None and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*\Z", self.flow):
            raise ValueError(f"training.flow {self.flow!r} must be 'module:Class' (e.g. "
                             "megalaunch.runtime.flows.preference_flow:PreferenceFlow)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Saving, resuming and retention."""

    save_interval: int = doc("iterations between regular checkpoints", 1000)
    ckpt_format: Literal["torch_dist", "torch"] = doc("Megatron checkpoint format", "torch_dist")
    async_save: bool | Literal["auto"] = doc(
        "asynchronous periodic checkpoint writes (the blocking part is the copy to host memory; the stop save "
        "still completes before the job exits); true, false, or auto: on with GPUs and the torch_dist format, "
        "off on the CPU (Megatron's persistent save worker fails there)", "auto")
    writer_threads: int = doc(
        "threads that write each rank's part of an asynchronous save (Megatron's --dist-ckpt-workers); one "
        "thread writes at half a local NVMe's speed (docs/storage.md)", 8)
    keep_last: int = doc("regular checkpoints kept", 2)
    disk_check: bool = doc("refuse a submit whose checkpoint peak exceeds the free space or quota", True)
    milestone_interval: int = doc("also keep every M-th iteration forever (0: none)", 0)
    save_time_estimate_s: float = doc("expected seconds to write one checkpoint (sets the signal lead)", 60.0)
    load: str | None = doc("start from this checkpoint directory (first segment only)", None, path="path")
    from_hf: str | None = doc("start from this Hugging Face model (`submit --from-hf DIR`): the first segment converts "
                              "it into RUN/pretrained with this recipe; instead of checkpoint.load", None, path="path")
    allow_blend_change: bool = doc("resume even if the data blend changed", False)

    def __post_init__(self) -> None:
        if self.load and self.from_hf:
            raise ValueError("checkpoint.load and checkpoint.from_hf both name the weights to start from; give "
                             "one of them (from_hf: a Hugging Face directory, converted by the first segment)")


@dataclass(frozen=True, kw_only=True)
class BlendEntry:
    path: str = doc("a dataset prefix (without .bin/.idx) or a directory of them", path="path")
    weight: float | None = doc("sampling weight; default: token count", None)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from."""

    mock: bool = doc("synthetic data (Megatron's mock dataset); no files needed", False)
    blend: list[BlendEntry] = doc("dataset prefixes, directories or tokenization run directories, with optional "
                                  "weights", [])
    blend_file: str | None = doc("a blend file written by `megalaunch data blend --output` (instead of data.blend)",
                                 None, path="path")
    split: str = doc("train/valid/test split", "100,0,0")
    tokenizer_type: Literal["NullTokenizer", "HuggingFaceTokenizer"] = doc("tokenizer kind", "NullTokenizer")
    tokenizer_model: str | None = doc("local tokenizer.json or Hugging Face tokenizer directory "
                                      "(HuggingFaceTokenizer; frozen into RUN/tokenizer/)", None, path="path")
    vocab_size: int | None = doc("vocabulary size (NullTokenizer; a Hugging Face tokenizer brings its own)", None)
    chat_files: str | None = doc("chat JSONL/parquet (or a folder): the chain's first stage tokenizes them with the run's "
                                 "tokenizer and chat template into RUN/sft_data (`submit --data DIR`)", None, path="path")
    num_workers: int = doc("data-loader workers per rank", 2)
    format: Literal["tokens", "chat"] = doc(
        "tokens: documents concatenated into sequences, every token trained on (pre-training); chat: the output "
        "of `megalaunch data sft`, one conversation per sequence, the loss on the assistant's tokens only "
        "(docs/finetuning.md); with data.mock, Megatron's mock data (smoke tests, benchmarks)", "tokens")

    def __post_init__(self) -> None:
        if sum(map(bool, (self.blend, self.blend_file, self.chat_files))) > 1:
            raise ValueError("data: data.blend and data.blend_file (or data.chat_files) both name the data; give one")
        if not (self.mock or self.blend or self.blend_file or self.chat_files):
            raise ValueError("data: set data.blend (dataset prefixes), data.blend_file (a file from `megalaunch data "
                             "blend --output`), data.chat_files (chat JSONL) or data.mock: true")
        if self.chat_files and (self.format != "chat" or self.tokenizer_type != "HuggingFaceTokenizer"):
            raise ValueError("data.chat_files needs data.format: chat and the HuggingFaceTokenizer (the model's chat "
                             "template renders them); fix: submit RECIPE --from-hf MODEL_DIR --data DIR")
        if self.tokenizer_type == "NullTokenizer" and self.vocab_size is None:
            raise ValueError("data.vocab_size is required with the NullTokenizer")
        if self.tokenizer_type == "HuggingFaceTokenizer" and not self.tokenizer_model:
            raise ValueError("data.tokenizer_model is required with the HuggingFaceTokenizer")


@dataclass(frozen=True, kw_only=True)
class NotifyConfig:
    """Who is told when the chain stops for a reason that needs a person, or finishes (launcher/chain/notify.py;
    docs/training.md, "Telling a person"). A failed notification never changes what the chain does."""

    commands: list[list[str]] = doc("commands, each an argument list (no shell), given the JSON on stdin and in "
                                    "MEGALAUNCH_NOTIFY_JSON", [])
    webhook_env: list[str] = doc("names of environment variables holding webhook URLs (set in the submitting "
                                 "shell, like cluster.secret_env; the URL is never written to a file)", [])
    webhooks: list[str] = doc("webhook URLs without a secret in them (no user:password@, no ?query, no token); "
                              "a Slack/Teams/Discord hook goes in webhook_env", [])
    on_every_segment: bool = doc("also tell at every segment end, also one that continues the chain, and at every "
                                 "in-job restart (chain.restarts_per_segment)", False)
    timeout_s: float = doc("seconds each webhook POST may take", 10.0)
    command_timeout_s: float = doc("seconds each command may run (then it is killed)", 30.0)

    def job_slice(self) -> dict[str, Any] | None:
        """What the job reads (RuntimeSettings.notify): None when nobody is to be told."""
        if not (self.commands or self.webhook_env or self.webhooks):
            return None
        return {"commands": [list(c) for c in self.commands], "webhook_env": list(self.webhook_env),
                "webhooks": list(self.webhooks), "on_every_segment": self.on_every_segment,
                "timeout_s": self.timeout_s, "command_timeout_s": self.command_timeout_s}


@dataclass(frozen=True, kw_only=True)
class ChainConfig:
    """The self-requeuing chain and its guardrails."""

    auto_requeue: bool = doc("each segment queues its successor (singleton dependency)", True)
    max_segments_without_progress: int = doc("stop after K consecutive segments with no new checkpoint", 3)
    stop_signal: Literal["SIGUSR1", "SIGUSR2"] = doc("signal Slurm sends before the time limit", "SIGUSR2")
    signal_margin_s: int = doc("extra seconds of signal lead beyond save + step + Slurm's 30 s", 30)
    step_time_estimate_s: float = doc("expected seconds per iteration", 10.0)
    min_train_time_s: int = doc("least training time a segment must get after the lead", 60)
    trigger_interval: int = doc("iterations between looks at the trigger directory", 1)
    hang_timeout_s: float | Literal["auto"] = doc(
        "no iteration or save for this long: every rank dumps its stacks, outcome hung (in Python; the job's hang "
        "watcher kills the step a little later if that could not act); auto: between saves 10 x the measured step, "
        "at least 45 s; during a save or an evaluation that + its measured allowance; 1800 until measured "
        "(docs/training.md, Hangs)", "auto")
    startup_timeout_s: float | Literal["auto"] = doc(
        "before the first iteration (imports, rendezvous, NCCL init, checkpoint load), no sign of life for this "
        "long: stacks, kill the step, outcome hung; auto: 3 x the longest start-up measured in the chain, at "
        "least 300 s, 1800 until measured", "auto")
    notify: NotifyConfig = doc("commands and webhooks told when the chain needs a person or finishes",
                               NotifyConfig())
    export_hf: bool = doc("at the target, `job end` converts the last checkpoint to Hugging Face in RUN/hf", False)
    restarts_per_segment: int = doc("in-job restarts: a step that failed for a reason a restart can fix (a rank "
                                    "killed, a collective error, a hang, a node failing its health check) starts "
                                    "again inside the same allocation, from the newest complete checkpoint, at "
                                    "most this many times per segment (0: off, the next segment resumes)", 2)

    def __post_init__(self) -> None:
        if not 0 <= self.restarts_per_segment <= 100:
            raise ValueError(f"chain.restarts_per_segment must be 0-100, got {self.restarts_per_segment}; "
                             "fix: --set chain.restarts_per_segment=2 (0 turns in-job restarts off)")
        for name, value in (("hang_timeout_s", self.hang_timeout_s), ("startup_timeout_s", self.startup_timeout_s)):
            if value != "auto" and not value > 0:  # also refuses NaN
                raise ValueError(f"chain.{name} must be > 0 seconds, got {value}; "
                                 f"fix: --set chain.{name}=1800 (or another positive number, or auto)")


@dataclass(frozen=True, kw_only=True)
class DebugConfig:
    """Optional diagnostics."""

    nccl_debug: bool = doc("NCCL_DEBUG=INFO into per-rank files under RUN/debug", False)
    flight_recorder: bool = doc("PyTorch NCCL flight recorder dumps under RUN/debug", False)
    nsys: bool = doc("profile with Nsight Systems", False)
    nsys_start_offset: int = doc("nsys window: first iteration after the resume point", 10)
    nsys_iters: int = doc("nsys window length in iterations", 5)
    code_snapshot: str | None = doc("copy this source tree into RUN/code (fails loudly)", None, path="path")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    wandb_project: str | None = doc("Weights & Biases project (null: off)", None)
    wandb_entity: str | None = doc("W&B entity", None)
    wandb_mode: Literal["online", "offline"] = doc("offline when compute nodes have no network", "offline")
    tensorboard: bool = doc("write TensorBoard logs under RUN/tensorboard", False)
    rank_output: Literal["failing", "all"] = doc(
        "which ranks' output the segment log holds: failing: rank 0's and the last rank's (Megatron's iteration "
        "lines), another rank's (its last 400 lines) only when it fails or is slow "
        "(runtime/observation/rank_output.py); all: every rank's", "failing")


@dataclass(frozen=True, kw_only=True)
class RunSection:
    root: str = doc("directory under which run directories are created", "~/megalaunch-runs", path="path")
    group: str | None = doc("Unix group that owns the run directory (team triggers)", None)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A complete training recipe."""

    name: str = doc("experiment name (letters, digits, . _ -)")
    description: str = doc("free text", "")
    model: ModelConfig = doc("model shape")
    parallel: ParallelConfig = doc("parallelism", ParallelConfig())
    training: TrainingConfig = doc("batch, schedule, optimizer", TrainingConfig())
    checkpoint: CheckpointConfig = doc("checkpointing", CheckpointConfig())
    data: DataConfig = doc("data and tokenizer")
    cluster: ClusterConfig = doc("cluster profile", ClusterConfig())
    chain: ChainConfig = doc("chain and guardrails", ChainConfig())
    debug: DebugConfig = doc("diagnostics", DebugConfig())
    logging: LoggingConfig = doc("experiment tracking", LoggingConfig())
    eval: EvalConfig = doc("evaluation of milestone checkpoints", EvalConfig())
    post_training: PostTrainingConfig = doc("DPO, IPO, GRPO, distillation (docs/post_training.md)", PostTrainingConfig())
    run: RunSection = doc("run directory", RunSection())
    workload: list[str] | None = doc("a command to run instead of Megatron training (tests, demos)", None)
    megatron_args: dict[str, Any] = doc("extra Megatron flags, name -> value (true: bare flag)", {})

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"name {self.name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        if self.post_training.method != "none" and self.training.flow is not None:
            raise ValueError(f"post_training.method {self.post_training.method} runs megalaunch's own flow; "
                             f"training.flow {self.training.flow!r} cannot be set with it; fix: --set training.flow=null")
        _check_flow_layout(self)


def _check_flow_layout(recipe: Recipe) -> None:
    """Flows (training.flow, post_training) run with pipeline and context parallelism 1; DPO and IPO read
    preference pairs (data.format chat, written by `megalaunch data sft`)."""
    pt, par = recipe.post_training, recipe.parallel
    what = f"post_training.method {pt.method}" if pt.method != "none" else "training.flow" if recipe.training.flow else None
    if what is None:
        return
    for name, value in (("pipeline_model_parallel_size", par.pipeline_model_parallel_size),
                        ("context_parallel_size", par.context_parallel_size)):
        if value != 1:
            raise ValueError(f"{what} runs with parallel.{name} 1 in this version, got {value}; "
                             f"fix: --set parallel.{name}=1 (tensor and data parallelism both work)")
    t = recipe.training
    for name, value in (("micro_batch_size", t.micro_batch_size), ("global_batch_size", t.global_batch_size)):
        if pt.method in ("dpo", "ipo") and value % 2:
            raise ValueError(f"training.{name} counts sequences and a preference pair is two (post_training.method "
                             f"{pt.method}), got {value}; fix: --set training.{name}={value + 1}")
    if pt.method in ("dpo", "ipo") and recipe.data.format != "chat":
        raise ValueError(f"post_training.method {pt.method} reads preference pairs (data.format chat), got data.format "
                         f"{recipe.data.format}; fix: --set data.format=chat with pairs written by `megalaunch data sft` "
                         "(rows with prompt, chosen, rejected), or data.chat_files")
