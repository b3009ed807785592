"""A one-process Megatron parallel state (TP=PP=1) for building and running the model outside the
training loop: conversion, logits-parity tests, benches.

Heavy imports (torch, megatron) happen inside functions: importing this module is cheap."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megalaunch.runtime.rank.dist_env import free_port


@contextlib.contextmanager
def megatron_parallel_state(seed: int = 1234) -> Iterator[None]:
    """One-process Megatron parallel state (TP=PP=1) for building and running a model outside the
    training loop, e.g. logits-parity tests. Uses gloo and the CPU when no GPU is present (turning
    on `cpu_compat` for the process), NCCL otherwise. Tears everything down on exit."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu = not torch.cuda.is_available()
    if cpu:
        from megalaunch.runtime.model import cpu_compat

        cpu_compat.enable()
    created = False
    if not dist.is_initialized():
        # an explicit address, not MASTER_ADDR/MASTER_PORT: setting those would leak into every
        # process this one starts later, pointing them at a port that may be taken by then
        dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
        created = True
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
