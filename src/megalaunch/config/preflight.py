"""Checks that run before anything is written or submitted, and `preflight`, which runs every one in
the order a user would want to hear about them. Each failure is one PreflightError naming the field,
what is valid and the fix (the README lists the checks). The parallel layout's checks are
config/topology.py's; what values may hold, config/values.py's; the ways to tell a person,
config/notify.py's."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from megalaunch.config.notify import check_notify
from megalaunch.config.schema import Recipe
from megalaunch.config.tokenizer import TokenizerSpec, check_loads, resolve_tokenizer
from megalaunch.config.topology import Topology, check_model_parallel, check_shrink, topology
from megalaunch.config.values import check_no_secrets, check_sbatch_values, check_single_tokens
from megalaunch.errors import PreflightError


def signal_lead_s(recipe: Recipe) -> int:
    """Seconds before the limit at which Slurm should signal: one save, one step, Slurm's check
    period (the signal can come that much late) and a margin."""
    c = recipe.chain
    return math.ceil(recipe.checkpoint.save_time_estimate_s + c.step_time_estimate_s
                     + check_period_s(recipe) + c.signal_margin_s)


def check_period_s(recipe: Recipe) -> int:
    """How late the signal may come: Slurm checks every 30 s; the local backend's timer is exact."""
    return recipe.cluster.traits.signal_delay_s


def _require(ok: bool, field: str, message: str, valid: str, fix: str) -> None:
    if not ok:
        raise PreflightError(message, field=field, valid=valid, fix=fix)


def check_schedule(recipe: Recipe) -> None:
    """The learning-rate schedule's arithmetic, which Megatron only asserts when it builds the
    scheduler inside the job (`AssertionError` with no text)."""
    t = recipe.training
    decay = t.lr_decay_iters or t.train_iters
    decay_field = "training.lr_decay_iters" if t.lr_decay_iters else "training.train_iters"
    _require(t.lr_warmup_iters >= 0, "training.lr_warmup_iters", f"is {t.lr_warmup_iters}", ">= 0",
             "--set training.lr_warmup_iters=0")
    _require(t.lr_warmup_iters < decay, "training.lr_warmup_iters",
             f"{t.lr_warmup_iters} warm-up iterations are not fewer than the {decay} decay iterations ({decay_field})",
             f"< {decay}", f"lower lr_warmup_iters or raise {decay_field}")
    _require(decay <= t.train_iters, "training.lr_decay_iters",
             f"{decay} decay iterations exceed train_iters {t.train_iters}: the schedule would not finish",
             f"<= {t.train_iters}", "--set training.lr_decay_iters=null (decay over train_iters)")
    _require(0 <= t.min_lr <= t.lr, "training.min_lr", f"{t.min_lr} is not between 0 and lr {t.lr}",
             f"0 <= min_lr <= {t.lr}", "lower training.min_lr")


def check_sharding(recipe: Recipe) -> None:
    """Megatron-FSDP (`parallel.data_sharding`) where megalaunch has proven it: no pipeline stages, its own
    checkpoint format, synchronous saves (the asynchronous writer and its staging are torch_dist's)."""
    p, c, field = recipe.parallel, recipe.checkpoint, "parallel.data_sharding"
    if p.data_sharding == "optimizer":
        return
    _require(p.pipeline_model_parallel_size == 1, field, f"{p.data_sharding} is not built for pipeline stages "
             f"(pipeline_model_parallel_size {p.pipeline_model_parallel_size})", "pipeline_model_parallel_size 1",
             "set parallel.pipeline_model_parallel_size=1, or parallel.data_sharding=optimizer")
    _require(c.ckpt_format == "torch_dist", "checkpoint.ckpt_format", f"Megatron-FSDP saves fsdp_dtensor, not {c.ckpt_format}",
             "torch_dist (the default; FSDP runs save fsdp_dtensor)", "remove checkpoint.ckpt_format")
    _require(c.async_save is not True, "checkpoint.async_save", "asynchronous saves are torch_dist's; "
             "Megatron-FSDP runs save synchronously", "auto or false", "set checkpoint.async_save=auto")


