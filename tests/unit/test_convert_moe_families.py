"""The mixture-of-experts half of the config mapping (conversion/families_moe.py), without Megatron or torch:
published configs (Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B) give the recipe's MoE fields and match the
shipped recipes; a config written from a recipe reads back as the same model; dense layers between the MoE
layers, DeepSeek-V2's router and a model a family cannot hold are refused in one line; `--from-hf` takes the MoE
fields (a contradicting `--set` refused naming the field, the aux-loss weight a training choice a `--set` wins)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megalaunch.config.loader import load_recipe
from megalaunch.config.model.moe import check_moe
from megalaunch.conversion import families
from megalaunch.conversion.errors import UnsupportedModelError
from megalaunch.errors import ConfigError
from megalaunch.finetune.layers import submit_layers
from megalaunch.finetune.model_dir import model_values

MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
                "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
                "tie_word_embeddings": False, "vocab_size": 32000, "hidden_act": "silu"}
QWEN15_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "decoder_sparse_step": 1,
              "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 8192,
              "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60,
              "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632,
              "sliding_window": 32768, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                 "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
                 "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
                 "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
                 "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
                 "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize(("cfg", "family", "expected"), [
    (MIXTRAL_8X7B, "mixtral", dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=None, ffn_hidden_size=14336,
                                   moe_router_topk_normalize=True, moe_shared_expert_intermediate_size=None,
                                   moe_aux_loss_coeff=0.02, add_qkv_bias=False, qk_layernorm=False)),
    (QWEN15_MOE, "qwen2_moe", dict(num_experts=60, moe_router_topk=4, moe_ffn_hidden_size=1408,
                                   moe_router_topk_normalize=False, moe_shared_expert_intermediate_size=5632,
                                   moe_shared_expert_gate=True, add_qkv_bias=True, qk_layernorm=False)),
    (QWEN3_30B_A3B, "qwen3_moe", dict(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, kv_channels=128,
                                      moe_router_topk_normalize=True, moe_shared_expert_gate=False, qk_layernorm=True,
                                      moe_aux_loss_coeff=0.001)),
], ids=["mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b"])
def test_published_configs_give_the_moe_fields(cfg: dict[str, Any], family: str, expected: dict[str, Any]) -> None:
    hf = families.model_from_hf_config(cfg)
    assert hf.family == family and hf.notes == ()
    assert {k: getattr(hf.model, k) for k in expected} == expected


@pytest.mark.parametrize(("cfg", "recipe"), [(MIXTRAL_8X7B, "mixtral-8x7b"), (QWEN3_30B_A3B, "qwen3-30b-a3b")])
def test_the_shipped_recipes_describe_the_published_models(cfg: dict[str, Any], recipe: str) -> None:
    """hf-to-mcore --recipe mixtral-8x7b on the published Mixtral is accepted (no field differs), and a recipe
    with another expert count, top-k or expert width is refused naming each field."""
    model = load_recipe(recipe).recipe.model
    hf = families.model_from_hf_config(cfg).model
    assert families.differences(model, hf) == []
    from dataclasses import replace

    wrong = replace(model, num_experts=16, moe_router_topk=1, moe_ffn_hidden_size=512)
    assert [d[0] for d in families.differences(wrong, hf)] == ["num_experts", "moe_router_topk", "moe_ffn_hidden_size"]


@pytest.mark.parametrize("cfg", [MIXTRAL_8X7B, QWEN15_MOE, QWEN3_30B_A3B], ids=["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_config_written_from_the_recipe_reads_back_as_the_same_model(cfg: dict[str, Any]) -> None:
    """mcore-to-hf without a Hugging Face config writes one from the checkpoint's model: it must read back as
    the same architecture in the same family (what transformers then builds is tested in tests/megatron)."""
    hf = families.model_from_hf_config(cfg)
    written = families.hf_config_from_model(hf.model, family=hf.family, vocab_size=hf.vocab_size, dtype="bfloat16")
    again = families.model_from_hf_config(written)
    assert again.family == hf.family and families.differences(again.model, hf.model) == []
    assert again.model.moe_aux_loss_coeff == hf.model.moe_aux_loss_coeff


@pytest.mark.parametrize(("change", "message"), [
    ({"mlp_only_layers": [0, 5]}, "mlp_only_layers [0, 5]: dense layers between the MoE layers are not converted"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2: dense layers"),
    ({"num_experts": 1}, "needs >= 2 experts"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok 200 of 128 experts"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
     "(DeepSeek-V2: softmax scores with per-group maxima"),
])
def test_what_does_not_map_exactly_is_refused_in_one_line(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        families.model_from_hf_config({**QWEN3_30B_A3B, **change})
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "Qwen3MoeForCausalLM" in str(e.value)  # the valid architectures are named


@pytest.mark.parametrize(("cfg", "family", "message"), [
    (QWEN15_MOE, "mixtral", "a shared expert does not fit family 'mixtral'"),
    (QWEN15_MOE, "qwen3_moe", "a shared expert does not fit family 'qwen3_moe'"),
    (MIXTRAL_8X7B, "llama", "a mixture of experts (8 experts) does not fit family 'llama'"),
    (MIXTRAL_8X7B, "qwen2_moe", "an MoE layer without a gated shared expert does not fit family 'qwen2_moe'"),
])
def test_a_family_that_cannot_hold_the_model_is_refused(cfg: dict[str, Any], family: str, message: str) -> None:
    model = families.model_from_hf_config(cfg).model
    with pytest.raises(UnsupportedModelError) as e:
        families.hf_config_from_model(model, family=family, vocab_size=1000, dtype="bfloat16")
    assert message in str(e.value) and "\n" not in str(e.value)


def _model_dir(root: Path, cfg: dict[str, Any]) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer_config.json").write_text("{}")
    return root


TINY_QWEN3_MOE = {**QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "moe_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128, "vocab_size": 300,
                  "router_aux_loss_coef": 0.002}


def test_from_hf_takes_the_moe_fields_and_refuses_a_contradicting_set(tmp_path: Path) -> None:
    values = model_values("M", TINY_QWEN3_MOE, 4096)
    assert (values["num_experts"], values["moe_router_topk"], values["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert values["moe_router_topk_normalize"] is True and values["moe_aux_loss_coeff"] == 0.002
    hf = _model_dir(tmp_path / "hf", TINY_QWEN3_MOE)
    sets = ["model.moe_aux_loss_coeff=0.01"]  # a training choice: the --set wins
    loaded = load_recipe("sft-llama3-1b", sets, layers=submit_layers("sft-llama3-1b", sets, from_hf=str(hf), data=None))
    m = loaded.recipe.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.qk_layernorm, m.moe_aux_loss_coeff) == \
        (4, 2, 32, True, 0.01)
    check_moe(loaded.recipe)  # what preflight asks of an MoE recipe holds for the derived fields
    with pytest.raises(ConfigError) as e:
        submit_layers("sft-llama3-1b", ["model.num_experts=8"], from_hf=str(hf), data=None)
    message = str(e.value)
    assert message.startswith("model.num_experts: --set model.num_experts=8 contradicts") and "\n" not in message
    assert "num_local_experts / num_experts: model.num_experts 4" in message
