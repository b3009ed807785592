"""Tiny random Hugging Face models for tests and the benchmark (built locally, no downloads)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.1,
            num_key_value_heads=2, max_position_embeddings=128)


def hf_config(family: str, *, vocab_size: int = 300, tied: bool = False, **overrides: Any) -> Any:
    """A transformers config for a tiny model of `family` (llama, llama3, mistral, qwen2)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    kw: dict[str, Any] = {**TINY, "vocab_size": vocab_size, "tie_word_embeddings": tied, **overrides}
    if family == "llama":
        return LlamaConfig(**kw)
    if family == "llama3":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        kw.setdefault("rope_theta", 500000.0)
        return LlamaConfig(**kw)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": None, **kw})
    if family == "qwen2":
        return Qwen2Config(**{"rope_theta": 1000000.0, **kw})
    raise ValueError(f"family {family!r}")


def make_hf_model(path: Path, family: str, *, dtype: str = "float32", seed: int = 0, **config: Any) -> Any:
    """Build a random model, give every tensor (norms and biases too) random values so that a
    wrong mapping cannot hide, save it as safetensors under `path`; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family, **config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model


def megatron_logits(rank: int, world: int, port: int, ckpt: str, model: dict[str, Any], vocab: int,
                    tokens: list[list[int]], result: str, dtype: str = "float32") -> None:
    """Process `rank` of `world` (TP = world): build the recipe's GPTModel with megalaunch's runtime
    builder, load the converted checkpoint through dist_checkpointing with this TP, run a forward
    pass and (rank 0) save the logits [batch, seq, vocab] to `result`. CPU uses gloo."""
    import os

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megalaunch.config.schema import ModelConfig
    from megalaunch.conversion.model import build_gpt_model

    cpu = not torch.cuda.is_available()
    if cpu:
        from megalaunch.runtime.model import cpu_compat

        cpu_compat.enable()
    else:
        torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(world, 1)
        model_parallel_cuda_manual_seed(1234)
        gpt = build_gpt_model(ModelConfig(**model), vocab_size=vocab, params_dtype=getattr(torch, dtype))
        if not cpu:
            gpt = gpt.cuda()
        state = dist_checkpointing.load(gpt.sharded_state_dict(), ckpt)
        gpt.load_state_dict(state, strict=False)
        gpt.eval()
        ids = torch.tensor(tokens, device="cpu" if cpu else "cuda")
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device), 1)
        with torch.no_grad():
            logits = gpt(ids, positions, mask[None, None])
        if rank == 0:
            torch.save(logits[..., :vocab].float().cpu(), result)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_megatron_logits(world: int, ckpt: str, model: dict[str, Any], vocab: int, tokens: list[list[int]],
                        result: str, dtype: str = "float32") -> Any:
    """Start `world` processes of `megatron_logits` (TP = world), forked from the tests' fork server
    (tests/support/forkserver.py) or spawned fresh, and return the logits."""
    import torch
    import torch.multiprocessing as mp
    from tests.support import forkserver

    from megalaunch.runtime.rank.dist_env import free_port

    port = free_port()
    args = (world, port, ckpt, model, vocab, tokens, result, dtype)
    if not forkserver.enabled():
        mp.spawn(megatron_logits, args=args, nprocs=world, join=True)
        return torch.load(result)
    server = forkserver.Server.get()
    logs = [Path(f"{result}.rank{rank}.log") for rank in range(world)]
    procs = [server.call("tests.support.hf_models:megatron_logits", (rank, *args), log=log)
             for rank, log in enumerate(logs)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert codes == [0] * world, "\n".join(log.read_text(errors="replace")[-3000:] for log in logs)
    return torch.load(result)
