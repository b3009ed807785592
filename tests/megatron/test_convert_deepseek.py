"""DeepSeek-V3 conversion on tiny random models built with transformers' DeepseekV3Config (no downloads): multi-latent
attention (query and key/value latents with their norms, nope + rope heads, values of another size), the first layer
dense, then a sigmoid router with its expert bias, group-limited routing, routed scaling, 8 experts and a shared one.

Hugging Face -> Megatron-core -> Hugging Face is bit-exact (fp32 and bf16, the expert bias kept fp32); the checkpoint
is what the GPTModel megalaunch builds on the local spec asks for (per-layer keys: the layers are of two kinds);
Megatron's logits on the converted checkpoint (MLA on torch SDPA, runtime/model/mla.py) agree with transformers'
(CPU fp32) with plain RoPE, with YaRN, and at TP 2; and the tiny-deepseek recipe trains through the real trainer and
its checkpoint exports to a DeepseekV3ForCausalLM that transformers loads, with Megatron's logits, and generates."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import torch
from harness import Trainer, make_run
from safetensors.torch import load_file
from tests.support.hf_models import run_megatron_logits

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore, mcore_to_hf
from megalaunch.conversion.families import model_from_hf_config

pytestmark = pytest.mark.megatron

VOCAB = 300
MAX_ABS_DIFF = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {"rope": ("float32", None), "yarn": ("float32", YARN), "bf16": ("bfloat16", YARN)}


def deepseek_config(rope: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """3 layers of hidden 64, 4 heads; query latent 24, key/value latent 16, per head 16 nope + 8 rope, values of
    12; layer 0 dense (ffn 96), then 8 experts of 32 + 1 shared, top-2 from 1 of 2 groups (8 / 4... top-2 / 1 group =
    transformers' top-2 group score), scaling 2.5."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
        "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 24,
        "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 16, "n_group": 2, "topk_group": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_mtp_layers": 0,
        "rope_parameters": rope or {"rope_type": "default", "rope_theta": 10000.0}, **overrides})


