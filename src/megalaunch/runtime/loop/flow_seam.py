"""A flow's `prepare(model, context)` (runtime/flows/flow.py), called once per process after Megatron has
built and loaded the model and before its first iteration: `megatron.training.training.train` is wrapped
(pretrain calls it once, with the model chunks). The context carries what a long phase there needs: the
run, the iteration loaded, the starting checkpoint, the data prefixes, the hang watcher's beat and the
stop decision (a signal or trigger during the phase is acted on like one between iterations)."""

from __future__ import annotations

import functools
from typing import Any

from megalaunch.runtime.flows.flow import Flow, FlowContext


def install_prepare(flow: Flow, session: Any, model_provider: Any = None) -> None:
    """Wrap Megatron's `train` so that `flow.prepare` runs first (no-op for a flow without one).
    `model_provider`: Megatron's, for a frozen copy of the starting model (`FlowContext.frozen_start`)."""
    prepare = getattr(flow, "prepare", None)
    if not callable(prepare):
        return
    from megatron.training import training as mtraining

    original = mtraining.train

    @functools.wraps(original)
    def train(forward_step_func: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if session is not None:
            session.phase("flow_prepare_start")
        prepare(model[0] if isinstance(model, list) else model, flow_context(session, model_provider))
        if session is not None:
            session.phase("flow_prepare_end")
        return original(forward_step_func, model, *args, **kwargs)

    mtraining.train = train


def flow_context(session: Any, model_provider: Any = None) -> FlowContext:
    """The context of `prepare`, from Megatron's arguments and the segment's session (None: tests)."""
    from megatron.training import get_args
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, per_split = get_blend_and_blend_per_split(args)
    blends = [blend] if blend else [b for b in (per_split or []) if b]
    prefixes = sorted({p for b in blends for p in b[0]})
    iteration = int(getattr(args, "iteration", 0) or 0)
    ctx = getattr(session, "ctx", None)

    def decide() -> int:
        return int(session.decide(iteration, force=True)) if session is not None else 0

    def act(decision: int) -> None:
        from megalaunch.rundir.triggers import Decision

        if session is None or decision == Decision.CONTINUE:
            return
        session.acted(decision, iteration)
        if decision >= Decision.SIGNAL:
            raise SystemExit(0)  # like Megatron after a stop: runtime/train.py judges the decision

    def beat(what: str) -> None:
        if session is not None:
            session.observe.beat(what)

    return FlowContext(
        run_dir=ctx.paths.root if ctx is not None else _run_dir(args), iteration=iteration,
        start=getattr(args, "pretrained_checkpoint", None), seed=int(args.seed), prefixes=prefixes,
        seq_length=int(args.seq_length), micro_batch_size=int(args.micro_batch_size), bf16=bool(args.bf16),
        is_zero=ctx.is_zero if ctx is not None else True,
        log=ctx.log if ctx is not None else print, ledger=ctx.ledger if ctx is not None else _no_ledger,
        beat=beat, decide=decide, act=act,
        frozen_start=(lambda: frozen_start(model_provider)) if model_provider is not None else None)


def frozen_start(model_provider: Any) -> Any:
    """A second model, built like the policy and loaded from the starting checkpoint (--pretrained-checkpoint),
    frozen: eval mode, no gradients, no optimizer, no DDP. Megatron's arguments, RNG states and counters are
    left as they were (the load runs as a fine-tune load: iteration 0, no optimizer, no RNG, no counters)."""
    import copy

    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import get_model

    args = get_args()
    if not getattr(args, "pretrained_checkpoint", None):
        return None
    saved = copy.copy(vars(args))
    try:
        args.finetune, args.no_load_rng, args.no_load_optim, args.ckpt_step = True, True, True, None
        chunks = get_model(model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
        load_checkpoint(chunks, None, None, load_arg="pretrained_checkpoint", strict=True)
    finally:
        vars(args).clear()
        vars(args).update(saved)
    frozen = chunks[0]
    frozen.eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen


def _run_dir(args: Any) -> Any:
    from pathlib import Path

    return Path(args.save).parent


def _no_ledger(event: str, **data: Any) -> None:
    return None