def check_cluster(recipe: Recipe) -> None:
    cl, t = recipe.cluster, recipe.training
    check_sbatch_values(recipe)
    if not cl.traits.multi_node:
        _require(cl.nodes == 1, "cluster.nodes", f"the {cl.backend} backend runs on one node, not {cl.nodes}", "1",
                 "--set cluster.nodes=1, or use --backend slurm")
    if cl.gpus_per_node > 0 and cl.tasks_per_node is not None:
        _require(cl.tasks_per_node == cl.gpus_per_node, "cluster.tasks_per_node",
                 f"{cl.tasks_per_node} tasks for {cl.gpus_per_node} GPUs per node; megalaunch runs one task per GPU",
                 f"{cl.gpus_per_node} (or unset)", "--set cluster.tasks_per_node=null")
    if cl.gpus_per_node == 0:
        _require(recipe.checkpoint.async_save is not True, "checkpoint.async_save",
                 "asynchronous saves need a GPU (Megatron's persistent save worker fails on CPU)",
                 "false or auto when gpus_per_node is 0", "--set checkpoint.async_save=auto")
        _require(t.precision in ("fp32", "fp8"), "training.precision", f"{t.precision} on a CPU-only job",
                 "fp32 (or fp8, on fp32 weights) when gpus_per_node is 0", "--set training.precision=fp32")
        _require(t.kernels != "liger", "training.kernels", "liger-kernel's Triton kernels need a GPU",
                 "auto or megatron when gpus_per_node is 0", "--set training.kernels=auto")
    te = t.transformer_impl == "transformer_engine"
    _require(t.kernels != "liger" or not te, "training.kernels",
             "liger goes with transformer_impl: local (transformer-engine's layers bring their own fusions)",
             "auto, te or megatron with transformer_impl: transformer_engine", "--set training.kernels=auto")
    _require(t.kernels != "te" or te, "training.kernels", "te means transformer-engine's layers",
             "te with transformer_impl: transformer_engine; auto, liger or megatron with local",
             "--set training.kernels=auto (or --set training.transformer_impl=transformer_engine)")
    _require(t.precision != "fp8" or not te or t.fp8_recipe == "tensorwise", "training.fp8_recipe",
             "rowwise is megalaunch's own FP8 path (transformer_impl: local); transformer-engine's is tensorwise here",
             "tensorwise with transformer_impl: transformer_engine", "--set training.fp8_recipe=tensorwise")
    lead = signal_lead_s(recipe)
    period = check_period_s(recipe)
    room = cl.time_limit_s - lead - period
    _require(room >= recipe.chain.min_train_time_s, "cluster.time",
             f"{cl.time} leaves {max(room, 0)} s of training after the {lead} s signal lead "
             f"(save {recipe.checkpoint.save_time_estimate_s:g} s + step {recipe.chain.step_time_estimate_s:g} s "
             f"+ check period {period} s + margin {recipe.chain.signal_margin_s} s, "
             f"+ up to {period} s early)",
             f"at least {lead + period + recipe.chain.min_train_time_s} s",
             "raise cluster.time or lower checkpoint.save_time_estimate_s")
    _require(recipe.chain.max_segments_without_progress >= 1, "chain.max_segments_without_progress",
             "must be >= 1", ">= 1", "--set chain.max_segments_without_progress=3")
    _require(recipe.chain.trigger_interval >= 1, "chain.trigger_interval", "must be >= 1", ">= 1",
             "--set chain.trigger_interval=1")
    _require(recipe.checkpoint.save_interval >= 1, "checkpoint.save_interval", "must be >= 1", ">= 1",
             "--set checkpoint.save_interval=1000")
    _require(1 <= recipe.checkpoint.writer_threads <= 64, "checkpoint.writer_threads",
             f"{recipe.checkpoint.writer_threads} writer threads", "1 to 64", "--set checkpoint.writer_threads=8")


def recipe_tokenizer(recipe: Recipe) -> TokenizerSpec | None:
    """The recipe's Hugging Face tokenizer, resolved (special tokens, ids) and loaded the way the
    job will load it; None for the NullTokenizer. One-line PreflightError for what Megatron refuses."""
    d = recipe.data
    if d.tokenizer_type != "HuggingFaceTokenizer" or not d.tokenizer_model:
        return None
    spec = resolve_tokenizer(d.tokenizer_model, field_name="data.tokenizer_model")
    check_loads(spec, field_name="data.tokenizer_model")
    return spec


