"""Qwen3 dense conversion on tiny random models built with transformers (no downloads): a head size that is
not hidden / heads (4 heads of 32 on a hidden size of 64: model.kv_channels) and the per-head query and key
RMSNorms (q_norm / k_norm <-> Megatron's q_layernorm / k_layernorm: model.qk_layernorm). Hugging Face ->
Megatron-core -> Hugging Face is bit-exact, the checkpoint is what GPTModel asks for, and logits of the
Megatron model built from the inferred recipe model agree with transformers' (CPU fp32, TP=1 and TP=2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import torch
from safetensors.torch import load_file
from tests.support.hf_models import TINY, run_megatron_logits

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore, mcore_to_hf
from megalaunch.conversion.errors import ConversionError
from megalaunch.conversion.families import model_from_hf_config

pytestmark = pytest.mark.megatron

MAX_ABS_DIFF = 1e-4
CASES = [(False, "float32"), (True, "bfloat16")]  # (tied embeddings, dtype)


def make_qwen3(path: Path, *, tied: bool, dtype: str, seed: int = 0) -> Any:
    """A random Qwen3 with head_dim 32 x 4 heads != hidden 64; every norm (q_norm and k_norm too) random."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**TINY, "head_dim": 32, "vocab_size": 300, "tie_word_embeddings": tied,
                         "rope_theta": 1000000.0, "rms_norm_eps": 1e-6})
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.eval().save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[bool, str], Path]:
    out = {}
    for tied, dtype in CASES:
        root = tmp_path_factory.mktemp(f"qwen3-{tied}-{dtype}")
        make_qwen3(root / "hf", tied=tied, dtype=dtype)
        hf_to_mcore(root / "hf", root / "mcore", progress=False)  # no recipe: the shape from config.json
        out[(tied, dtype)] = root
    return out


def config(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("case", CASES, ids=["untied-float32", "tied-bfloat16"])
def test_round_trip_is_bit_exact(models: dict[Any, Path], case: tuple[bool, str], tmp_path: Path) -> None:
    root = models[case]
    hf = model_from_hf_config(config(root / "hf"))
    assert (hf.family, hf.model.kv_channels, hf.model.qk_layernorm) == ("qwen3", 32, True)
    mcore_to_hf(root / "mcore", tmp_path, progress=False)
    before, after = load_file(root / "hf" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys()
    assert "model.layers.1.self_attn.q_norm.weight" in before and ("lm_head.weight" in before) is not case[0]
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert config(tmp_path)["architectures"] == ["Qwen3ForCausalLM"]


def test_checkpoint_layout_is_what_gptmodel_asks_for(models: dict[Any, Path]) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    from megalaunch.conversion.checkpoint_io.mcore_dist import process_group
    from megalaunch.conversion.model import build_gpt_model
    from megalaunch.runtime.model.standalone import megatron_parallel_state

    root = models[(False, "float32")]
    with megatron_parallel_state():
        sharded = build_gpt_model(model_from_hf_config(config(root / "hf")).model, vocab_size=300).sharded_state_dict()
    expected = {}
    for value in extract_sharded_base(sharded)[0].values():
        value = value.build() if isinstance(value, ShardedTensorFactory) else value
        value = value[0] if isinstance(value, list) else value
        if isinstance(value, ShardedTensor):
            expected[value.key] = tuple(value.global_shape)
    with process_group():
        found = {k: tuple(v.global_shape) for k, v in
                 dist_checkpointing.load_tensors_metadata(str(root / "mcore" / "release")).items()}
    assert found == expected
    assert found["decoder.layers.self_attention.q_layernorm.weight"] == (2, 32)
    assert found["decoder.layers.self_attention.linear_qkv.weight"] == (2, (4 + 2 * 2) * 32, 64)


def hf_logits(path: Path, tokens: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits


@pytest.mark.parametrize(("case", "load_tp"), [((False, "float32"), 1), ((False, "float32"), 2),
                                               ((True, "bfloat16"), 2)], ids=["untied-tp1", "untied-tp2", "tied-tp2"])
def test_logits_match_transformers(models: dict[Any, Path], case: tuple[bool, str], load_tp: int,
                                   tmp_path: Path) -> None:
    root = models[case]
    model = model_from_hf_config(config(root / "hf"))
    tokens = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(root / "hf", tokens)
    args = (str(root / "mcore" / "release"), dataclasses.asdict(model.model), 300, tokens)
    got = run_megatron_logits(load_tp, *args, str(tmp_path / "logits.pt"))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= MAX_ABS_DIFF
    if load_tp == 1:  # negative control: without the QK-norm the same weights give clearly other logits
        plain = {**args[1], "qk_layernorm": False}
        wrong = run_megatron_logits(1, args[0], plain, 300, tokens, str(tmp_path / "wrong.pt"))
        assert (wrong - expected).abs().max().item() > 100 * MAX_ABS_DIFF


def test_config_written_from_megatron_args_loads_as_qwen3(models: dict[Any, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint without the Hugging Face config hf-to-mcore stores (one training wrote): config.json is
    written from its Megatron arguments, family qwen3 by the QK-norm, and transformers loads it as Qwen3."""
    from megalaunch.conversion import to_hf
    from megalaunch.conversion.checkpoint_io import mcore_dist

    root = models[(False, "float32")]
    load = mcore_dist.load_common
    monkeypatch.setattr(mcore_dist, "load_common",
                        lambda p: {k: v for k, v in load(p).items() if k != to_hf.CONVERSION_KEY})
    (tmp_path / "ckpt").mkdir()
    for p in (root / "mcore").iterdir():
        if p.name != "hf_assets":
            (tmp_path / "ckpt" / p.name).symlink_to(p)
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf", vocab_size=300, progress=False)
    cfg = config(tmp_path / "hf")
    assert (cfg["architectures"], cfg["head_dim"], cfg["hidden_size"]) == (["Qwen3ForCausalLM"], 32, 64)
    tokens = [[5, 17, 123, 299, 0, 42]]
    assert torch.equal(hf_logits(tmp_path / "hf", tokens), hf_logits(root / "hf", tokens))


def test_recipe_must_describe_the_head_size_and_qk_norm(models: dict[Any, Path], tmp_path: Path) -> None:
    recipe = load_recipe("tiny").recipe.model
    with pytest.raises(ConversionError) as e:
        hf_to_mcore(models[(False, "float32")] / "hf", tmp_path / "o", model=recipe, progress=False)
    assert "model.kv_channels: recipe 16, Hugging Face 32" in str(e.value)
    assert "model.qk_layernorm: recipe False, Hugging Face True" in str(e.value)


def test_a_head_size_other_than_hidden_over_heads_converts_for_mistral_too(tmp_path: Path) -> None:
    """Mistral Nemo's shape (head_dim x heads != hidden, no QK-norm): model.kv_channels alone."""
    from tests.support.hf_models import make_hf_model

    make_hf_model(tmp_path / "hf", "mistral", head_dim=32)
    hf_to_mcore(tmp_path / "hf", tmp_path / "mcore", progress=False)
    model = model_from_hf_config(config(tmp_path / "hf"))
    assert (model.model.kv_channels, model.model.qk_layernorm) == (32, False)
    tokens = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(3)).tolist()
    got = run_megatron_logits(1, str(tmp_path / "mcore" / "release"), dataclasses.asdict(model.model), 300, tokens,
                              str(tmp_path / "logits.pt"))
    assert (got - hf_logits(tmp_path / "hf", tokens)).abs().max().item() <= MAX_ABS_DIFF
