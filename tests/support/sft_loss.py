"""The trainer's own loss on one chat sample, in a process of its own (gloo, world 1): the tiny
recipe's GPTModel (megalaunch's builder, a converted checkpoint), a sample of the chat dataset
(runtime/flows/chat_dataset.py) and the trainer's loss function (runtime/loop/step.py), with the sample's
labels changed where the caller says."""

from __future__ import annotations

from typing import Any


def chat_losses(rank: int, port: int, ckpt: str, model: dict[str, Any], prefix: str, seq_length: int,
                result: str) -> None:
    """Losses of sample 0 with: its own labels; every prompt-side (mask 0) label replaced; one
    assistant-side (mask 1) label replaced. Saved to `result` with the mask."""
    import os
    from types import SimpleNamespace  # the dataset asks a tokenizer only for its pad id

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megalaunch.config.schema import ModelConfig
    from megalaunch.conversion.model import build_gpt_model
    from megalaunch.runtime.flows.chat_dataset import ChatDataset, ChatDocuments
    from megalaunch.runtime.loop.step import loss_func
    from megalaunch.runtime.model import cpu_compat

    cpu_compat.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
        gpt = build_gpt_model(ModelConfig(**model), vocab_size=512, params_dtype=torch.float32)
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), ckpt), strict=False)
        gpt.eval()
        docs = ChatDocuments(prefix)
        config = GPTDatasetConfig(random_seed=1, sequence_length=seq_length, blend=([prefix], None), split="100,0,0",
                                  tokenizer=SimpleNamespace(pad=1, eod=4, vocab_size=512, unique_identifiers={"pad": 1}), reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False)
        sample = ChatDataset(docs, prefix, torch.arange(len(docs)).numpy(), 4, Split.train, config)[0]
        mask = sample["loss_mask"]
        gen = torch.Generator().manual_seed(0)
        prompt_side = torch.where(mask == 0, torch.randint(0, 512, mask.shape, generator=gen), sample["labels"])
        answer_side = sample["labels"].clone()
        first = int(torch.nonzero(mask)[0])
        answer_side[first] = (answer_side[first] + 1) % 512
        losses = []
        for labels in (sample["labels"], prompt_side, answer_side):
            with torch.no_grad():
                out = gpt(sample["tokens"][None], sample["position_ids"][None], None, labels=labels[None])
            loss, tokens, _ = loss_func(mask[None], out)
            losses.append(float(loss / tokens))
        changed = int((prompt_side != sample["labels"]).sum())
        torch.save({"losses": losses, "mask": mask, "changed_prompt_labels": changed}, result)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_chat_losses(ckpt: str, model: dict[str, Any], prefix: str, seq_length: int, result: str) -> Any:
    import torch
    import torch.multiprocessing as mp

    from megalaunch.runtime.rank.dist_env import free_port

    mp.spawn(chat_losses, args=(free_port(), ckpt, model, prefix, seq_length, result), nprocs=1, join=True)
    return torch.load(result)
