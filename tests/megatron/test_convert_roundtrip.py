"""Conversion proven on tiny random models built with transformers (no downloads): Hugging Face ->
Megatron-core -> Hugging Face is bit-exact for every tensor; the checkpoint has exactly the layout
Megatron's GPTModel asks for; logits of the Hugging Face model and of the Megatron model built from
the recipe on the converted checkpoint agree (CPU fp32, max abs diff <= 1e-4), with TP=1 and TP=2
(two gloo processes); errors name what is wrong."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
import torch
from safetensors.torch import load_file, save_file
from tests.support.hf_models import make_hf_model, run_megatron_logits

from megalaunch.config.loader import load_recipe
from megalaunch.conversion import hf_to_mcore, mcore_to_hf
from megalaunch.conversion.errors import (
    ConversionError,
    IncompleteCheckpointError,
    ShapeMismatchError,
    UnsupportedModelError,
)
from megalaunch.conversion.families import model_from_hf_config

pytestmark = pytest.mark.megatron

MAX_ABS_DIFF = 1e-4
# (family, tied embeddings, dtype)
CASES = [("llama", False, "float32"), ("llama", True, "bfloat16"), ("mistral", False, "float32"),
         ("qwen2", True, "bfloat16"), ("llama3", False, "float32")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, str], Path]:
    """Each case's Hugging Face model, converted once: root/hf, root/mcore."""
    out = {}
    for family, tied, dtype in CASES:
        root = tmp_path_factory.mktemp(f"{family}-{tied}-{dtype}")
        make_hf_model(root / "hf", family, tied=tied, dtype=dtype)
        hf_to_mcore(root / "hf", root / "mcore", progress=False)
        out[(family, tied, dtype)] = root
    return out


def hf_config(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}-{c[2]}")
def test_round_trip_is_bit_exact(models: dict[Any, Path], case: tuple[str, bool, str], tmp_path: Path) -> None:
    root = models[case]
    report = mcore_to_hf(root / "mcore", tmp_path, progress=False)
    before = load_file(root / "hf" / "model.safetensors")
    after = load_file(tmp_path / "model.safetensors")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype, name
        assert torch.equal(after[name], tensor), name
    assert report.tensors == len(before)
    a, b = hf_config(root / "hf"), hf_config(tmp_path)
    assert model_from_hf_config(a) == model_from_hf_config(b)
    assert b["dtype"] == case[2]
    # the tokenizer-side files that came with the model travel both ways
    assert (root / "mcore" / "hf_assets" / "config.json").is_file()


def megatron_layout(tied: bool, qkv_bias: bool) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Tensor keys -> global shapes and object keys of the sharded state dict of a GPTModel built by
    megalaunch's runtime from the equivalent recipe model."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    from megalaunch.conversion.model import build_gpt_model
    from megalaunch.runtime.model.standalone import megatron_parallel_state

    family = "qwen2" if qkv_bias else "llama"
    model = model_from_hf_config(json.loads(json.dumps(_config_dict(family, tied)))).model
    with megatron_parallel_state():
        gpt = build_gpt_model(model, vocab_size=300)
        sharded = gpt.sharded_state_dict()
    tensors: dict[str, tuple[int, ...]] = {}
    objects: set[str] = set()
    for value in extract_sharded_base(sharded)[0].values():
        if isinstance(value, ShardedTensorFactory):
            value = value.build()
            value = value[0] if isinstance(value, list) else value
        if isinstance(value, ShardedTensor):
            tensors[value.key] = tuple(value.global_shape)
        elif isinstance(value, ShardedObject):
            objects.add(value.unique_key)
    return tensors, objects


def _config_dict(family: str, tied: bool) -> dict[str, Any]:
    from tests.support.hf_models import hf_config as make

    return make(family, tied=tied).to_dict() | {"architectures": [{"llama": "LlamaForCausalLM",
                                                                     "qwen2": "Qwen2ForCausalLM"}[family]]}


@pytest.mark.parametrize("case", [("llama", False, "float32"), ("qwen2", True, "bfloat16")], ids=["untied", "tied-bias"])
def test_checkpoint_layout_is_what_gptmodel_asks_for(models: dict[Any, Path], case: tuple[str, bool, str]) -> None:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    expected, objects = megatron_layout(tied=case[1], qkv_bias=case[0] == "qwen2")
    ckpt = models[case] / "mcore" / "release"
    with_process_group = pytest.importorskip("megalaunch.conversion.checkpoint_io.mcore_dist").process_group
    with with_process_group():
        found = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(ckpt)).items()}
    assert found == expected
    stored = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert objects <= stored, objects - stored
    extra = {k for k in stored - set(found) - objects if k != "common_state/shard_0_1"}
    assert all(".core_attention._extra_state" in k for k in extra), extra  # transformer-engine's, harmless


PARITY = [  # (case, TP of the conversion's padding, TP when loading)
    (("llama", False, "float32"), 1, 1),
    (("llama", False, "float32"), 1, 2),
    (("llama", True, "bfloat16"), 1, 2),
    (("mistral", False, "float32"), 1, 2),
    (("qwen2", True, "bfloat16"), 2, 2),
    (("llama3", False, "float32"), 1, 2),
]


@pytest.mark.parametrize(("case", "convert_tp", "load_tp"), PARITY,
                         ids=[f"{c[0]}-{'tied' if c[1] else 'untied'}-tp{t}to{lt}" for c, t, lt in PARITY])
