"""Megatron's side of one training step, as `megatron.training.pretrain` calls it: the argument list
(read verbatim from RUN/megatron.args), GPTDataset over the frozen blend, the batch, the loss, the
forward step (with the trainer's step hooks, runtime/hooks.StepHooks), and the call into Megatron's loop."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megalaunch.rundir.files import read_args_file
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.hooks import StepHooks

if TYPE_CHECKING:  # pragma: no cover
    from megalaunch.runtime.model.fp8 import Fp8Choice


def megatron_argv(paths: RunPaths) -> list[str]:
    """Megatron's arguments, exactly as rendered into RUN/megatron.args (config/megatron_args.py)."""
    return read_args_file(paths.megatron_args)


def dataset_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None, *,
                     data_format: str = "tokens", flow: str | None = None) -> Any:
    """GPTDataset over RUN/data_blend.txt (Megatron's --data-args-path), or mock data; with
    `data_format` "chat", the chat dataset of `megalaunch data sft` (tokenization/chat/dataset.py)."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=False,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus, mmap_bin_files=args.mmap_bin_files,
    )

    def built_here() -> bool:
        return (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()) and \
            mpu.get_tensor_model_parallel_rank() == 0

    cls: Any = MockGPTDataset if config.mock else GPTDataset
    if data_format == "chat" and not config.mock:
        from megalaunch.runtime.flows.chat_dataset import ChatDataset

        cls = ChatDataset
    if flow is not None:
        from megalaunch.runtime.flows.flow import flow_dataset

        own = flow_dataset(flow)  # a flow's dataset over the blend, or one that reads its own data (GRPO's rounds)
        cls = own if own is not None and (not config.mock or getattr(own, "own_data", False)) else cls
    return BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, built_here, config).build()


dataset_provider.is_distributed = True  # type: ignore[attr-defined]


def get_batch(data_iterator: Any) -> dict[str, Any]:
    """This micro-batch on this rank: TP rank 0 reads it, the other TP ranks receive it."""
    import torch
    from megatron.core import mpu
    from megatron.training import get_args

    args = get_args()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    if mpu.get_tensor_model_parallel_rank() == 0:
        raw = next(data_iterator)
        batch = {k: raw[k].to(device, non_blocking=True) for k in keys}
    else:
        shape = (args.micro_batch_size, args.seq_length)
        dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32, "position_ids": torch.int64}
        batch = {k: torch.empty(shape, dtype=dtypes[k], device=device) for k in keys}
    if mpu.get_tensor_model_parallel_world_size() > 1:
        import torch.distributed as dist

        for k in keys:
            if batch[k].dtype != torch.float32 and k == "loss_mask":
                batch[k] = batch[k].float()
            dist.broadcast(batch[k], mpu.get_tensor_model_parallel_src_rank(),
                           group=mpu.get_tensor_model_parallel_group())
    return batch


def loss_func(loss_mask: Any, output_tensor: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Summed token loss and token count; Megatron divides and reduces over data parallel."""
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def make_forward_step(session: StepHooks | None, *, skip_masked_labels: bool = False) -> Any:
    """Megatron's forward step; `skip_masked_labels`: labels where the loss mask is 0 become liger's
    ignore index, so that its fused loss (which takes no mask) skips them (runtime/model/liger_layers.py)."""
    from functools import partial

    def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
        if session is not None:
            session.maybe_hang()
            session.forward_begin()
        batch = get_batch(data_iterator)
        labels = batch["labels"]
        if skip_masked_labels:
            labels = labels.masked_fill(batch["loss_mask"] == 0, -100)
        output = model(batch["tokens"], batch["position_ids"], None, labels=labels)
        if session is not None:
            session.forward_end()
        return output, partial(loss_func, batch["loss_mask"])

    return forward_step


def run_pretrain(argv: list[str], *, attention: str, session: StepHooks | None, data_format: str = "tokens",
                 flow: str | None = None, liger_ops: frozenset[str] = frozenset(), fp8: Fp8Choice | None = None,
                 on_fp8: Callable[[list[str], dict[str, str]], None] | None = None, experts: str = "sequential",
                 post_training: dict[str, Any] | None = None) -> None:
    """Parse Megatron's arguments from `argv` and run `megatron.training.pretrain` (with the recipe's
    data format, the kernels resolved for this node, the MoE layers' `experts` (KernelChoice.experts) and, when
    named, a flow's step: runtime/flows/flow.py; `post_training`: the built-in flow's settings)."""
    from functools import partial

    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import pretrain

    from megalaunch.runtime.model.model import model_provider

    saved_argv = sys.argv
    sys.argv = [saved_argv[0], *argv]
    try:
        cfg = pretrain_cfg_container_from_args(parse_and_validate_args())
    finally:
        sys.argv = saved_argv
    provide_data: Any = partial(dataset_provider, data_format=data_format, flow=flow)
    provide_data.is_distributed = True
    provide_model = build_model = model_provider(attention, liger_ops, fp8=fp8, on_fp8=on_fp8, experts=experts)
    if session is not None:
        provide_model = _timed(provide_model, session, "model_build")
        provide_data = _timed(provide_data, session, "data")
    forward_step = make_forward_step(session, skip_masked_labels="linear_ce" in liger_ops)
    if flow is not None:
        from megalaunch.runtime.flows.flow import flow_forward_step, load_flow
        from megalaunch.runtime.loop.flow_seam import install_prepare

        the_flow = load_flow(flow, post_training)  # before Megatron starts: a flow that cannot load fails at once
        forward_step = flow_forward_step(the_flow, session)
        install_prepare(the_flow, session, build_model)
    pretrain(cfg, provide_data, ModelType.encoder_or_decoder, forward_step, model_provider=provide_model)


def _timed(fn: Any, session: StepHooks, phase: str) -> Any:
    """`fn` marking `<phase>_start` / `<phase>_end` on the segment's timeline (the first call's)."""
    import functools

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        session.phase(f"{phase}_start")
        result = fn(*args, **kwargs)
        session.phase(f"{phase}_end")
        return result

    timed.__dict__.update(getattr(fn, "__dict__", {}))  # e.g. dataset_provider.is_distributed
    return timed
