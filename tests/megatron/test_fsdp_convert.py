"""A checkpoint of a sharded-layout run (`parallel.data_sharding: optimizer_grads_params`, Megatron-FSDP's
fsdp_dtensor format) converts to Hugging Face (conversion/checkpoint_io/fsdp_layout.py) and loads and generates
in transformers, with the logits of the same training under the distributed optimizer converted from torch_dist:
fc1's two halves, the norms' names and the layer order all come back where they belong."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch
from harness import Trainer, make_run

from megalaunch.conversion import mcore_to_hf

pytestmark = pytest.mark.megatron

# lr ~ 0: the steps move every weight by ~1e-12, so both runs hold the (same) initial weights, and any tensor put
# in the wrong place by the conversion shows; with a real lr, Adam turns the two layouts' different summation
# orders into steps of ~lr on near-zero gradients (measured: 3e-4 on every tensor after 4 steps at lr 1e-3)
SETS = ("training.train_iters=4", "checkpoint.save_interval=4", "training.lr_warmup_iters=0", "training.lr=1e-12",
        "training.min_lr=1e-12", "training.global_batch_size=4", "parallel.use_distributed_optimizer=true")


def _train(root: Path, sharding: str) -> Path:
    paths = make_run(root, *SETS, f"parallel.data_sharding={sharding}")
    t = Trainer(paths, world=2)
    assert t.wait() == [0, 0], t.log()[-3000:]
    return paths.root


def test_fsdp_checkpoint_converts_to_the_same_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = _train(tmp_path / "fsdp", "optimizer_grads_params")
    iteration = sharded / "checkpoints" / "iter_0000004"
    assert (iteration / ".metadata").is_file() and not (iteration / "metadata.json").exists()
    plain = _train(tmp_path / "plain", "optimizer")
    a = mcore_to_hf(sharded, tmp_path / "hf-fsdp", progress=False)
    b = mcore_to_hf(plain, tmp_path / "hf-plain", progress=False)
    assert a.tensors == b.tensors == 21 and a.bytes == b.bytes
    assert not list(tmp_path.glob(".fsdp-weights-*"))  # the torch_dist copy of the weights is gone

    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(3))
    logits = []
    for d in (tmp_path / "hf-fsdp", tmp_path / "hf-plain"):
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(hf(tokens).logits)
        generated = hf.generate(tokens[:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert generated.shape == (1, 12)
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5
    assert logits[0].std().item() > 1e-2  # not a degenerate model
