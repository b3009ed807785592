"""User-defined training flows: a custom training step run by Megatron's own loop under the same
runtime as pre-training and SFT (decisions, signal and trigger saves, exact resume, goodput).

A flow is a class named in the recipe, `training.flow: "mypkg.flows:MyFlow"` (importable in the job's
Python), with one method and two optional attributes::

    class MyFlow(megalaunch.runtime.flows.flow.Flow):
        dataset = MyDataset      # optional: a megatron.core MegatronDataset class (default: the one
                                 # data.format names: GPTDataset for tokens, ChatDataset for chat)
        keys = ("tokens", "labels", "loss_mask", "position_ids")  # the batch tensors it needs

        def loss(self, model, batch) -> FlowLoss:
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            ...
            return FlowLoss(loss=summed, count=units, metrics={"accuracy": (hits, units)})

Batch in: every tensor in `keys` of one micro-batch, as [rows, seq] (leading dimensions of the
dataset's samples flattened, in the dataset's order), on this rank's device; megalaunch reads it on
tensor-parallel rank 0 and broadcasts it to the others. Loss and metrics out: `loss` summed over the
micro-batch's units (tokens, pairs, ...) and their `count`; Megatron divides by the counts (with
calculate_per_token_loss, as the SFT recipes set: by the step's total over micro-batches and
data-parallel ranks) and backpropagates. Each metric is (sum, count), reported as
sum/count over the whole step (all micro-batches and data-parallel ranks), next to `lm loss` (the
flow's loss). Pipeline and context parallelism are refused for flows in this version.

Built-in flows (`post_training.method`, config/training/post_training.py: DPO / IPO, GRPO, distillation)
get `self.config`, the recipe's post_training section as a dict, before any call; any flow may define
`prepare(model, context)`, called once per process after the model is loaded and before the first
iteration (a `FlowContext`: where the run is, the iteration loaded, the hang watcher's beat and the
stop decision; DPO scores its reference there)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megalaunch.runtime.rank.failures import ConfigFailure
from megalaunch.runtime.rank.hooks import StepHooks

DEFAULT_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class FlowLoss:
    """What a flow's step returns for one micro-batch."""

    loss: Any  # a scalar tensor: the loss summed over the micro-batch's units, with its graph
    count: Any  # a scalar tensor: how many units (Megatron divides the loss by it)
    metrics: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (sum, count), no graph needed


@dataclass
class FlowContext:
    """What `Flow.prepare` is given besides the model (runtime/loop/step.py makes it)."""

    run_dir: Path
    iteration: int  # the iteration the model was loaded at; 0: the starting model (a run's first segment)
    start: str | None  # the starting model's checkpoint (checkpoint.load / RUN/pretrained); None: random init
    seed: int
    prefixes: list[str]  # the training data's dataset prefixes (the frozen blend)
    seq_length: int
    micro_batch_size: int
    bf16: bool
    is_zero: bool
    log: Callable[[str], None]
    ledger: Callable[..., None]  # rank 0 writes the run's ledger
    beat: Callable[[str], None]  # tell the hang watcher that a long phase still makes progress
    decide: Callable[[], int]  # collective: the stop decision now (runtime/stop/decisions.Decision; 0: continue)
    act: Callable[[int], None]  # act on a decision: a stop leaves the segment (saved / exited / aborted)
    # a frozen copy of the starting model, loaded from the starting checkpoint (None: there is none, random init)
    frozen_start: Callable[[], Any] | None = None


class Flow:
    """Base class of a training flow (see the module docstring)."""

    dataset: Any = None
    keys: tuple[str, ...] = DEFAULT_KEYS
    config: dict[str, Any] = {}  # noqa: RUF012 (replaced per instance by load_flow)

    def loss(self, model: Any, batch: dict[str, Any]) -> FlowLoss:
        raise NotImplementedError