def make_deepseek(path: Path, rope: dict[str, Any] | None, dtype: str = "float32", seed: int = 0) -> None:
    """Every tensor random (norms around 1, the expert bias too), so no mapping can hide."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(deepseek_config(rope), dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.eval().save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, (dtype, rope) in CASES.items():
        root = tmp_path_factory.mktemp(name)
        make_deepseek(root / "hf", rope, dtype)
        hf_to_mcore(root / "hf", root / "mcore", progress=False)  # no recipe: the model from config.json
        out[name] = root
    return out


def config(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_exact(models: dict[str, Path], case: str, tmp_path: Path) -> None:
    root = models[case]
    hf = model_from_hf_config(config(root / "hf"))
    m = hf.model
    assert (hf.family, m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.moe_first_dense_layers) == ("deepseek_v3", True, 24, 16, 16, 8, 12, 1)
    assert m.rope_type == ("rope" if case == "rope" else "yarn")
    report = mcore_to_hf(root / "mcore", tmp_path, progress=False)
    before, after = load_file(root / "hf" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys() and report.tensors == len(before)
    assert sum(".experts." in n for n in before) == 2 * 8 * 3 and "model.layers.0.mlp.gate_proj.weight" in before
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    bias = after["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    assert config(tmp_path)["architectures"] == ["DeepseekV3ForCausalLM"]


def _expected_layout(model: Any) -> dict[str, tuple[int, ...]]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from megalaunch.conversion.model import build_gpt_model
    from megalaunch.runtime.model.standalone import megatron_parallel_state

    with megatron_parallel_state():
        sharded = build_gpt_model(model, vocab_size=VOCAB).sharded_state_dict()
    out = {}
    for v in nested_values(sharded):
        for t in v.build() if isinstance(v, ShardedTensorFactory) else [v]:
            if isinstance(t, ShardedTensor | ShardedObject):
                out[t.key] = tuple(t.global_shape)
    return out


def test_checkpoint_layout_is_what_gptmodel_asks_for(models: dict[str, Path]) -> None:
    """Every tensor and `_extra_state` object of the MLA GPTModel with a dense first layer, under Megatron's per-layer
    keys (no stacked layer axis: the layers are of two kinds), with its global shape."""
    from torch.distributed.checkpoint import FileSystemReader

    root = models["rope"]
    model = model_from_hf_config(config(root / "hf")).model
    meta = FileSystemReader(str(root / "mcore" / "release")).read_metadata().state_dict_metadata
    found = {k: tuple(v.size) for k, v in meta.items() if hasattr(v, "size")}
    objects = {k.split("/shard_")[0] for k in meta if "_extra_state" in k}
    expected = _expected_layout(model)
    assert {k: s for k, s in expected.items() if "_extra_state" not in k} == found
    assert {k for k in expected if "_extra_state" in k} <= objects
    assert found["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == (8, 64, 64)
    assert found["decoder.layers.2.mlp.router.expert_bias"] == (8,)
    assert found["decoder.layers.0.self_attention.linear_kv_up_proj.weight"] == (4 * (16 + 12), 16)
    assert "decoder.layers.0.mlp.router.weight" not in found and "decoder.layers.1.mlp.linear_fc1.weight" not in found


def hf_logits(path: Path, tokens: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits


@pytest.mark.parametrize(("case", "world"), [("rope", 1), ("yarn", 1), ("rope", 2), ("bf16", 1)],
                         ids=["rope", "yarn", "rope-tp2", "bf16"])
def test_megatron_logits_match_transformers(models: dict[str, Path], case: str, world: int, tmp_path: Path) -> None:
    """CPU fp32 within MAX_ABS_DIFF, the bf16 checkpoint (its router weight fp32, as transformers saves it) too:
    loaded into an fp32 model, so the comparison sees the conversion, not bf16 arithmetic (in bf16 a random router's
    near-tied scores pick other experts on the two sides)."""
    root = models[case]
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(root / "hf", tokens)
    model = dataclasses.asdict(model_from_hf_config(config(root / "hf")).model)
    got = run_megatron_logits(world, str(root / "mcore" / "release"), model, VOCAB, tokens, str(tmp_path / "l.pt"),
                              dtype="float32")
    diff = (got - expected).abs().max().item()
    print(f"{case} TP {world}: max abs diff {diff:.3g}, max |logit| {expected.abs().max().item():.3g}")
    assert diff <= MAX_ABS_DIFF


def test_tiny_deepseek_trains_and_its_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    """The tiny-deepseek recipe (MLA on SDPA, YaRN, first layer dense, sigmoid router with expert bias, groups)
    trains 3 iterations through the trainer; the checkpoint exports to a DeepseekV3ForCausalLM that transformers
    loads and runs with Megatron's logits, and generates."""
    from transformers import AutoModelForCausalLM

    paths = make_run(tmp_path / "runs", "training.train_iters=3", "checkpoint.save_interval=3",
                     "training.lr_warmup_iters=0", "training.global_batch_size=4", name="ds", recipe="tiny-deepseek")
    trainer = Trainer(paths, world=1)
    assert trainer.wait() == [0], trainer.log()[-3000:]
    report = mcore_to_hf(paths.root, tmp_path / "hf", progress=False)
    cfg = config(tmp_path / "hf")
    assert (cfg["architectures"], cfg["n_routed_experts"], cfg["first_k_dense_replace"], cfg["kv_lora_rank"]) == \
        (["DeepseekV3ForCausalLM"], 8, 1, 16)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert report.tensors == len(weights)
    bias = weights["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0  # the expert bias moved during training and is exported
    vocab = cfg["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3)).tolist()
    expected = hf_logits(tmp_path / "hf", tokens)
    model = dataclasses.asdict(load_recipe("tiny-deepseek").recipe.model)
    got = run_megatron_logits(1, str(paths.checkpoints / "iter_0000003"), model, vocab, tokens,
                              str(tmp_path / "logits.pt"))
    assert (got - expected).abs().max().item() <= MAX_ABS_DIFF
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    generated = hf.generate(torch.tensor([[1, 17, 42]]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 9)
