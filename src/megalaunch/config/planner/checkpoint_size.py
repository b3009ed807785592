"""Bytes of one checkpoint, and the most that a run's retention keeps on disk at once. Plain arithmetic
on the model's parameter count (config/planner/memory.py), so it runs on login nodes.

One Megatron torch_dist checkpoint holds, per parameter:
- the model's weights in the working precision: 2 bytes (bf16/fp16) or 4 (fp32);
- fp32 main parameters, 4 bytes, when the weights are not fp32 (Megatron's mixed-precision optimizer)
  and with the distributed optimizer in any precision (it saves its fp32 `param` shards: measured 16
  bytes per parameter for fp32 with it, 12 without);
- Adam's two moments, fp32: 8 bytes (SGD's momentum: 4).
Gradients are not saved. So llama3-1b (1.24 B parameters, bf16, Adam) is 14 bytes x 1.24 B = 17.3 GB
(16.1 GiB; measured "~16 GB" on one H200, FACTS.md), whatever the layout: the shards of all ranks add
up to one copy of the model and optimizer state.

What torch_dist adds, measured on the tiny recipe (torch 2.14, megatron-core 0.19.2; the bytes of every
file matched this model exactly, tests/megatron/test_checkpoint_size.py): each stored item, a tensor
shard or a pickled object, is written with torch.save's zip framing (`ITEM_BYTES` for a tensor);
the objects are Megatron's common state (its arguments), the RNG state of each model-parallel rank,
the rerun state machine of each rank and an `_extra_state` per linear layer; the `.metadata` file
grows with the items. For a tiny model this is ~9 % of the checkpoint; for 1 B parameters, 0.005 %."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megalaunch.config.planner.memory import ModelShape
from megalaunch.config.schema import Recipe
from megalaunch.errors import MegalaunchError

if TYPE_CHECKING:
    from megalaunch.config.tokenizer import TokenizerSpec

# torch_dist framing, measured (tiny recipe, torch 2.14, megatron-core 0.19.2):
ITEM_BYTES = 1577  # torch.save's zip framing around each tensor item in a .distcp file
EXTRA_STATE_BYTES = 1261  # a linear layer's pickled `_extra_state` (None without fp8)
COMMON_BYTES = 31_721  # common_state: Megatron's arguments, iteration, optimizer param groups
RNG_BYTES = 15_449  # rng_state, one per model-parallel rank (TP x PP)
RERUN_BYTES = 1_709  # rerun_state_machine_state, one per rank
DISTOPT_OBJECT_BYTES = 1837 + 2 * 1261  # the distributed optimizer's param groups and bucket sizes
METADATA_BYTES, METADATA_ITEM_BYTES, METADATA_RANK_BYTES = 13_630, 117, 1_900  # the `.metadata` file
TRACKER_BYTES = 63  # metadata.json


@dataclass(frozen=True)
class CheckpointSize:
    """One checkpoint, in bytes."""

    params: int
    weights: float  # the model in the working precision
    main_params: float  # fp32 master copy (0 when none is saved)
    moments: float  # the optimizer's state
    overhead: float  # torch_dist's framing, pickled objects and metadata
    precision: str = "bf16"

    @property
    def total(self) -> float:
        return self.weights + self.main_params + self.moments + self.overhead

    def describe(self) -> str:
        """'17.3 GB (1.24 B parameters x 14 B: bf16 weights 2 + fp32 main params 4 + Adam moments 8)'"""
        from megalaunch.runtime.rank.storage import gb

        n = self.params
        parts = [f"{self.precision} weights {self.weights / n:g}"] if self.weights else []
        if self.main_params:
            parts.append(f"fp32 main params {self.main_params / n:g}")
        parts.append(f"optimizer moments {self.moments / n:g}")
        per = (self.weights + self.main_params + self.moments) / n
        count = f"{n / 1e9:.3g} B" if n >= 1e8 else f"{n / 1e6:.3g} M"
        return (f"{gb(self.total)} ({count} parameters x {per:g} bytes: {' + '.join(parts)}; "
                f"+ {self.overhead / 1e6:.2g} MB {'metadata' if not self.weights else 'torch_dist metadata'})")


def _layer_tensors(shape: ModelShape) -> tuple[int, int]:
    """(tensors of one layer that TP splits, tensors it replicates), as torch_dist stores them: the
    SwiGLU's first linear as two (gate and up), the norms (LayerNorm: weight and bias)."""
    split = 4 + (1 if shape.swiglu else 0)  # qkv, proj, fc1 (x2 with SwiGLU), fc2
    if shape.bias:
        split += 2 + (1 if shape.swiglu else 0)  # qkv and fc1 biases (TP-split); proj and fc2 replicated
    elif shape.qkv_bias:
        split += 1
    norms = 2 * (1 if shape.norm == "RMSNorm" else 2)
    return split, norms + (2 if shape.bias else 0)