def test_logits_match_the_hugging_face_model(models: dict[Any, Path], case: tuple[str, bool, str], convert_tp: int,
                                             load_tp: int, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    root = models[case]
    ckpt = root / "mcore"
    if convert_tp != 1:
        ckpt = tmp_path / "mcore"
        hf_to_mcore(root / "hf", ckpt, tensor_parallel=convert_tp, dtype="float32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    model = model_from_hf_config(hf_config(root / "hf"))
    tokens = torch.randint(0, model.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits
    got = run_megatron_logits(load_tp, str(ckpt / "release"), dataclasses.asdict(model.model), model.vocab_size,
                              tokens, str(tmp_path / "logits.pt"))
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= MAX_ABS_DIFF, diff


def test_llama31_rope_scaling_is_exercised(models: dict[Any, Path], tmp_path: Path) -> None:
    """Negative control: the same checkpoint without rope scaling gives clearly different logits."""
    from transformers import AutoModelForCausalLM

    root = models[("llama3", False, "float32")]
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    model = model_from_hf_config(hf_config(root / "hf"))
    assert model.model.use_rope_scaling
    tokens = torch.randint(0, model.vocab_size, (1, 128), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor(tokens)).logits
    wrong = {**dataclasses.asdict(model.model), "use_rope_scaling": False}
    got = run_megatron_logits(1, str(root / "mcore" / "release"), wrong, model.vocab_size, tokens,
                              str(tmp_path / "logits.pt"))
    assert (got - expected).abs().max().item() > 100 * MAX_ABS_DIFF


def test_padded_vocabulary_pads_with_zeros_and_strips(models: dict[Any, Path], tmp_path: Path) -> None:
    root = models[("llama", False, "float32")]
    hf_to_mcore(root / "hf", tmp_path / "mcore", tensor_parallel=2, vocab_size=600, progress=False)
    from megalaunch.conversion.checkpoint_io import mcore_dist

    with mcore_dist.process_group():
        meta = mcore_dist.tensors_metadata(tmp_path / "mcore" / "release")
        emb = meta["embedding.word_embeddings.weight"]
        assert tuple(emb.global_shape) == (768, 64)  # max(300, 600) padded to 128 x TP=2
        (rows,) = mcore_dist.load(tmp_path / "mcore" / "release", [mcore_dist.ShardRequest(
            "embedding.word_embeddings.weight", (768, 64), (0, 0), (768, 64), False, torch.float32)])
    assert not rows[300:].any() and rows[:300].abs().sum() > 0
    mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", progress=False)
    assert load_file(tmp_path / "hf" / "model.safetensors")["model.embed_tokens.weight"].shape == (300, 64)


def test_iteration_checkpoint_and_tracker(models: dict[Any, Path], tmp_path: Path) -> None:
    root = models[("llama", False, "float32")]
    report = hf_to_mcore(root / "hf", tmp_path / "ck", iteration=7, progress=False)
    assert report.output == tmp_path / "ck" / "iter_0000007"
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    assert {p.name for p in report.output.iterdir()} >= {"metadata.json", ".metadata"}
    with pytest.raises(ConversionError, match="already exists"):
        hf_to_mcore(root / "hf", tmp_path / "ck", iteration=7, progress=False)
    mcore_to_hf(tmp_path / "ck", tmp_path / "hf", progress=False)
    with pytest.raises(ConversionError, match="already holds safetensors"):
        mcore_to_hf(tmp_path / "ck", tmp_path / "hf", progress=False)


def test_incomplete_checkpoints_are_refused(models: dict[Any, Path], tmp_path: Path) -> None:
    shutil.copytree(models[("llama", False, "float32")] / "mcore", tmp_path / "ck")
    release = tmp_path / "ck" / "release"
    data = sorted(release.glob("*.distcp"))
    big = max(data, key=lambda p: p.stat().st_size)
    with open(big, "r+b") as f:
        f.truncate(big.stat().st_size // 2)
    with pytest.raises(IncompleteCheckpointError, match="truncated"):
        mcore_to_hf(tmp_path / "ck", tmp_path / "hf", progress=False)
    big.unlink()
    with pytest.raises(IncompleteCheckpointError, match="lacks data file"):
        mcore_to_hf(tmp_path / "ck", tmp_path / "hf", progress=False)
    (release / "metadata.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no metadata"):
        mcore_to_hf(tmp_path / "ck", tmp_path / "hf", progress=False)
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no latest_checkpointed_iteration"):
        mcore_to_hf(tmp_path / "ck", tmp_path / "hf", progress=False)
    assert not list((tmp_path / "hf").glob("*.safetensors")) if (tmp_path / "hf").exists() else True


def test_hugging_face_side_errors_name_the_tensor(models: dict[Any, Path], tmp_path: Path) -> None:
    src = models[("llama", False, "float32")] / "hf"
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:100]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ShapeMismatchError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \[100, 64\].*"
                                                 r"implies \[128, 64\]"):
        hf_to_mcore(bad, tmp_path / "o1", progress=False)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        hf_to_mcore(bad, tmp_path / "o2", progress=False)
    cfg = hf_config(src) | {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="valid: DeepseekV3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM"):
        hf_to_mcore(bad, tmp_path / "o3", progress=False)


def test_recipe_mismatch_names_each_field(models: dict[Any, Path], tmp_path: Path) -> None:
    recipe = load_recipe("tiny").recipe  # 2 x 64, ffn 128, 4 heads / 2 groups, eps 1e-5, rope theta 10000
    with pytest.raises(ConversionError) as e:
        hf_to_mcore(models[("qwen2", True, "bfloat16")] / "hf", tmp_path / "o", model=recipe.model, progress=False)
    text = str(e.value)
    for field in ("model.rotary_base", "model.norm_epsilon", "model.add_qkv_bias",
                  "model.untie_embeddings_and_output_weights"):
        assert field in text
    assert "model.num_layers" not in text
