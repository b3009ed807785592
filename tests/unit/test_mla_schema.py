"""Multi-latent attention (config/model/mla.py) before submit: bad MLA settings are refused by `megalaunch submit
--dry-run` in one line naming the field, nothing written; good ones render Megatron's MLA flags; the planner counts
MLA's parameters as Megatron does (DeepSeek-V3: 671 B); and DeepSeek-V3 configs that cannot convert exactly are
refused in one line (conversion/families_deepseek.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.unit.helpers import cli

from megalaunch.config.loader import load_recipe
from megalaunch.config.planner.fit import model_shape
from megalaunch.conversion import families
from megalaunch.conversion.errors import UnsupportedModelError

# (id, --set values on the tiny-deepseek recipe, the field the line must name)
CASES: list[tuple[str, list[str], str]] = [
    ("MLA field without MLA", ["model.multi_latent_attention=false"], "model.kv_lora_rank"),
    ("grouped-query attention", ["model.num_query_groups=2"], "model.num_query_groups"),
    ("kv_channels", ["model.kv_channels=16"], "model.kv_channels"),
    ("odd rope part", ["model.qk_pos_emb_head_dim=7"], "model.qk_pos_emb_head_dim"),
    ("zero latent", ["model.kv_lora_rank=0"], "model.kv_lora_rank"),
    ("yarn settings with plain rope", ["model.rope_type=rope"], "model.rotary_scaling_factor"),
    ("Llama 3.1 rope scaling", ["model.use_rope_scaling=true"], "model.use_rope_scaling"),
    ("Megatron's local attention", ["training.attention=local"], "training.attention"),
]


def _submit(tmp_path: Path, sets: list[str]) -> Any:
    recipe = tmp_path / "ds.yaml"
    recipe.write_text(f"include: [tiny-deepseek]\nname: ds\nrun: {{root: {tmp_path / 'runs'}}}\n")
    return cli("submit", str(recipe), "--dry-run", *[a for s in sets for a in ("--set", s)])


@pytest.mark.parametrize(("case_id", "sets", "field"), CASES, ids=[c[0] for c in CASES])
def test_bad_mla_setting_is_refused_in_one_line(case_id: str, sets: list[str], field: str, tmp_path: Path) -> None:
    proc = _submit(tmp_path, sets)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("megalaunch: error:"), proc.stderr
    assert field in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()


def test_good_mla_settings_render_megatrons_flags(tmp_path: Path) -> None:
    proc = _submit(tmp_path, ["model.q_lora_rank=null"])
    assert proc.returncode == 0, proc.stderr
    for flag in ("--multi-latent-attention", "--kv-lora-rank 16", "--qk-head-dim 16", "--qk-pos-emb-head-dim 8",
                 "--v-head-dim 12", "--rope-type yarn", "--rotary-scaling-factor 4.0", "--mscale-all-dim 1.0",
                 "--moe-layer-freq '[0,1,1]'", "--moe-router-enable-expert-bias"):
        assert flag in proc.stdout, flag
    assert "--q-lora-rank" not in proc.stdout and "--group-query-attention" not in proc.stdout


def test_planner_counts_deepseek_v3_as_published() -> None:
    """671 B parameters (the published count, MTP excluded), MLA's projections as Megatron counts them."""
    recipe = load_recipe("deepseek-v3").recipe
    shape = model_shape(recipe, 129280)
    assert 670e9 < shape.total_params() < 672e9
    assert shape.attn_width == (128 * 192 + 128 * 128) / 2


DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
            "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
            "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "num_nextn_predict_layers": 1, "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


def test_published_deepseek_v3_config_is_the_shipped_recipe() -> None:
    hf = families.model_from_hf_config(DEEPSEEK)
    assert hf.family == "deepseek_v3"
    assert families.differences(load_recipe("deepseek-v3").recipe.model, hf.model) == []


@pytest.mark.parametrize(("change", "message"), [
    ({"quantization_config": {"quant_method": "fp8"}}, "dequantise the checkpoint to bf16"),
    ({"rope_interleave": False}, "rope_interleave: false"),
    ({"topk_group": 2}, "topk_group 2 != 2"),
    ({"norm_topk_prob": False}, "norm_topk_prob: false"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 8192}}, "differs from"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}, "DeepSeek-V2"),
])
def test_deepseek_configs_that_do_not_map_are_refused_in_one_line(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        families.model_from_hf_config({**DEEPSEEK, **change})
    assert message in str(e.value) and "\n" not in str(e.value)