FSDP_ITEM_BYTES = 9_500  # fsdp_dtensor's framing and metadata per tensor item (tiny recipe, 2 ranks, CPU and GPU)


def fsdp_checkpoint_size(shape: ModelShape, *, precision: str, moments: int = 2) -> CheckpointSize:
    """One fsdp_dtensor checkpoint (Megatron-FSDP): the fp32 main weights and the moments, one torch.distributed.
    checkpoint item per model tensor and per state of each (measured, tiny recipe on 2 ranks, CPU fp32 and GPU bf16
    alike: 2,317,444 and 2,322,409 bytes for 139,584 parameters; predicted 2,321,008)."""
    split, replicated = _layer_tensors(shape)
    tensors = shape.layers * (split + replicated) + (1 if shape.tied else 2) + (1 if shape.norm == "RMSNorm" else 2)
    n = shape.total_params()
    return CheckpointSize(params=n, weights=0.0, main_params=4.0 * n, moments=float(4 * moments * n),
                          overhead=float(FSDP_ITEM_BYTES * tensors * (2 + moments)), precision=precision)


def checkpoint_size(shape: ModelShape, *, precision: str, distributed_optimizer: bool, tp: int = 1, pp: int = 1,
                    world: int = 1, moments: int = 2) -> CheckpointSize:
    """One torch_dist checkpoint of `shape` trained in `precision` on `world` ranks (`moments`: Adam 2)."""
    n = shape.total_params()
    weight_bytes = 4 if precision == "fp32" else 2
    main = 4 if precision != "fp32" or distributed_optimizer else 0
    split, replicated = _layer_tensors(shape)
    model_items = shape.layers * (split * tp + replicated) + tp * (1 if shape.tied else 2) \
        + (1 if shape.norm == "RMSNorm" else 2)
    if distributed_optimizer:  # one item per parameter (a range of the flat buffer) and state
        params = shape.layers * (split - (1 if shape.swiglu else 0) + replicated) + (1 if shape.tied else 2) + \
            (1 if shape.norm == "RMSNorm" else 2)
        opt_items = params * tp * (moments + 1)
    else:  # one item per model tensor and state
        opt_items = model_items * (moments + (1 if main else 0))
    linears = 4 * shape.layers * tp
    objects = (COMMON_BYTES + RNG_BYTES * tp * pp + RERUN_BYTES * world + EXTRA_STATE_BYTES * linears
               + (DISTOPT_OBJECT_BYTES if distributed_optimizer else 0))
    items = model_items + opt_items + linears + 1 + tp * pp + world + (3 if distributed_optimizer else 0)
    metadata = METADATA_BYTES + METADATA_ITEM_BYTES * items + METADATA_RANK_BYTES * (world - 1) + TRACKER_BYTES
    overhead = ITEM_BYTES * (model_items + opt_items) + objects + metadata
    return CheckpointSize(params=n, weights=float(weight_bytes * n), main_params=float(main * n),
                          moments=float(4 * moments * n), overhead=float(overhead), precision=precision)


@dataclass(frozen=True)
class DiskPeak:
    """The most checkpoint bytes a run holds at once: at its last save, when every milestone exists."""

    checkpoint: CheckpointSize
    keep_last: int
    regular: int  # complete checkpoints kept (keep_last, or every save when keep_last is 0) + the one being written
    milestones: int  # milestones older than the regular ones (kept forever)
    eval_waiting: int  # a checkpoint kept until its evaluation ran (0 when evaluations are milestones)
    hf_copies: int  # Hugging Face copies an evaluation writes (RUN/evals/<iteration>/hf)
    hf_bytes: float  # one of them
    scores_bytes: float = 0.0  # stored scores of post-training (RUN/scores/**: config/training/score_budget.py)

    @property
    def checkpoints(self) -> int:
        return self.regular + self.milestones + self.eval_waiting

    @property
    def total(self) -> float:
        return self.checkpoints * self.checkpoint.total + self.hf_copies * self.hf_bytes + self.scores_bytes

    def describe(self) -> str:
        """'51.9 GB: 3 checkpoints (keep_last 2 + 1 being written) + 1 milestone + ...'"""
        from megalaunch.runtime.rank.storage import gb

        kept = f"keep_last {self.keep_last} + 1 being written" if self.keep_last > 0 else "every save (keep_last 0)"
        parts = [f"{self.regular} checkpoint{'s' * (self.regular != 1)} ({kept})"]
        if self.milestones:
            parts.append(f"{self.milestones} milestone{'s' * (self.milestones != 1)}")
        if self.eval_waiting:
            parts.append(f"{self.eval_waiting} waiting for its evaluation")
        if self.hf_copies:
            parts.append(f"{self.hf_copies} Hugging Face cop{'ies' if self.hf_copies != 1 else 'y'} for evaluation "
                         f"({gb(self.hf_bytes)} each)")
        if self.scores_bytes:
            parts.append(f"stored scores {gb(self.scores_bytes)} (RUN/scores, GRPO's RUN/rollouts)")
        return f"{gb(self.total)}: " + " + ".join(parts)