def load_flow(ref: str, config: dict[str, Any] | None = None) -> Flow:
    """`module:Class` -> an instance (`config`: the post_training section a built-in flow reads); a
    one-line error naming the field otherwise."""
    module_name, _, attr = ref.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigFailure(f"training.flow {ref!r} cannot be imported in the job ({e})",
                            fix="install its package in the job's Python, or put it on PYTHONPATH") from None
    flow = cls()
    if not callable(getattr(flow, "loss", None)):
        raise ConfigFailure(f"training.flow {ref!r} has no loss(model, batch) method",
                            fix="subclass megalaunch.runtime.flows.flow.Flow")
    if config is not None:
        flow.config = dict(config)
    return flow


def flow_dataset(ref: str) -> Any:
    """The flow's own dataset class, or None for the one data.format names."""
    return getattr(load_flow(ref), "dataset", None)


def get_flow_batch(data_iterator: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """This micro-batch on this rank, every tensor as [rows, seq] (integers as int64, the rest as
    float32): TP rank 0 reads it, the other TP ranks receive it."""
    import torch
    from megatron.core import mpu, tensor_parallel

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    raw = next(data_iterator) if mpu.get_tensor_model_parallel_rank() == 0 else None
    groups = {dtype: [k for k in keys if raw[k].is_floating_point() == (dtype == torch.float32)]
              if raw is not None else None
              for dtype in (torch.int64, torch.float32)}
    batch: dict[str, Any] = {}
    for dtype, names in _tp_broadcast_names(groups).items():
        data = {k: raw[k].to(dtype) for k in names} if raw is not None else None
        if mpu.get_tensor_model_parallel_world_size() > 1:
            data = tensor_parallel.broadcast_data(names, data, dtype)
        assert data is not None
        batch.update({k: v.to(device, non_blocking=True) for k, v in data.items()})
    return {k: v.reshape(-1, v.shape[-1]) if v.dim() > 2 else v for k, v in batch.items()}


def _tp_broadcast_names(groups: dict[Any, list[str] | None]) -> dict[Any, list[str]]:
    """dtype -> keys, as TP rank 0 found them (sent to the other TP ranks); empty groups left out."""
    from megatron.core import mpu

    if mpu.get_tensor_model_parallel_world_size() > 1:
        import torch.distributed as dist

        box = [groups]
        dist.broadcast_object_list(box, mpu.get_tensor_model_parallel_src_rank(),
                                   group=mpu.get_tensor_model_parallel_group())
        groups = box[0]
    return {dtype: names for dtype, names in groups.items() if names}


def _reduce(out: FlowLoss) -> Any:
    import torch

    def pair(total: Any, count: Any) -> Any:
        return torch.stack([torch.as_tensor(total).detach().float().reshape(()),
                            torch.as_tensor(count).detach().float().reshape(())])

    count = torch.as_tensor(out.count).detach().to(torch.int).reshape(())
    report = {"lm loss": pair(out.loss, out.count), **{k: pair(*v) for k, v in out.metrics.items()}}
    return lambda output: (output, count, report)


def flow_forward_step(flow: Flow, session: StepHooks | None) -> Any:
    """Megatron's forward_step for `flow` (load_flow's; pipeline parallelism 1: the loss is the output)."""
    from megatron.core import mpu

    keys = tuple(flow.keys)

    def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
        if mpu.get_pipeline_model_parallel_world_size() > 1 or mpu.get_context_parallel_world_size() > 1:
            raise ConfigFailure("training.flow runs with pipeline and context parallelism 1 in this version",
                                fix="--set parallel.pipeline_model_parallel_size=1 "
                                    "--set parallel.context_parallel_size=1")
        if session is not None:
            session.maybe_hang()
            session.forward_begin()
        out = flow.loss(model, get_flow_batch(data_iterator, keys))
        if session is not None:
            session.forward_end()
        return out.loss, _reduce(out)

    return forward_step
