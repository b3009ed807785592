"""A checkpoint trained with EP 2 and TP 2 on CPU ranks exports and loads in transformers (issue #49, item 4):
tiny-moe (8 experts of 64, top-2) trained a few iterations on 4 gloo ranks with expert parallelism 2 x tensor
parallelism 2 (+ sequence parallelism, which MoE with TP needs), so every rank saved a quarter of the experts'
shards and half of every dense tensor; `megalaunch convert mcore-to-hf RUN` (the command, no Hugging Face config:
a Mixtral from the checkpoint's arguments) gives a model that transformers loads, whose logits on a batch are
Megatron's own on that checkpoint (fp32), and which generates."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import Trainer, make_run
from tests.support.hf_models import run_megatron_logits

from megalaunch.config.loader import load_recipe

pytestmark = [pytest.mark.megatron, pytest.mark.slow,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "safetensors")),
                                 reason="needs transformers and safetensors")]

MAX_ABS_DIFF = 1e-4  # fp32 on the CPU; the logits are O(1)
LAYOUT = ["cluster.tasks_per_node=4", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
          "parallel.expert_model_parallel_size=2"]


@pytest.mark.timeout(900)
def test_a_checkpoint_trained_at_ep2_tp2_exports_and_loads_in_transformers(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    paths = make_run(tmp_path / "runs", "training.train_iters=3", "checkpoint.save_interval=3",
                     "training.lr_warmup_iters=0", "training.global_batch_size=4", "training.precision=fp32",
                     *LAYOUT, name="moe", recipe="tiny-moe")
    trainer = Trainer(paths, world=4, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})  # as the job script sets it
    assert trainer.wait(timeout=600) == [0] * 4, "\n".join(trainer.log(r)[-2000:] for r in range(4))
    assert "tensor-model-parallel size: 2" in trainer.log()
    args = (paths.root / "megatron.args").read_text().split()
    assert args[args.index("--expert-model-parallel-size") + 1] == "2" and "--sequence-parallel" in args

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "megalaunch.cli.main", "convert", "mcore-to-hf", str(paths.root),
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (["MixtralForCausalLM"], 8, 2)
    weights = load_file(out / "model.safetensors")
    assert sum(".experts." in n for n in weights) == 2 * 8 * 3  # every expert of both layers, from all 4 ranks

    vocab = cfg["vocab_size"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits
    model = dataclasses.asdict(load_recipe("tiny-moe").recipe.model)
    got = run_megatron_logits(1, str(paths.checkpoints / "iter_0000003"), model, vocab, tokens,
                              str(tmp_path / "logits.pt"))
    diff = (got - expected).abs().max().item()
    print(f"logits: max |Megatron - transformers| {diff:.2e} (logits up to {expected.abs().max().item():.2f})")
    assert got.shape == expected.shape and diff <= MAX_ABS_DIFF, diff
    assert expected.abs().max().item() > 0.1  # not a vacuous comparison of near-zero logits
    generated = hf.generate(torch.tensor([[1, 17, 42]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 9)
