"""GPU acceptance of the families at real sizes (issue #49, item 4; run on the device machine, skipped without
CUDA): Qwen3 at Qwen3-0.6B's published shape and a Qwen3-MoE at the moe-3b recipe's shape (Qwen3-30B-A3B's layer
with 64 experts, 8 layers, 3.1 B parameters), each built locally with transformers' config classes and random
weights in bf16 (no downloads), converted Hugging Face -> Megatron-core without a recipe, then:

- iteration 0: Megatron's loss (the recipe's GPTModel from config.json's shape, bf16, SDPA, megalaunch's grouped
  experts for the MoE) on a fixed batch equals transformers' loss on the same batch within bf16's tolerance. The
  targets are transformers' own greedy predictions on random tokens, so its loss sits well below the loss of
  random targets (~ln V) and a model that maps any tensor wrongly is far off (the check is not vacuous);
- a few training steps (AdamW on the converted weights, the same batch) make the loss fall.

Prints the figures. ~1.5 minutes on one H200:

    PYTHONPATH=src:. python -m pytest -m gpu tests/gpu/test_families_gpu.py -s -p no:cacheprovider"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

pytestmark = pytest.mark.gpu

VOCAB = 151936
# Qwen3-0.6B's published config.json, except random weights.
QWEN3_06B = dict(vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# recipes/models/moe-3b.yaml as a Qwen3-MoE config: Qwen3-30B-A3B's layer, 64 experts instead of 128, 8 layers.
MOE_3B = dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64,
              num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=1e-3)
BATCH, SEQ = 4, 512
STEPS, LR = 6, 1e-4
LOSS_TOLERANCE = 0.02  # relative, bf16 end to end on both sides (measured gaps are printed)


def _hf_config(name: str) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    return Qwen3Config(**QWEN3_06B) if name == "qwen3-0.6b" else Qwen3MoeConfig(**MOE_3B)


def _hf_side(name: str, out: Path) -> dict[str, Any]:
    """Build and save the Hugging Face model; its loss on the batch (targets: its own greedy predictions)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(_hf_config(name), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        logits = model(tokens).logits.float()
    labels = logits.argmax(-1)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()
    random_labels = torch.randint(0, VOCAB, labels.shape, generator=torch.Generator().manual_seed(2)).cuda()
    random_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), random_labels.flatten()).item()
    del model, logits
    torch.cuda.empty_cache()
    print(f"\n{name}: {params / 1e9:.2f} B parameters, built and saved in {time.perf_counter() - t0:.1f} s; "
          f"transformers' loss {loss:.4f} (random targets: {random_loss:.4f}, ln V {math.log(VOCAB):.4f})")
    return {"tokens": tokens, "labels": labels, "loss": loss, "random_loss": random_loss}


def _megatron_losses(name: str, hf_dir: Path, ckpt: Path, batch: dict[str, Any]) -> list[float]:
    """Convert without a recipe; the loss at iteration 0, then after each of STEPS AdamW steps on the batch."""
    from megatron.core import dist_checkpointing

    from megalaunch.config.schema import ModelConfig
    from megalaunch.conversion import hf_to_mcore
    from megalaunch.conversion.families import model_from_hf_config
    from megalaunch.conversion.model import build_gpt_model
    from megalaunch.runtime.model.standalone import megatron_parallel_state

    t0 = time.perf_counter()
    report = hf_to_mcore(hf_dir, ckpt, progress=False)
    t1 = time.perf_counter()
    print(f"{name}: hf-to-mcore {report.bytes / 1e9:.2f} GB in {t1 - t0:.1f} s")
    shape = model_from_hf_config(json.loads((hf_dir / "config.json").read_text())).model
    model_cfg = ModelConfig(**dataclasses.asdict(shape))
    losses = []
    with megatron_parallel_state():
        gpt = build_gpt_model(model_cfg, vocab_size=VOCAB, attention="sdpa", params_dtype=torch.bfloat16,
                              experts="grouped").cuda()
        state = dist_checkpointing.load(gpt.sharded_state_dict(), str(ckpt / "release"))
        missing = gpt.load_state_dict(state, strict=False).missing_keys
        assert not [k for k in missing if not k.endswith("_extra_state")], missing
        tokens, labels = batch["tokens"], batch["labels"]
        positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand_as(tokens)
        optimizer = torch.optim.AdamW(gpt.parameters(), lr=LR, weight_decay=0.0)
        t2 = time.perf_counter()
        for step in range(STEPS + 1):
            gpt.train(step > 0)
            with torch.set_grad_enabled(step < STEPS):
                per_token = gpt(tokens, positions, None, labels=labels)
                loss = per_token.float().mean()
            losses.append(loss.item())
            if step < STEPS:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        torch.cuda.synchronize()
        print(f"{name}: loaded in {t2 - t1:.1f} s; Megatron's losses {[round(v, 4) for v in losses]} "
              f"({STEPS} steps in {time.perf_counter() - t2:.1f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB)")
        del gpt, optimizer, state
    torch.cuda.empty_cache()
    return losses


@pytest.mark.parametrize("name", ["qwen3-0.6b", "moe-3b"])
def test_converted_model_matches_transformers_loss_and_trains(name: str, tmp_path: Path) -> None:
    torch.cuda.reset_peak_memory_stats()
    batch = _hf_side(name, tmp_path / "hf")
    assert batch["random_loss"] - batch["loss"] > 1.0  # the targets make a wrong mapping visible
    losses = _megatron_losses(name, tmp_path / "hf", tmp_path / "mcore", batch)
    gap = abs(losses[0] - batch["loss"]) / batch["loss"]
    print(f"{name}: iteration 0: Megatron {losses[0]:.4f} vs transformers {batch['loss']:.4f} "
          f"(relative gap {gap:.2e}, tolerance {LOSS_TOLERANCE}); after {STEPS} steps {losses[-1]:.4f}")
    assert gap <= LOSS_TOLERANCE
    assert losses[-1] < losses[0] - 0.5 and all(math.isfinite(v) for v in losses)
