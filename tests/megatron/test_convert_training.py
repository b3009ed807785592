"""Conversion against Megatron's real training loop (the runtime's `tiny` recipe, CPU, gloo):
a checkpoint that training wrote converts to Hugging Face and generates with transformers, with the
same logits as the Megatron model; and a converted Hugging Face model is what training starts from
(`--pretrained-checkpoint`), trains on and saves, and converts back to the same weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch
from harness import Trainer, make_run
from safetensors.torch import load_file
from tests.support.hf_models import make_hf_model, run_megatron_logits

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore, mcore_to_hf

pytestmark = pytest.mark.megatron


def test_trained_checkpoint_converts_and_generates(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    paths = make_run(tmp_path / "runs", "training.train_iters=4", "checkpoint.save_interval=2", "training.lr_warmup_iters=1")
    trainer = Trainer(paths)
    assert trainer.wait() == [0], trainer.log()[-3000:]
    report = mcore_to_hf(paths.root, tmp_path / "hf", progress=False)  # the run directory: its tracker
    assert report.tensors == 21
    older = mcore_to_hf(paths.root, tmp_path / "hf2", iteration=2, progress=False)
    assert older.tensors == 21

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.vocab_size == 512 and hf.config.num_hidden_layers == 2
    prompt = torch.tensor([[1, 17, 42, 99]])
    generated = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 12) and int(generated.max()) < 512

    model = load_recipe("tiny").recipe.model
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits
    got = run_megatron_logits(1, str(paths.checkpoints / "iter_0000004"), dataclasses.asdict(model), 512, tokens,
                              str(tmp_path / "logits.pt"))
    assert (got - expected).abs().max().item() <= 1e-4


def test_training_starts_from_a_converted_model(tmp_path: Path) -> None:
    recipe = load_recipe("tiny").recipe
    make_hf_model(tmp_path / "hf", "llama", vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=64)
    hf_to_mcore(tmp_path / "hf", tmp_path / "converted", model=recipe.model, vocab_size=512, progress=False)

    # lr ~ 0: the two Adam steps move every weight by ~1e-12, so what training saved must be what it loaded.
    paths = make_run(tmp_path / "runs", "training.train_iters=2", "checkpoint.save_interval=2", "training.lr=1e-12",
                     "training.min_lr=1e-12", "training.lr_warmup_iters=0",
                     f"megatron_args.pretrained_checkpoint={tmp_path / 'converted'}")
    trainer = Trainer(paths)
    assert trainer.wait() == [0], trainer.log()[-3000:]
    assert str(tmp_path / "converted") in trainer.log()
    mcore_to_hf(paths.root, tmp_path / "back", progress=False)
    before = load_file(tmp_path / "hf" / "model.safetensors")
    after = load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_tensor_parallel_checkpoint_converts(tmp_path: Path) -> None:
    """A checkpoint saved by TP=2 training (row- and column-split chunks) converts to the same model that
    Megatron itself loads from it with TP=1."""
    from transformers import AutoModelForCausalLM

    paths = make_run(tmp_path / "runs", "training.train_iters=2", "checkpoint.save_interval=2",
                     "training.lr_warmup_iters=0", "parallel.tensor_model_parallel_size=2", "cluster.tasks_per_node=2")
    trainer = Trainer(paths, world=2, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert trainer.wait() == [0, 0], trainer.log()[-3000:]
    mcore_to_hf(paths.root, tmp_path / "hf", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits
    model = load_recipe("tiny").recipe.model
    got = run_megatron_logits(1, str(paths.checkpoints / "iter_0000002"), dataclasses.asdict(model), 512, tokens,
                              str(tmp_path / "logits.pt"))
    assert (got - expected).abs().max().item() <= 1e-4