def check_files(recipe: Recipe) -> None:
    if recipe.checkpoint.load:
        _require(Path(os.path.expanduser(recipe.checkpoint.load)).is_dir(), "checkpoint.load",
                 f"{recipe.checkpoint.load} is not a directory", "a Megatron checkpoint directory",
                 "fix the path or remove checkpoint.load")
    if recipe.checkpoint.from_hf:
        _require(Path(os.path.expanduser(recipe.checkpoint.from_hf), "config.json").is_file(), "checkpoint.from_hf",
                 f"{recipe.checkpoint.from_hf} has no config.json", "a Hugging Face model directory (config.json "
                 "and safetensors)", "fix the path, or convert first and use checkpoint.load")
    pt = recipe.post_training
    _require(pt.method != "grpo" or pt.kl_coeff == 0 or bool(recipe.checkpoint.from_hf), "post_training.kl_coeff",
             f"post_training.kl_coeff {pt.kl_coeff} needs the starting model as Hugging Face weights (the reference "
             "scores each rollout round with them as it arrives)", "0, or > 0 with checkpoint.from_hf",
             "submit --from-hf DIR, or --set post_training.kl_coeff=0")
    if pt.method == "grpo" and pt.rollouts:  # the rounds there now, row by row (the later ones: in the job)
        from megalaunch.data.rollouts import SHAPES, RolloutError, check_rollout_source

        try:
            check_rollout_source(pt.rollouts)
        except RolloutError as e:
            raise PreflightError(str(e), field="post_training.rollouts", valid=SHAPES,
                                 fix="correct those rows (or the path), then submit again") from None
    if recipe.data.chat_files:
        _require(os.path.exists(os.path.expanduser(recipe.data.chat_files)), "data.chat_files",
                 f"{recipe.data.chat_files} does not exist", "chat JSONL/parquet files or a folder of them",
                 "fix the path (submit --data DIR)")


def resolve_data_blend(recipe: Recipe) -> Any | None:
    """The frozen blend (or None for mock data); raises PreflightError for missing .bin/.idx."""
    if recipe.data.mock or recipe.data.chat_files:  # chat files: the chain's first stage writes the blend
        return None
    from megalaunch.data.blend import load_blend_file, resolve_blend

    if recipe.data.blend_file:
        blend = load_blend_file(recipe.data.blend_file)
    else:
        blend = resolve_blend([(os.path.expanduser(e.path), e.weight) for e in recipe.data.blend])
    blend.check_files()
    return blend


def tokenizer_vocab_size(recipe: Recipe, spec: TokenizerSpec | None = None) -> int | None:
    """The tokenizer's vocabulary size (tokenizer.json is plain JSON: no library needed)."""
    if recipe.data.tokenizer_type == "NullTokenizer":
        return recipe.data.vocab_size
    spec = spec or recipe_tokenizer(recipe)
    return spec.vocab_size if spec is not None else None


def check_blend_dtypes(recipe: Recipe, blend: Any, spec: TokenizerSpec | None = None) -> None:
    """A uint16 dataset cannot hold the ids of a tokenizer with more than 65,536 entries."""
    vocab = tokenizer_vocab_size(recipe, spec)
    if blend is None or vocab is None:
        return
    from megalaunch.data.index import read_index_header

    for prefix, _ in blend.prefixes:
        header = read_index_header(prefix)
        if header.itemsize == 2 and vocab > 65536:
            raise PreflightError(f"{prefix} stores uint16 tokens but the tokenizer has {vocab} entries",
                                 field="data.blend", valid="int32 datasets for vocabularies over 65,536",
                                 fix=f"re-tokenize with this tokenizer, or check the dataset: megalaunch data check {prefix}")


def preflight(recipe: Recipe, *, frozen_blend: Any | None = None) -> tuple[Topology, Any | None]:
    """Every check, in the order a user would want to hear about them. Returns the topology and
    the resolved data blend (`frozen_blend`, a run's own, when resuming on it: checked, not re-resolved)."""
    check_no_secrets(recipe)
    check_cluster(recipe)
    check_notify(recipe)
    check_single_tokens(recipe)
    check_schedule(recipe)
    topo = topology(recipe)
    check_model_parallel(recipe, topo)
    check_sharding(recipe)
    counts = check_shrink(recipe)
    check_files(recipe)
    spec = recipe_tokenizer(recipe)
    if frozen_blend is not None:
        frozen_blend.check_files()
        blend = frozen_blend
    else:
        blend = resolve_data_blend(recipe)
    check_blend_dtypes(recipe, blend, spec)
    if recipe.data.format == "chat" and (blend is not None or recipe.data.chat_files):
        from megalaunch.config.chat_data import check_chat_data

        check_chat_data(blend, spec)
    check_validation(recipe)
    check_eval(recipe)
    from megalaunch.config.planner.fit import check_memory

    check_memory(recipe, topo.dp, topo.num_microbatches, tokenizer_vocab_size(recipe, spec))
    if len(counts) > 1:  # the smallest step a shrink may run: fewer DP ranks hold more optimizer state each
        smallest = dataclasses.replace(recipe, cluster=dataclasses.replace(recipe.cluster, nodes=counts[-1], min_nodes=None))
        small = topology(smallest)
        try:
            check_memory(smallest, small.dp, small.num_microbatches, tokenizer_vocab_size(recipe, spec))
        except PreflightError as e:
            raise PreflightError(f"shrunk to {counts[-1]} nodes (DP {small.dp}): {e.message}", field="cluster.min_nodes",
                                 valid="a cluster.min_nodes whose smallest step fits in GPU memory",
                                 fix="raise cluster.min_nodes") from e
    return topo, blend


