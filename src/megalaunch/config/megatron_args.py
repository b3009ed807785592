"""Recipe -> Megatron command-line arguments (written one per line into RUN/megatron.args). This is
the one place Megatron's argument list is built: the job reads the file and adds nothing
(docs/architecture.md, "The job gets only its slice").

Schema fields map one-to-one to Megatron flags (`num_layers` -> `--num-layers`); booleans are bare
flags when true and omitted when false; `megatron_args` passthrough comes last, so it wins."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from megalaunch.config.model.mla import MLA_FIELDS, mla_args
from megalaunch.config.model.moe import MOE_FIELDS, moe_args
from megalaunch.config.schema import Recipe
from megalaunch.rundir.paths import RunPaths

# Fields that are megalaunch's own, not Megatron flags.
_TRAINING_OWN = {"precision", "fp8_recipe", "attention", "kernels", "recompute", "fused_kernels", "log_interval", "eval_interval",
                 "eval_iters", "flow"}
_CHECKPOINT_OWN = {"keep_last", "milestone_interval", "save_time_estimate_s", "load", "from_hf", "allow_blend_change",
                   "async_save", "disk_check", "writer_threads"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _emit(out: list[str], name: str, value: Any) -> None:
    if value is None or value is False:
        return
    if value is True:
        out.append(flag(name))
    elif isinstance(value, (list, tuple)):
        out.append(flag(name))
        out.extend(str(v) for v in value)
    else:
        out.extend([flag(name), str(value)])


def _section(out: list[str], section: Any, skip: set[str]) -> None:
    for f in fields(section):
        if f.name not in skip:
            _emit(out, f.name, getattr(section, f.name))


def _model_args(recipe: Recipe) -> list[str]:
    out: list[str] = []
    m = recipe.model
    _section(out, m, set(MOE_FIELDS) | set(MLA_FIELDS) | {"use_rope_scaling", "rope_scaling_factor"})
    if m.use_rope_scaling:
        out += ["--use-rope-scaling", "--rope-scaling-factor", str(m.rope_scaling_factor)]
    if m.num_query_groups is not None:
        out.append("--group-query-attention")
    return out + mla_args(m) + moe_args(m)


def recompute_args(mode: str) -> list[str]:
    """training.recompute -> Megatron's flags: selective recomputes the core attention; full recomputes
    every layer from its input (uniform, one layer per checkpoint: the least memory)."""
    if mode == "selective":
        return ["--recompute-granularity", "selective"]
    if mode == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return []


def fused_kernels(recipe: Recipe, gpus_per_node: int | None = None) -> bool:
    """training.fused_kernels resolved: auto is on with GPUs (Triton compiles them), off on the CPU; GPUs
    per node are the recipe's unless given (`megalaunch plan --gpus-per-node`)."""
    value = recipe.training.fused_kernels
    gpus = recipe.cluster.gpus_per_node if gpus_per_node is None else gpus_per_node
    return gpus > 0 if value == "auto" else bool(value)