def save_iterations(train_iters: int, save_interval: int) -> list[int]:
    """The regular saves: every save_interval-th iteration, and the last one."""
    saves = list(range(save_interval, train_iters, save_interval))
    return [*saves, train_iters]


def peak_counts(*, train_iters: int, save_interval: int, keep_last: int,
                milestone_interval: int) -> tuple[int, int]:
    """(regular checkpoints incl. the one being written, milestones) at the last save, where the peak is
    (runtime/retention.keep: milestones are kept and not counted in `keep_last`)."""
    s = max(save_interval, 1)
    n_before = len(range(s, train_iters, s))  # complete saves before the last one
    if keep_last < 1:
        return n_before + 1, 0
    # a milestone is kept only if it was saved
    milestones = (train_iters - 1) // math.lcm(s, milestone_interval) if milestone_interval > 0 else 0
    return min(keep_last, n_before - milestones) + 1, milestones


def disk_peak(checkpoint: CheckpointSize, shape: ModelShape, *, train_iters: int, save_interval: int,
              keep_last: int, milestone_interval: int, eval_interval: int = 0, keep_hf: bool = False) -> DiskPeak:
    """The peak of the new retention (`keep_last` complete checkpoints + the one being written), plus
    milestones and what evaluation keeps (`eval_interval` 0: evaluation off)."""
    regular, milestones = peak_counts(train_iters=train_iters, save_interval=save_interval, keep_last=keep_last,
                                      milestone_interval=milestone_interval)
    waiting = hf = 0
    if eval_interval > 0:
        evaluated_are_milestones = milestone_interval > 0 and eval_interval % milestone_interval == 0
        waiting = 0 if evaluated_are_milestones or keep_last < 1 else 1
        hf = train_iters // eval_interval if keep_hf else 1
    hf_params = dataclasses.replace(shape, vocab_divisible_by=1).total_params()  # HF keeps the real vocabulary
    hf_bytes = hf_params * (4 if checkpoint.precision == "fp32" else 2)
    return DiskPeak(checkpoint=checkpoint, keep_last=keep_last, regular=regular, milestones=milestones,
                    eval_waiting=waiting, hf_copies=hf, hf_bytes=float(hf_bytes))


def recipe_peak(recipe: Recipe, vocab_size: int | None) -> DiskPeak:
    """The checkpoint size and disk peak of a recipe (`vocab_size`: the tokenizer's, None: 32,000)."""
    from megalaunch.config.megatron_args import fsdp, working_precision
    from megalaunch.config.planner.fit import model_shape
    from megalaunch.config.preflight import eval_interval

    shape = model_shape(recipe, vocab_size)
    p, c = recipe.parallel, recipe.checkpoint
    sgd = str(recipe.megatron_args.get("optimizer", "adam")).lower() == "sgd"
    size = checkpoint_size(shape, precision=working_precision(recipe),
                           distributed_optimizer=p.use_distributed_optimizer, tp=p.tensor_model_parallel_size,
                           pp=p.pipeline_model_parallel_size, world=recipe.cluster.world_size, moments=1 if sgd else 2)
    if fsdp(recipe):
        size = fsdp_checkpoint_size(shape, precision=working_precision(recipe), moments=1 if sgd else 2)
    return disk_peak(size, shape, train_iters=recipe.training.train_iters, save_interval=c.save_interval,
                     keep_last=c.keep_last, milestone_interval=c.milestone_interval,
                     eval_interval=eval_interval(recipe), keep_hf=recipe.eval.keep_hf)


def recipe_checkpoint_bytes(recipe: Recipe, tokenizer: TokenizerSpec | None = None) -> int | None:
    """One checkpoint's bytes for the job's check before a save (RuntimeSettings.checkpoint_bytes);
    None for a workload run or a model whose size cannot be told."""
    from megalaunch.config.preflight import tokenizer_vocab_size

    if recipe.workload:
        return None
    try:
        return int(recipe_peak(recipe, tokenizer_vocab_size(recipe, tokenizer)).checkpoint.total)
    except (MegalaunchError, ValueError, OSError):
        return None


def peak_lines(peak: DiskPeak) -> list[str]:
    """What `plan`, `submit` and its dry run show: the size of one checkpoint, and the peak on disk."""
    return [f"checkpoint: {peak.checkpoint.describe()}", f"disk peak: {peak.describe()}"]