def eval_interval(recipe: Recipe) -> int:
    """Iterations between evaluations: eval.interval, else the milestones; 0 when evaluation is off."""
    if not recipe.eval.enabled:
        return 0
    return recipe.eval.interval or recipe.checkpoint.milestone_interval


def validation_fraction(split: str) -> float:
    """The validation share of Megatron's --split ("98,2,0" -> 0.02)."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        return 0.0
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[1] / total if total > 0 and len(parts) == 3 else 0.0


def check_validation(recipe: Recipe) -> None:
    """Megatron builds a validation loader whenever data.split has a validation share, and asserts
    ("no sample to consume: 0") in the first segment when training.eval_iters is 0."""
    if recipe.data.mock or validation_fraction(recipe.data.split) == 0:
        return
    _require(recipe.training.eval_iters > 0, "training.eval_iters",
             f"data.split {recipe.data.split!r} holds a validation split but training.eval_iters is 0: Megatron "
             "would stop at start-up (no sample to consume)", ">= 1 (Megatron's validation batches per evaluation)",
             "--set training.eval_iters=1 (with a large training.eval_interval: Megatron validates rarely), "
             "or --set data.split=100,0,0")


def check_eval(recipe: Recipe) -> None:
    """The eval section: an eval iteration must be a checkpoint; held-out perplexity needs held-out
    tokens; text tasks need a tokenizer; local task files must exist (their content is the eval's)."""
    ev = recipe.eval
    if not ev.enabled:
        return
    interval = eval_interval(recipe)
    _require(interval > 0, "eval.interval", "evaluation is on but no iteration is evaluated",
             "eval.interval > 0, or checkpoint.milestone_interval > 0",
             "--set checkpoint.milestone_interval=N (evaluate each milestone) or --set eval.interval=N")
    save = recipe.checkpoint.save_interval
    _require(interval % save == 0, "eval.interval", f"{interval} is not a multiple of checkpoint.save_interval "
             f"{save}: there would be no checkpoint to evaluate", f"a multiple of {save}",
             f"--set eval.interval={max(save, interval // save * save)}")
    if ev.heldout_sequences > 0 and not ev.heldout_blend:
        _require(not recipe.data.mock, "eval.heldout_sequences", "held-out perplexity needs real data; this run "
                 "trains on mock data", "data.blend with a validation split, or eval.heldout_blend",
                 "--set eval.heldout_sequences=0, or --set 'eval.heldout_blend=[PREFIX]'")
        _require(validation_fraction(recipe.data.split) > 0, "data.split",
                 f"{recipe.data.split!r} has no validation split for held-out perplexity",
                 "train,valid,test with valid > 0 (e.g. 98,2,0)",
                 "--set data.split=98,2,0, or --set 'eval.heldout_blend=[PREFIX]', or --set eval.heldout_sequences=0")
    for prefix in ev.heldout_blend:
        _require(os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx"), "eval.heldout_blend",
                 f"{prefix} has no .bin/.idx", "dataset prefixes (PATH for PATH.bin + PATH.idx)",
                 "fix the path (megalaunch data check DIR lists the prefixes)")
    text_tasks = [t.name for t in ev.local_tasks] + list(ev.tasks)
    if text_tasks:
        _require(recipe.data.tokenizer_type == "HuggingFaceTokenizer", "eval.local_tasks",
                 f"tasks {', '.join(text_tasks)} are text but the run has no tokenizer (NullTokenizer)",
                 "data.tokenizer_type: HuggingFaceTokenizer", "train with a tokenizer, or drop the tasks")
    for i, task in enumerate(ev.local_tasks):
        _require(os.path.isfile(task.path), f"eval.local_tasks[{i}].path", f"{task.path} is not a file",
                 "a JSON-lines file of {context, choices, answer}", "fix the path")
    for path in ev.task_paths:
        _require(os.path.isdir(path), "eval.task_paths", f"{path} is not a directory",
                 "a directory of lm-eval task YAMLs", "fix the path")