def megatron_args(recipe: Recipe, paths: RunPaths) -> list[str]:
    """The full Megatron argument list for this recipe and run directory."""
    out = _model_args(recipe)
    m = recipe.model

    _section(out, recipe.parallel, {"virtual_pipeline_model_parallel_size", "layout", "data_sharding"})
    if fsdp(recipe):  # Megatron-FSDP: its own checkpoint format, and the distributed optimizer it needs
        out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", FSDP_STRATEGY[recipe.parallel.data_sharding]]
        if not recipe.parallel.use_distributed_optimizer:
            out.append("--use-distributed-optimizer")
    vpp = recipe.parallel.virtual_pipeline_model_parallel_size
    if vpp:
        layers_per_chunk = m.num_layers // (recipe.parallel.pipeline_model_parallel_size * vpp)
        _emit(out, "num_layers_per_virtual_pipeline_stage", layers_per_chunk)

    t = recipe.training
    _section(out, t, _TRAINING_OWN | {"lr_decay_iters", "transformer_impl"})
    _emit(out, "lr_decay_iters", t.lr_decay_iters or t.train_iters)
    _emit(out, "transformer_impl", t.transformer_impl)
    out += precision_args(recipe)
    out += recompute_args(t.recompute)
    _emit(out, "log_interval", t.log_interval)
    _emit(out, "eval_interval", t.eval_interval)
    _emit(out, "eval_iters", t.eval_iters)
    fused = fused_kernels(recipe)
    if t.transformer_impl == "local":
        # These fused paths need apex/TE; the local implementation needs them off (docs/training.md).
        out += ["--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                "--no-rope-fusion"]
        if not fused:  # torch.compile'd (megatron.core.jit): no apex/TE, but a compiler on the GPU
            out += ["--no-bias-swiglu-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion"]
    if fused and working_precision(recipe) == "bf16":
        # Megatron refuses TE's (unstable), and the native one is torch.compile'd like the rest. bf16 only:
        # its backward hands the logits' gradient back in bf16, which fp32 and fp16 training would not want.
        out += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]

    c = recipe.checkpoint
    out += ["--save", str(paths.checkpoints), "--load", str(paths.checkpoints)]
    _section(out, c, _CHECKPOINT_OWN)
    out[out.index("--ckpt-format") + 1] = checkpoint_format(recipe)
    if c.load:  # weights to start from when RUN/checkpoints holds nothing yet (e.g. a converted HF model)
        out += ["--pretrained-checkpoint", os.path.expanduser(c.load)]
    if c.from_hf:  # converted by the chain's first stage (launcher/chain/first_stage.py) into RUN/pretrained
        out += ["--pretrained-checkpoint", str(paths.root / "pretrained")]
    if async_save(recipe):
        out += ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]
        if c.writer_threads > 1:  # Megatron uses more than one writer only with a cached save plan
            out += ["--ckpt-assume-constant-structure", "--dist-ckpt-workers", str(c.writer_threads)]

    d = recipe.data
    if d.mock:
        out.append("--mock-data")
    else:
        out += ["--data-args-path", str(paths.data_blend)]
    out += ["--split", d.split, "--tokenizer-type", d.tokenizer_type, "--num-workers", str(d.num_workers)]
    if d.tokenizer_type == "HuggingFaceTokenizer":  # the run's frozen copy, loadable by AutoTokenizer
        _emit(out, "tokenizer_model", str(paths.tokenizer))
    else:  # the vocabulary size only means something to the NullTokenizer (a HF tokenizer has its own)
        _emit(out, "vocab_size", d.vocab_size)

    out += ["--exit-signal-handler", "--exit-signal", recipe.chain.stop_signal]
    if recipe.logging.tensorboard:
        out += ["--tensorboard-dir", str(paths.tensorboard)]
    if recipe.cluster.gpus_per_node == 0:  # a CPU job (the runtime hides any GPU from it)
        out += ["--distributed-backend", "gloo", "--use-cpu-initialization"]
        if fsdp(recipe):  # gloo has no PREMUL_SUM: scale the gradients, then a plain sum (runtime/loop/fsdp_patches.py)
            out.append("--no-gradient-reduce-div-fusion")
    g = recipe.debug
    if g.nsys:  # the window counts from the iteration each segment resumes from (the runtime shifts it)
        out += ["--profile", "--profile-step-start", str(g.nsys_start_offset),
                "--profile-step-end", str(g.nsys_start_offset + g.nsys_iters)]
    if recipe.post_training.method in ("dpo", "ipo"):  # the recipe counts sequences; Megatron's sample is a pair
        for flag in ("--micro-batch-size", "--global-batch-size"):
            out[out.index(flag) + 1] = str(int(out[out.index(flag) + 1]) // 2)
    for key, value in recipe.megatron_args.items():
        _emit(out, key, value)
    return out


def async_save(recipe: Recipe) -> bool:
    """`checkpoint.async_save` resolved: an explicit value stands (preflight refuses true on the CPU);
    auto is on with GPUs and torch_dist (the format Megatron's asynchronous writer supports)."""
    c = recipe.checkpoint
    if c.async_save == "auto":
        return recipe.cluster.gpus_per_node > 0 and checkpoint_format(recipe) == "torch_dist"
    return bool(c.async_save)


FSDP_STRATEGY = {"optimizer_grads": "optim_grads", "optimizer_grads_params": "optim_grads_params"}


def fsdp(recipe: Recipe) -> bool:
    """Whether the run shards gradients (and weights) with Megatron-FSDP (`parallel.data_sharding`)."""
    return recipe.parallel.data_sharding in FSDP_STRATEGY


def checkpoint_format(recipe: Recipe) -> str:
    """The format the run saves: Megatron-FSDP saves only fsdp_dtensor (a torch.distributed.checkpoint of
    one DTensor per parameter); otherwise `checkpoint.ckpt_format`."""
    return "fsdp_dtensor" if fsdp(recipe) else recipe.checkpoint.ckpt_format


def working_precision(recipe: Recipe) -> str:
    """The weights' and activations' precision: fp8 computes the transformer layers' GEMMs in FP8 on bf16
    (runtime/model/fp8.py), on fp32 in a CPU-only job (where bf16 is refused: config/preflight.py)."""
    t = recipe.training
    if t.precision == "fp8":
        return "fp32" if recipe.cluster.gpus_per_node == 0 else "bf16"
    return t.precision


def precision_args(recipe: Recipe) -> list[str]:
    """Megatron's precision flags; with fp8 on transformer-engine's layers, TE's own FP8 recipe (hybrid: e4m3
    forward, e5m2 gradients; the job's own path renders nothing more: runtime.json carries the recipe)."""
    t = recipe.training
    out = [] if working_precision(recipe) == "fp32" else [flag(working_precision(recipe))]
    if t.precision == "fp8" and t.transformer_impl == "transformer_engine":
        out += ["--fp8-format", "hybrid", "--fp8-recipe", t.fp8_recipe]
    return out
